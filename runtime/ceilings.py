"""The machine's own ceilings, measured with llambda's probe kernels.

FMA peak (GFLOP/s per core), INT8 maddubs+maddwd peak (GOP/s per core) and
memory read bandwidth (GB/s) on 1..N threads. Benchmarks report every figure
as a fraction of these.
"""
import threading
import time

import numpy as np

from . import buffers
from .library import load

FMA_FLOP_PER_ITER = 12 * 8 * 2        # 12 ymm FMAs of 8 lanes, 2 FLOP each
INT8_OPS_PER_ITER = 6 * 32 * 2        # 6 maddubs of 32 byte pairs, multiply + add
INT8_VNNI_OPS_PER_ITER = 12 * 64 * 2  # 12 vpdpbusd of 64 byte pairs


def _best_rate(fn, work, repeats=5):
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = max(best, work / (time.perf_counter() - t))
    return best


def fma_peak_gflops(isa="avx2"):
    """FP32 FMA peak of one core with ymm ("avx2") or zmm ("avx512") registers;
    None when the CPU lacks that ISA."""
    from . import cpu
    if not cpu.supports(isa):
        return None
    lib = load()
    iters = 20_000_000
    f = lib.fn(f"llb_probe_fma__{isa}")
    width = 2 if isa == "avx512" else 1
    return _best_rate(lambda: f(iters), iters * FMA_FLOP_PER_ITER * width) / 1e9


def int8_peak_gops(isa="avx2"):
    """Int8 multiply-add peak of one core: vpmaddubsw+vpmaddwd on ymm ("avx2") or
    vpdpbusd on zmm ("avx512", needs AVX512_VNNI); None when the CPU lacks it."""
    from . import cpu
    if isa == "avx512" and not (cpu.supports("avx512") and "avx512_vnni" in cpu.cpu_flags()):
        return None
    lib = load()
    iters = 20_000_000
    f = lib.fn(f"llb_probe_int8__{isa}")
    ops = INT8_OPS_PER_ITER if isa == "avx2" else INT8_VNNI_OPS_PER_ITER
    return _best_rate(lambda: f(iters), iters * ops) / 1e9


def stream_buffers(threads, nbytes):
    """One buffer of nbytes per thread, every page written: a page of fresh zeros that was
    never written is the kernel's one shared zero page, and reading it streams no memory
    at all (buffers.zeros maps such pages)."""
    return [buffers.full(nbytes // 4, 1.0) for _ in range(threads)]


def read_bandwidth_gbs(threads=1, nbytes=256 << 20, reps=3):
    """Aggregate read bandwidth of ``threads`` threads, each streaming its own buffer
    (far larger than the caches)."""
    lib = load()
    f = lib.fn("llb_probe_read__avx2")
    per = (nbytes // threads) & ~127
    bufs = stream_buffers(threads, per)

    def run():
        workers = [threading.Thread(target=f, args=(b.ctypes.data, per, reps)) for b in bufs]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    run()   # fault the pages in
    return _best_rate(run, per * threads * reps, repeats=3) / 1e9


def measure(max_threads=2):
    return dict(fma_gflops_per_core=fma_peak_gflops(), int8_gops_per_core=int8_peak_gops(),
                read_gbs={t: read_bandwidth_gbs(t) for t in range(1, max_threads + 1)})
