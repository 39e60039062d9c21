#!/usr/bin/env python3
"""Record llama.cpp's logits on the fixture models, once, for tests/test_llamacpp_referee.py.

    .venv/bin/python tools/record_llamacpp_logits.py                 # every (arch, type)
    .venv/bin/python tools/record_llamacpp_logits.py --arch gemma3 --type Q4_K Q6_K

For each combination, tests/fixture_models.py writes the model from its seed,
llama.cpp (llama-cpp-python, one thread, flash attention, F32 K/V cache so that
float models compare tightly) evaluates a fixed 12-token id sequence, and
tests/fixtures/llamacpp/<arch>-<type>.npz receives the logits of the recorded
positions (float32), the ids, the generator's parameters (JSON), the model
file's sha256 and its content's (fixture_models.content_sha256). A combination llama.cpp refuses to load is reported and skipped.

llama-cpp-python is needed only here, never by `make test`.
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from fixture_models import (ARCHS, DEFAULT_SEED, TYPES, content_sha256, fixture_spec, sha256_of,  # noqa: E402
                            write_fixture_model)

OUT_DIR = ROOT / "tests" / "fixtures" / "llamacpp"
N_IDS = 12
# Positions whose logits are kept (all 12 would triple the fixtures): the first,
# some inside gemma3's window of 4, and the last ones, past it.
POSITIONS = (0, 2, 3, 5, 8, 11)
N_CTX = 64
GGML_TYPE_F32 = 0


def fixture_ids(vocab_size: int, seed: int) -> list[int]:
    """The id sequence every fixture is evaluated on (also used by the test)."""
    return np.random.default_rng([seed, 12345]).integers(0, vocab_size, N_IDS).tolist()


def record_one(arch: str, type_name: str, seed: int, workdir: Path) -> dict:
    import llama_cpp

    spec = fixture_spec(arch, type_name, seed)
    path = write_fixture_model(workdir / f"{arch}-{type_name}.gguf", arch, type_name, seed)
    sha = sha256_of(path)
    params = spec.as_dict()
    ids = fixture_ids(params["vocab_size"], seed)
    llm = llama_cpp.Llama(str(path), n_ctx=N_CTX, n_batch=N_CTX, n_threads=1, n_threads_batch=1,
                          logits_all=True, flash_attn=True, type_k=GGML_TYPE_F32,
                          type_v=GGML_TYPE_F32, verbose=False)
    try:
        llm.eval(ids)
        logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
    finally:
        llm.close()
    if not np.isfinite(logits).all():
        raise RuntimeError(f"{arch}-{type_name}: llama.cpp returned non-finite logits")
    record = dict(
        logits=logits[list(POSITIONS)], positions=np.array(POSITIONS, dtype=np.int32),
        ids=np.array(ids, dtype=np.int32), sha256=np.array(sha),
        content_sha256=np.array(content_sha256(path)),
        params=np.array(json.dumps(params, sort_keys=True)),
        llama_cpp_version=np.array(llama_cpp.__version__),
        system_info=np.array(llama_cpp.llama_print_system_info().decode(errors="replace")),
        settings=np.array(json.dumps(dict(n_ctx=N_CTX, n_threads=1, flash_attn=True,
                                          type_k="f32", type_v="f32")))
    )
    np.savez_compressed(OUT_DIR / f"{arch}-{type_name}.npz", **record)
    return dict(spread=float(logits.max() - logits.min()), sha=sha[:12])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", choices=list(ARCHS), default=list(ARCHS))
    parser.add_argument("--type", nargs="+", choices=list(TYPES), default=list(TYPES))
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("record_llamacpp_logits: llama-cpp-python is not installed", file=sys.stderr)
        return 2
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch:
            for type_name in args.type:
                try:
                    info = record_one(arch, type_name, args.seed, Path(tmp))
                except (ValueError, RuntimeError) as error:
                    failed.append(f"{arch}-{type_name}")
                    print(f"{arch:7} {type_name:5} refused: {error}")
                    continue
                print(f"{arch:7} {type_name:5} spread {info['spread']:7.3f}  sha256 {info['sha']}")
    total = sum(p.stat().st_size for p in OUT_DIR.glob("*.npz"))
    print(f"{OUT_DIR}: {total / 1e3:.0f} kB" + (f"; not recorded: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
