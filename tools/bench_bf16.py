#!/usr/bin/env python3
"""BF16 weights, three ways, one core: the AVX512_BF16 kernel (codegen/gemm_bf16.py,
``vdpbf16ps`` on bf16 pair panels, activations rounded to bf16), the float kernel on
kind "bf16" (what a BF16 GGUF loads as: the 16 bits kept, widened exactly in the kernel),
the float kernel on the same weights stored as f32, and the f16 kernel on the f16
rounding of the same matrix, for comparison.

    .venv/bin/python tools/bench_bf16.py [--ms 1,128,512]

GFLOP/s count 2 m n k per call (the bf16 kernel does the same multiply-adds); the
weight GB/s column is the bytes of each layout per call, which is what a decode step
(m = 1) pays for. Calls go straight to the kernels (the bindings' call tuples, validated
once), so small shapes show no binding overhead. The activation rounding to bf16 that
a wired bf16 path would also pay is timed on its own (numpy here).
"""
import argparse
import sys
import time

import numpy as np

SHAPES = [(576, 576), (1536, 576), (576, 1536)]


def _best(fn, budget=0.3):
    fn()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < budget:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,128,512", help="comma-separated activation row counts")
    args = ap.parse_args(argv)
    import gguf
    from llambda.runtime import buffers, layout_bf16, layout_float
    from llambda.runtime.native import gemm, gemm_bf16
    from llambda.runtime.native._lib import kernel
    if not gemm_bf16.bf16_supported():
        print(f"bench_bf16: this CPU lacks {gemm_bf16.CPU_FLAG}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    print("| m | n x k | vdpbf16ps (bf16 pairs) | float kernel, kind bf16 | float kernel, kind f32 | f16 kernel | "
          "weight bytes bf16 / f32 | rounding x to bf16 |")
    print("|---:|---|---:|---:|---:|---:|---|---:|")
    for m in (int(s) for s in args.ms.split(",")):
        for n, k in SHAPES:
            w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
            raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.BF16)
            widened = layout_float.pack("BF16", raw, n, k)
            packed = {"pairs": layout_bf16.pack("BF16", raw, n, k), "bf16": widened,
                      "f32": layout_float.pack("F32", layout_float.dequantize(widened), n, k),
                      "f16": layout_float.pack("F16", w.astype(np.float16), n, k)}
            x = buffers.aligned_copy(rng.standard_normal((m, k)).astype(np.float32))
            xb = layout_bf16.to_bf16(x)
            out = buffers.zeros((m, n), np.float32)
            calls = {"pairs": gemm_bf16.gemm_bf16_pairs_call(xb, packed["pairs"], out),
                     "bf16": gemm.gemm_bf16_call(x, packed["bf16"], out),
                     "f32": gemm.gemm_f32_call(x, packed["f32"], out),
                     "f16": gemm.gemm_f16_call(x, packed["f16"], out)}
            gflops = {}
            for name, (symbol, call_args) in calls.items():
                fn = kernel(symbol)
                gflops[name] = 2 * m * n * k / _best(lambda: fn(*call_args)) / 1e9
            rounding = _best(lambda: layout_bf16.to_bf16(x, xb))
            print(f"| {m} | {n}x{k} | {gflops['pairs']:.1f} GFLOP/s | {gflops['bf16']:.1f} GFLOP/s | "
                  f"{gflops['f32']:.1f} GFLOP/s | "
                  f"{gflops['f16']:.1f} GFLOP/s | {n * k * 2 / 1e6:.2f} / {n * k * 4 / 1e6:.2f} MB | "
                  f"{rounding * 1e6:.0f} us |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
