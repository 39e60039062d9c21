#!/usr/bin/env python3
"""qgemm at few activation rows, called straight through ctypes (no binding checks), one thread.

    tools/bench_qgemm_rows.py [--kinds Q4_1,Q8_0] [--ms 1,2,4,8,16] [--shapes 1536x576,...]
                              [--isa avx2|avx512] [--lib A.so --lib B.so] [--rounds 3]

Shapes are n x k (output columns x reduction), the model's by default (SmolLM2-135M:
q, o; k, v; gate, up; down; the LM head). Each figure is the best time of a call over
copies of the weight that together overflow the L2 cache (the weights of a serving step
come from memory or L3, not L2), less the cost of an empty call measured the same way.
Reported as GOP/s (2 m n k per call) and as GB/s of weight bytes streamed.

``--lib`` (repeatable) times the same symbol from several kernel libraries, interleaved
round by round, for A/B comparisons on a busy machine; by default the current library.
"""
import argparse
import ctypes
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
STREAM_BYTES = 24 << 20


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="Q4_1,Q8_0")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--shapes", help="n x k, comma-separated (default: the model's)")
    ap.add_argument("--isa", action="append",
                    help="qgemm variant (repeatable: one column each; default: the binding's choice for m)")
    ap.add_argument("--lib", action="append", help="kernel library .so to time (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hot", action="store_true", help="one copy of the weight (cache-resident when it fits)")
    ap.add_argument("--budget", type=float, default=0.15, help="seconds per figure per round")
    args = ap.parse_args(argv)

    from llambda.runtime import buffers, layouts, library
    from llambda.runtime.native import quant
    from llambda.codegen.contract import block_multiple, qgemm_symbol
    sys_path = os.path.dirname(os.path.abspath(__file__))
    import sys
    sys.path.insert(0, sys_path)
    from bench_kernels import _copy, _random_weight

    libs = args.lib or [str(library.load("avx2").directory / "libllambda.so")]
    isas = args.isa or [None]
    dlls = [ctypes.CDLL(path) for path in libs]
    variants = [(dll, isa) for dll in dlls for isa in isas]
    shapes = ([tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES)
    rng = np.random.default_rng(0)

    def fn(dll, symbol):
        """The symbol in ``dll``; a library from before a kind's AVX2 decode kernel (1x16) has only
        its main tile (the same arguments), which is timed instead."""
        try:
            f = getattr(dll, symbol)
        except AttributeError:
            kind, isa = "_".join(symbol.split("_")[2:4]), symbol.rsplit("__", 1)[1]
            f = getattr(dll, qgemm_symbol(kind, quant.qgemm_tile(kind, isa), isa))
        f.restype = None
        f.argtypes = [ctypes.c_size_t] * (11 if any(k in symbol for k in ("q6_k", "q3_k", "q2_k")) else 10)
        return f

    def best(f, calls, budget):
        runs, top, start = 0, float("inf"), time.perf_counter()
        while runs < 3 or time.perf_counter() - start < budget:
            t = time.perf_counter()
            for a in calls:
                f(*a)
            top = min(top, (time.perf_counter() - t) / len(calls))
            runs += 1
        return top

    names = [f"lib{i}" + (f" {isa}" if isa else "") for i in range(len(libs)) for isa in isas]
    print("| kind | m | n x k | isa | " + " | ".join(f"{v} GOP/s | {v} GB/s" for v in names) + " |")
    print("|---|---:|---|---|" + "---:|---:|" * len(variants))
    for n, k in shapes:
        for kind in args.kinds.split(","):
            w = _random_weight(kind, n, k, rng)
            copies = [w] + [_copy(w) for _ in range(0 if args.hot else -(-STREAM_BYTES // w.nbytes) - 1)]
            for m in [int(x) for x in args.ms.split(",")]:
                x = buffers.aligned_copy(rng.standard_normal((m, k), dtype=np.float32))
                qs, d, s = buffers.empty((m, k), np.int8), buffers.empty((m, k // 32)), buffers.empty((m, k // 32))
                quant.quantize_q8(x, qs, d, s)
                out = buffers.empty((m, n))
                runs = []
                for isa in isas:
                    calls = [quant.qgemm_call(qs, d, s, c, out, isa=isa) for c in copies]
                    arglists = [a for _, a in calls]
                    # an empty call: the same symbol on 8 columns of one block (K-quants: of
                    # one super-block; a kb of 1 would count their super-block loop from 0)
                    tiny = list(arglists[0])
                    tiny[-4:] = [1, 1, block_multiple(w.kind) // 32, n]
                    runs.append((calls[0][0], arglists, tiny))
                times = [[] for _ in variants]
                for _ in range(args.rounds):
                    for i, (dll, isa) in enumerate(variants):
                        symbol, arglists, tiny = runs[isas.index(isa)]
                        f = fn(dll, symbol)
                        empty = best(f, [tiny] * 64, 0.02)
                        times[i].append(best(f, arglists, args.budget) - empty)
                cells = []
                for t in times:
                    t = min(t)
                    cells += [f"{2 * m * n * k / t / 1e9:.0f}", f"{w.nbytes / t / 1e9:.1f}"]
                isa = "/".join(run[0].rsplit("__", 1)[1] for run in runs)
                print(f"| {kind} | {m} | {n}x{k} | {isa} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
