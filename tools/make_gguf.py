#!/usr/bin/env python3
"""Write a random-weight GGUF (llama by default, or any --arch llambda runs) for tests and benchmarks.

    python tools/make_gguf.py --preset 1.1b --type Q4_0 -o /tmp/tinyllama-shape.gguf
    python tools/make_gguf.py --preset tiny --type F16 --dim 36 --n-head 3 --n-kv-head 1 -o t.gguf
    python tools/make_gguf.py --preset 0.5b --tokenizer-from SmolLM2.gguf -o m.gguf
    python tools/make_gguf.py --arch gemma3 --head-dim 256 --sliding-window 512 --type Q8_0 -o g.gguf

A preset gives every shape; any --option overrides it.
"""
import argparse
import sys
import time
from pathlib import Path

# The random-model makers live with the tests, their main user.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from synth import PRESETS, SUPPORTED_TYPES, write_random_llama  # noqa: E402
from synth_arch import ARCHS, write_random_model  # noqa: E402

SHAPE_OPTIONS = ("n_layer", "dim", "n_head", "n_kv_head", "ffn_dim", "vocab_size")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--arch", choices=ARCHS, default="llama",
                        help="architecture: tensor names and metadata as llama.cpp expects them")
    parser.add_argument("--head-dim", type=int, help="default dim / n_head (gemma3: 256)")
    parser.add_argument("--sliding-window", type=int, help="gemma3: window of the local layers")
    parser.add_argument("--type", dest="tensor_type", choices=SUPPORTED_TYPES, default="Q4_1",
                        help="type of the linear weights (default Q4_1)")
    parser.add_argument("--embed-type", choices=SUPPORTED_TYPES,
                        help="type of the token embedding (default: --type)")
    parser.add_argument("-o", "--output", type=Path, required=True)
    for name in SHAPE_OPTIONS:
        parser.add_argument("--" + name.replace("_", "-"), type=int, help="override the preset")
    parser.add_argument("--untied", action="store_true",
                        help="write a separate output.weight instead of reusing token_embd")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--rope-base", type=float, default=10000.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer-from", type=Path,
                        help="copy tokenizer.* from this GGUF (its vocabulary size wins)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = dict(PRESETS[args.preset])
    shape.update({name: getattr(args, name) for name in SHAPE_OPTIONS
                  if getattr(args, name) is not None})
    started = time.perf_counter()
    common = dict(tensor_type=args.tensor_type, embed_type=args.embed_type, tied=not args.untied,
                  n_ctx=args.n_ctx, seed=args.seed, rope_base=args.rope_base,
                  tokenizer_from=args.tokenizer_from, **shape)
    try:
        if args.arch == "llama" and args.head_dim is None and args.sliding_window is None:
            path = write_random_llama(args.output, **common)
        else:
            path = write_random_model(args.output, arch=args.arch, head_dim=args.head_dim,
                                      sliding_window=args.sliding_window, **common)
    except (ValueError, OSError) as error:
        print(f"make_gguf: {error}", file=sys.stderr)
        return 2
    size_mb = path.stat().st_size / 1e6
    print(f"{path}: {size_mb:.1f} MB, {args.arch}, {shape}, {args.tensor_type}, "
          f"{time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
