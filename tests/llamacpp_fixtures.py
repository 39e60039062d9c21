"""llama.cpp's logits on seeded random models, recorded once by
tools/record_llamacpp_logits.py into tests/fixtures/llamacpp/<case>.npz, read back here.

A recording carries what its model is a function of (``params``), the sha256 of the
file llama.cpp ran, the ids it evaluated and its logits at ``positions``; the tests
rewrite the model, check that it is still the recorded one and compare with it.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

RECORDINGS = Path(__file__).parent / "fixtures" / "llamacpp"
RECORD = "tools/record_llamacpp_logits.py"


class Recording:
    """tests/fixtures/llamacpp/<name>.npz; a missing file fails the test, naming how to record it."""

    def __init__(self, name: str, how: str = ""):
        path = RECORDINGS / f"{name}.npz"
        if not path.exists():
            import pytest
            pytest.fail(f"{path} is missing: run {RECORD} {how}(needs llama-cpp-python)")
        with np.load(path) as data:
            self.logits = data["logits"].astype(np.float32)
            self.positions = data["positions"].tolist()
            self.ids = data["ids"].tolist()
            self.sha256 = str(data["sha256"])
            self.content_sha256 = str(data["content_sha256"]) if "content_sha256" in data else None
            self.params = json.loads(str(data["params"]))


def synth_recording(set_name: str, model: str, directory) -> tuple[Recording, Path]:
    """The recording ``<set_name>-<model>`` of a synth.write_random_llama model and that
    model, rewritten into ``directory`` from the recorded parameters and checked by sha256."""
    from synth import write_random_llama
    from fixture_models import sha256_of
    recording = Recording(f"{set_name}-{model}", how=f"--set {set_name} ")
    path = write_random_llama(Path(directory) / f"{set_name}-{model}.gguf", **recording.params)
    assert sha256_of(path) == recording.sha256, (
        f"{set_name}-{model}: tests/synth.py now writes another file than the one llama.cpp's "
        f"logits were recorded on: re-record with {RECORD} --set {set_name}")
    return recording, path
