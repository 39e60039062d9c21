"""A bounded, seeded slice of the fuzz campaign (tools/fuzz.py): hostile GGUF and llambda
files, text and templates end in a result or a one-line error, never a crash, a hang or
a traceback. `tools/fuzz.py --minutes N` runs the long campaign."""
import importlib.util
import random
from pathlib import Path

import pytest
from repo_paths import TOOLS

CASES = 50           # a fixed number, seeded: each kind (gguf, llb, text, template, cli) 10 times
SEED = 20261201

_spec = importlib.util.spec_from_file_location("llambda_fuzz", TOOLS / "fuzz.py")
fuzz = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz)


def test_a_seeded_slice_of_the_fuzz_campaign(tmp_path, monkeypatch):
    from llambda.runtime import library
    monkeypatch.setenv("LLAMBDA_KERNEL_DIR", str(library.ensure_built()))    # no rebuild in the private cache
    monkeypatch.setenv("LLAMBDA_CACHE_DIR", str(tmp_path / "cache"))
    tried, failures = fuzz.campaign(seed=SEED, cases=CASES, folder=tmp_path / "failures",
                                    workdir=tmp_path / "work")
    assert tried == CASES
    assert not failures, "\n\n".join(f"{case.name} ({case.description}):\n{report[:3000]}"
                                     for case, report in failures)


def test_the_mutators_are_reproducible(tmp_path):
    data = bytes(range(256)) * 64
    assert fuzz.mutate_gguf(data, random.Random(1)) == fuzz.mutate_gguf(data, random.Random(1))
    assert fuzz.random_template(random.Random(3)) == fuzz.random_template(random.Random(3))


@pytest.mark.parametrize("index", range(4))
def test_gguf_fields_finds_the_structure_of_a_real_layout(tmp_path, index):
    from synth import write_random_llama
    path = write_random_llama(tmp_path / "m.gguf", n_layer=1, dim=64, n_head=2, n_kv_head=1, ffn_dim=64,
                              vocab_size=300, tensor_type="Q8_0", n_ctx=64, seed=index)
    fields = fuzz.gguf_fields(path.read_bytes())
    kinds = {what for _, _, what in fields}
    assert {"tensor count", "kv count", "key length", "n_dims", "dim", "tensor type", "tensor offset",
            "array count"} <= kinds
