#!/usr/bin/env python3
"""Record llama.cpp's logits on small random-weight Q4_K / Q5_K llama GGUFs, as a test fixture.

    tools/record_kquant_fixtures.py   (needs llama-cpp-python; writes tests/fixtures/llama_cpp_kquant_logits.npz)

The models come from llambda.synth with a fixed seed and awkward sizes (3 heads of
256, GQA 3:1, k = 768 and 512: three and two super-blocks), so tests/test_model_kquants.py
rewrites the same bytes and checks them by sha256 before comparing the fast path and
the reference forward with these logits. llama.cpp is the independent referee; it is
never a test dependency.
"""
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from llambda.synth import write_random_llama

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llama_cpp_kquant_logits.npz"
SHAPE = dict(n_layer=2, dim=768, n_head=3, n_kv_head=1, ffn_dim=512, vocab_size=320)
SEED = 13
# (linear weights, token embedding, tied LM head)
MODELS = {"Q4_K": ("Q4_K", "Q4_K", True), "Q5_K": ("Q5_K", "Q4_K", False)}
PROMPT_LENGTH = 40


def model_path(directory, name):
    """Write the fixture's model ``name`` into ``directory``; return (path, sha256)."""
    tensor_type, embed_type, tied = MODELS[name]
    path = Path(directory) / f"tiny-{name}.gguf"
    write_random_llama(path, tensor_type=tensor_type, embed_type=embed_type, tied=tied, seed=SEED,
                       n_ctx=256, **SHAPE)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def prompt():
    return np.random.default_rng(SEED).integers(0, SHAPE["vocab_size"], PROMPT_LENGTH).tolist()


def main():
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit("record_kquant_fixtures: needs llama-cpp-python (see README)")
    ids = prompt()
    # everything the test needs to rewrite the models, so it does not import this tool
    arrays = dict(ids=np.array(ids, np.int32),
                  synth=np.array(json.dumps(dict(shape=SHAPE, seed=SEED, n_ctx=256, models=MODELS))))
    with tempfile.TemporaryDirectory() as directory:
        for name in MODELS:
            path, digest = model_path(directory, name)
            llm = Llama(str(path), logits_all=True, n_ctx=256, flash_attn=True, verbose=False, n_threads=1)
            llm.eval(ids)
            arrays[f"{name}_logits"] = np.array(llm.scores[:len(ids)], np.float16)   # ample for the tolerances
            arrays[f"{name}_sha256"] = np.array(digest)
    FIXTURE.parent.mkdir(exist_ok=True)
    np.savez_compressed(FIXTURE, **arrays)
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
