"""Machine-ceiling probes: the benchmarks measure peaks with our own instructions.

    llb_probe_fma__avx2(iters)        12 independent vfmadd231ps ymm chains: 16 FLOP each
    llb_probe_fma__avx512(iters)      the same with zmm registers: 32 FLOP each (some CPUs run
                                      512-bit FMAs at full rate; called only when the CPU has AVX-512)
    llb_probe_int8__avx2(iters)       6 chains of vpmaddubsw+vpmaddwd+vpaddd: 64 int ops a chain
    llb_probe_int8__avx512(iters)     12 vpdpbusd zmm chains (AVX512_VNNI): 128 int ops each
    llb_probe_read__avx2(buf, bytes, reps)   streams buf with aligned ymm loads (read bandwidth)

Twelve chains hide the 4-cycle latency on two FMA ports. Nothing is stored,
so the result registers are discarded; the loops are what is timed.
"""
from peachpy.x86_64 import (GeneralPurposeRegister64, YMMRegister, LOAD, Loop, RETURN, SUB, JNZ, ADD, MOV,
                            VXORPS, VFMADD231PS, VPMADDUBSW, VPMADDWD, VPADDD, VPXOR, VPXORD,
                            ZMMRegister)

from .common import Kernel, function, symbol
from .peachpy_ext import VPDPBUSD

CHAINS = 12
ISAS = ("avx2", "avx512")


def emit_chains(isa, op, instruction):
    """``CHAINS`` independent accumulators, each updated by ``instruction(acc, a, b)`` per
    iteration: ymm registers for avx2, zmm for avx512 (zeroed with the EVEX vpxord)."""
    register, zero = (YMMRegister, VXORPS) if isa == "avx2" else (ZMMRegister, VPXORD)
    sig = [("iters", "size_t")]
    fn, (iters,) = function(symbol("probe", op, "", isa), sig, isa)
    with fn:
        n = GeneralPurposeRegister64()
        LOAD.ARGUMENT(n, iters)
        acc = [register() for _ in range(CHAINS)]
        a, b = register(), register()
        for r in acc + [a, b]:
            zero(r, r, r)
        with Loop() as loop:
            for r in acc:
                instruction(r, a, b)
            SUB(n, 1)
            JNZ(loop.begin)
        RETURN()
    return Kernel(fn, "probe", isa, tile=str(CHAINS), args=sig)


def emit_int8(isa):
    sig = [("iters", "size_t")]
    fn, (iters,) = function(symbol("probe", "int8", "", isa), sig, isa)
    with fn:
        n = GeneralPurposeRegister64()
        LOAD.ARGUMENT(n, iters)
        # 6 chains of (maddubs -> maddwd -> add) keep both multiply ports busy
        prod = [YMMRegister() for _ in range(6)]
        acc = [YMMRegister() for _ in range(6)]
        a, b, ones = YMMRegister(), YMMRegister(), YMMRegister()
        for r in prod + acc + [a, b, ones]:
            VPXOR(r, r, r)
        with Loop() as loop:
            for p, s in zip(prod, acc):
                VPMADDUBSW(p, a, b)
                VPMADDWD(p, p, ones)
                VPADDD(s, s, p)
            SUB(n, 1)
            JNZ(loop.begin)
        RETURN()
    return Kernel(fn, "probe", isa, tile="6", args=sig)


def emit_read(isa):
    sig = [("buf", "const float*"), ("nbytes", "size_t"), ("reps", "size_t")]
    fn, (buf, nbytes, reps) = function(symbol("probe", "read", "", isa), sig, isa)
    with fn:
        base, size, r, p, left = (GeneralPurposeRegister64() for _ in range(5))
        LOAD.ARGUMENT(base, buf)
        LOAD.ARGUMENT(size, nbytes)
        LOAD.ARGUMENT(r, reps)
        acc = [YMMRegister() for _ in range(4)]
        for x in acc:
            VXORPS(x, x, x)
        with Loop() as outer:
            MOV(p, base)
            MOV(left, size)
            with Loop() as inner:
                for i, x in enumerate(acc):      # 128 bytes a step; nbytes % 128 == 0
                    VPADDD(x, x, [p + 32 * i])
                ADD(p, 128)
                SUB(left, 128)
                JNZ(inner.begin)
            SUB(r, 1)
            JNZ(outer.begin)
        RETURN()
    return Kernel(fn, "probe", isa, tile="128B", args=sig)


def emit(isa):
    if isa == "avx512":
        return [emit_chains(isa, "fma", VFMADD231PS), emit_chains(isa, "int8", VPDPBUSD)]
    return [emit_chains(isa, "fma", VFMADD231PS), emit_int8(isa), emit_read(isa)]
