#!/usr/bin/env python3
"""Record llama.cpp's logits on seeded random-weight models, once, as test fixtures.

    .venv/bin/python tools/record_llamacpp_logits.py                  # every set
    .venv/bin/python tools/record_llamacpp_logits.py --set referee --arch gemma3 --type Q4_K Q6_K
    .venv/bin/python tools/record_llamacpp_logits.py --set q5 kquant

Each case writes its model from a seed, llama.cpp (llama-cpp-python, one thread,
flash attention) evaluates a fixed id sequence on it, and
tests/fixtures/llamacpp/<case>.npz receives the logits of the recorded positions,
the ids, the generator's parameters (JSON), the model file's sha256, and the
llama.cpp version and settings. tests/llamacpp_fixtures.py reads them back.

The sets:
- referee: every (arch, type) of tests/fixture_models.py (F32 K/V cache, so that
  float models compare tightly; logits float32 at POSITIONS; also the content
  sha256, fixture_models.content_sha256) for tests/bench/test_llamacpp_referee.py.
- q5, kquant: synth.write_random_llama models of awkward shapes (q5: 3
  heads, GQA 3:1, k = 96 and 160; kquant: 3 heads of 256, GQA 3:1, k = 768 and
  512, three and two super-blocks), every position of a 40-id prompt, logits
  float16 (ample for the tolerances), for tests/kernels/test_q5.py and
  tests/model/test_model_kquants.py.

A case llama.cpp refuses to load is reported and skipped. llama-cpp-python is
needed only here, never by `make test`.
"""
import argparse
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fixture_models import (ARCHS, DEFAULT_SEED, TYPES, content_sha256, fixture_spec, sha256_of,  # noqa: E402
                            write_fixture_model)
from llamacpp_fixtures import RECORDINGS as OUT_DIR  # noqa: E402
from synth import write_random_llama  # noqa: E402

GGML_TYPE_F32 = 0

# ---------------------------------------------------------------- referee ---
REFEREE_IDS = 12
# Positions whose logits are kept (all 12 would triple the fixtures): the first,
# some inside gemma3's window of 4, and the last ones, past it.
REFEREE_POSITIONS = (0, 2, 3, 5, 8, 11)
REFEREE_SETTINGS = dict(n_ctx=64, n_batch=64, n_threads=1, n_threads_batch=1, flash_attn=True,
                        type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)

# ----------------------------------------------------- write_random_llama sets ---
SYNTH_SETTINGS = dict(n_ctx=256, n_threads=1, flash_attn=True)
SYNTH_PROMPT = 40
SYNTH_SETS = {
    "q5": dict(seed=11, shape=dict(n_layer=2, dim=96, n_head=3, n_kv_head=1, ffn_dim=160, vocab_size=320),
               models={"Q5_0": dict(tensor_type="Q5_0"), "Q5_1": dict(tensor_type="Q5_1")}),
    # (linear weights, token embedding, tied LM head)
    "kquant": dict(seed=13, shape=dict(n_layer=2, dim=768, n_head=3, n_kv_head=1, ffn_dim=512, vocab_size=320),
                   models={"Q4_K": dict(tensor_type="Q4_K", embed_type="Q4_K", tied=True),
                           "Q5_K": dict(tensor_type="Q5_K", embed_type="Q4_K", tied=False)}),
}
SETS = ("referee", *SYNTH_SETS)


@dataclass
class Case:
    """One model to record: ``write(path)`` writes it, ``params`` say how (JSON)."""
    name: str
    write: Callable[[Path], Path]
    params: dict
    ids: list
    positions: tuple
    settings: dict
    logits_dtype: type
    extra: Callable[[Path], dict] = field(default=lambda path: {})


def referee_ids(vocab_size: int, seed: int) -> list[int]:
    """The id sequence every referee fixture is evaluated on."""
    return np.random.default_rng([seed, 12345]).integers(0, vocab_size, REFEREE_IDS).tolist()


def referee_cases(archs, types, seed) -> list[Case]:
    cases = []
    for arch in archs:
        for type_name in types:
            params = fixture_spec(arch, type_name, seed).as_dict()
            cases.append(Case(f"{arch}-{type_name}",
                              lambda path, a=arch, t=type_name: write_fixture_model(path, a, t, seed),
                              params, referee_ids(params["vocab_size"], seed), REFEREE_POSITIONS,
                              REFEREE_SETTINGS, np.float32,
                              extra=lambda path: dict(content_sha256=np.array(content_sha256(path)))))
    return cases


def synth_cases(set_name) -> list[Case]:
    spec = SYNTH_SETS[set_name]
    ids = np.random.default_rng(spec["seed"]).integers(0, spec["shape"]["vocab_size"], SYNTH_PROMPT).tolist()
    cases = []
    for model, kwargs in spec["models"].items():
        params = dict(spec["shape"], **kwargs, seed=spec["seed"], n_ctx=SYNTH_SETTINGS["n_ctx"])
        cases.append(Case(f"{set_name}-{model}", lambda path, p=params: write_random_llama(path, **p),
                          params, ids, tuple(range(SYNTH_PROMPT)), SYNTH_SETTINGS, np.float16))
    return cases


def record(case: Case, workdir: Path) -> dict:
    import llama_cpp

    path = case.write(workdir / f"{case.name}.gguf")
    llm = llama_cpp.Llama(str(path), logits_all=True, verbose=False, **case.settings)
    try:
        llm.eval(case.ids)
        logits = np.array(llm.scores[:len(case.ids)], dtype=np.float32)
    finally:
        llm.close()
    if not np.isfinite(logits).all():
        raise RuntimeError(f"{case.name}: llama.cpp returned non-finite logits")
    settings = {k: ("f32" if k.startswith("type_") else v) for k, v in case.settings.items()}
    np.savez_compressed(
        OUT_DIR / f"{case.name}.npz",
        logits=logits[list(case.positions)].astype(case.logits_dtype),
        positions=np.array(case.positions, dtype=np.int32), ids=np.array(case.ids, dtype=np.int32),
        sha256=np.array(sha256_of(path)), params=np.array(json.dumps(case.params, sort_keys=True)),
        llama_cpp_version=np.array(llama_cpp.__version__),
        system_info=np.array(llama_cpp.llama_print_system_info().decode(errors="replace")),
        settings=np.array(json.dumps(settings)), **case.extra(path))
    return dict(spread=float(logits.max() - logits.min()), sha=sha256_of(path)[:12])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", nargs="+", choices=SETS, default=list(SETS))
    parser.add_argument("--arch", nargs="+", choices=list(ARCHS), default=list(ARCHS), help="referee set")
    parser.add_argument("--type", nargs="+", choices=list(TYPES), default=list(TYPES), help="referee set")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="referee set")
    args = parser.parse_args(argv)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("record_llamacpp_logits: llama-cpp-python is not installed", file=sys.stderr)
        return 2
    cases = referee_cases(args.arch, args.type, args.seed) if "referee" in args.set else []
    cases += [case for name in args.set if name in SYNTH_SETS for case in synth_cases(name)]
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            try:
                info = record(case, Path(tmp))
            except (ValueError, RuntimeError) as error:
                failed.append(case.name)
                print(f"{case.name:14} refused: {error}")
                continue
            print(f"{case.name:14} spread {info['spread']:7.3f}  sha256 {info['sha']}")
    total = sum(p.stat().st_size for p in OUT_DIR.glob("*.npz"))
    print(f"{OUT_DIR}: {total / 1e3:.0f} kB" + (f"; not recorded: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
