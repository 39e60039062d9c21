#!/usr/bin/env python3
"""Kernel benchmark: llambda's kernels on the shapes of real models, beside numpy
(OpenBLAS) and the machine's own ceilings, as ratios. One thread.

    tools/bench_kernels.py [--quick] [--markdown] [--kinds Q4_K,Q5_K] [--ms 1,16] [--shapes 192x576]

GEMM rows report GFLOP/s (2*m*n*k per call; for the int8 kernels the "ops"
are the same multiply-adds) and % of the FMA or INT8 peak; m = 1 rows report
the weight bytes streamed per second, over enough copies of the weight to
overflow the caches, and % of one core's read bandwidth. Every call goes
through the validating Python binding (~5-12 us), as a single op would; the
model's plans call the kernels directly.
numpy runs the same product in FP32 (x @ W.T with W dequantized).
The float kinds (F32, F16, BF16) get one row per kernel variant the CPU runs (avx2, the
baseline, and avx512), each against the FMA peak of its own register width.
"""
import argparse
import os
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # one core, like the kernels
import numpy as np  # noqa: E402

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (4096, 4096)]
MS = [1, 16, 128, 512]
KINDS = ["Q4_1", "Q4_0", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "F32", "F16", "BF16"]
# No quantizer here for these: random valid blocks (the speed does not depend on the values).
# Their rows need k % 256 == 0: other shapes skip them.
RANDOM_BLOCK_KINDS = ("Q6_K", "Q3_K", "Q2_K")
SUPER_BLOCK_KINDS = ("Q4_K", "Q5_K", *RANDOM_BLOCK_KINDS)


def _time(fn, budget=0.3, min_runs=3):
    fn()
    runs, best, start = 0, float("inf"), time.perf_counter()
    while runs < min_runs or time.perf_counter() - start < budget:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        runs += 1
    return best


STREAM_BYTES = 256 << 20       # far beyond the L3 cache


def _copy(w):
    from llambda.runtime import buffers, layouts
    return layouts.PackedWeight(w.kind, w.n, w.k, {name: buffers.aligned_copy(a) for name, a in w.arrays.items()},
                                dict(w.meta))


def _random_weight(kind, n, k, rng):
    import gguf
    from llambda.runtime import layouts
    if kind in RANDOM_BLOCK_KINDS:
        from llambda.runtime.ref.kquants16 import random_blocks
        return layouts.pack(kind, random_blocks(kind, n, k, rng, 1e-3), n, k)
    w = (rng.standard_normal((n, k), dtype=np.float32) * 0.05)
    if kind in SUPER_BLOCK_KINDS:
        # gguf has no K-quant quantizer: random valid super-blocks of a trained model's magnitude
        from llambda.runtime.ref import kquants
        return layouts.pack(kind, kquants.random_blocks(kind, n, k, rng, magnitude=1e-3), n, k)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w, qtype) if kind not in ("F32",) else w
    if kind == "F16":
        raw = w.astype(np.float16)
    return layouts.pack(kind, raw, n, k)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip the 4096x4096 and 49152x576 shapes")
    ap.add_argument("--kinds", help="comma-separated weight kinds to run (default: all)")
    ap.add_argument("--ms", help="comma-separated activation row counts m (default: 1,16,128,512)")
    ap.add_argument("--shapes", help="comma-separated n x k weight shapes, e.g. 192x576 (default: the list above)")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",") if args.kinds else KINDS
    ms = [int(m) for m in args.ms.split(",")] if args.ms else MS

    from llambda.runtime import buffers, ceilings, get_backend, layouts
    from llambda.runtime.linear import Linear
    be = get_backend("avx2")
    from llambda.runtime.native.quant import widest_qgemm_isa
    int8_isa = widest_qgemm_isa()
    peaks = dict(fma=ceilings.fma_peak_gflops(), int8=ceilings.int8_peak_gops(int8_isa),
                 bw=ceilings.read_bandwidth_gbs(1))
    zmm = ceilings.fma_peak_gflops("avx512")
    from llambda.runtime.native import gemm as n_gemm
    fma_peaks = {"avx2": peaks["fma"], "avx512": zmm}
    print(f"ceilings (measured, one core): FMA {peaks['fma']:.0f} GFLOP/s with ymm"
          + (f" ({zmm:.0f} with zmm)" if zmm else "")
          + f", INT8 {peaks['int8']:.0f} GOP/s ({'vpdpbusd zmm' if int8_isa == 'avx512' else 'vpmaddubsw+vpmaddwd ymm'},"
          f" the int8 GEMM's ISA), read {peaks['bw']:.1f} GB/s. FP32 % of ceiling is against the FMA peak"
          " of the variant's registers (ymm for avx2, zmm for avx512).")
    print()
    print("| kernel | m | n x k | llambda | numpy f32 | vs numpy | % of ceiling |")
    print("|---|---:|---|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    shapes = SHAPES[:3] if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    for n, k in shapes:
        for kind in kinds:
            if kind in SUPER_BLOCK_KINDS and k % 256:
                continue
            w = _random_weight(kind, n, k, rng)
            wf = layouts.dequantize(w) if n * k <= 49152 * 576 else None
            lin = Linear(be, max(ms), k)
            # m = 1 streams weights: time it over copies that together overflow the caches
            copies = [w] + [_copy(w) for _ in range(-(-STREAM_BYTES // w.nbytes) - 1)]
            variants = [(kind, None)]
            if w.kind in n_gemm.KINDS:
                variants = [(f"{kind} {isa}", isa) for isa in n_gemm.gemm_isas()]
            for m, (label, isa) in ((m, v) for m in ms for v in variants):
                x = buffers.aligned_copy(rng.standard_normal((m, k), dtype=np.float32))
                out = buffers.empty((m, n))
                if isa is None:
                    run = lin
                else:
                    op = getattr(n_gemm, f"gemm_{w.kind}")
                    run = lambda x, c, out: op(x, c, out, isa=isa)       # noqa: E731
                if m == 1:
                    t = _time(lambda: [run(x, c, out) for c in copies]) / len(copies)
                else:
                    t = _time(lambda: run(x, w, out))
                t_np = _time(lambda: x @ wf.T) if wf is not None else float("nan")
                flops = 2.0 * m * n * k
                if m == 1:
                    rate = w.nbytes / t / 1e9
                    cell, ceiling = f"{rate:.1f} GB/s", rate / peaks["bw"]
                    np_cell = f"{wf.nbytes / t_np / 1e9:.1f} GB/s" if wf is not None else "-"
                else:
                    rate = flops / t / 1e9
                    peak = peaks["int8"] if kind.startswith("Q") else fma_peaks[isa or "avx2"]
                    cell, ceiling = f"{rate:.1f} GFLOP/s", rate / peak
                    np_cell = f"{flops / t_np / 1e9:.1f} GFLOP/s" if wf is not None else "-"
                print(f"| {label} | {m} | {n}x{k} | {cell} | {np_cell} | {t_np / t:.2f}x | {ceiling:.0%} |",
                      flush=True)


if __name__ == "__main__":
    main()
