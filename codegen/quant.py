"""Activation quantization: f32 rows -> int8 blocks of 32 with a scale (GGUF Q8_0, plus Q8_1's sum).

    llb_quantize_q8_f32__avx2(x, qs, d, s, blocks)

For each block of 32 floats: ``d = amax / 127``, ``q = round(x * (1/d))``
clamped to [-127, 127], ``s = d * sum(q)``. The arithmetic is GGUF's
(``1/d`` then a multiply, both IEEE single), so q matches
``gguf.quants.quantize(.., Q8_0)`` except at exact .5 ties, which
``vcvtps2dq`` rounds to even where GGUF rounds away from zero.

``x``, ``qs``, ``d``, ``s`` are contiguous, so a [m, k] matrix with k a
multiple of 32 is simply ``m * k / 32`` consecutive blocks.
"""
from peachpy import Constant
from peachpy.x86_64 import (GeneralPurposeRegister64, YMMRegister, LOAD, Loop, RETURN, ADD, SUB, JNZ,
                            VMOVAPS, VANDPS, VMAXPS, VMINPS, VDIVPS, VMULPS,
                            VCVTPS2DQ, VCVTDQ2PS, VPADDD, VPACKSSDW, VPACKSSWB,
                            VPERMD, VMOVDQA, VMOVSS)

from .common import Kernel, fold_lanes, function, symbol

from .contract import BLOCK
LANES = 8
FLT_MAX = 3.4028234663852886e38


def emit_quantize_q8(isa):
    sig = [("x", "const float*"), ("qs", "int8_t*"), ("d", "float*"), ("s", "float*"), ("blocks", "size_t")]
    fn, args = function(symbol("quantize_q8", "f32", f"{BLOCK}", isa), sig, isa)
    with fn:
        x, qs, d, s, left = (GeneralPurposeRegister64() for _ in range(5))
        for reg, arg in zip((x, qs, d, s, left), args):
            LOAD.ARGUMENT(reg, arg)
        values = [YMMRegister() for _ in range(BLOCK // LANES)]
        amax, scale, inverse, tmp, order = (YMMRegister() for _ in range(5))
        # vpackssdw/vpacksswb interleave their sources per 128-bit lane; this puts the dwords back
        VMOVDQA(order, Constant.uint32x8(0, 4, 1, 5, 2, 6, 3, 7))
        with Loop() as loop:
            for i, v in enumerate(values):
                VMOVAPS(v, [x + 32 * i])
            VANDPS(amax, values[0], Constant.uint32x8(0x7FFFFFFF))
            for v in values[1:]:
                VANDPS(tmp, v, Constant.uint32x8(0x7FFFFFFF))
                VMAXPS(amax, amax, tmp)
            fold_lanes(VMAXPS, amax, tmp)
            VDIVPS(scale, amax, Constant.float32x8(127.0))
            # 1/0 = inf for an all-zero block; capped, 0 * FLT_MAX still gives q = 0
            VMOVAPS(inverse, Constant.float32x8(1.0))
            VDIVPS(inverse, inverse, scale)
            VMINPS(inverse, inverse, Constant.float32x8(FLT_MAX))
            for v in values:
                VMULPS(v, v, inverse)
                # |x * (1/d)| can exceed 127 by an ulp; with a subnormal d, by far
                VMINPS(v, v, Constant.float32x8(127.0))
                VMAXPS(v, v, Constant.float32x8(-127.0))
                VCVTPS2DQ(v, v)
            VPADDD(tmp, values[0], values[1])
            VPADDD(amax, values[2], values[3])
            VPADDD(amax, amax, tmp)
            fold_lanes(VPADDD, amax, tmp, integer=True)
            VCVTDQ2PS(amax, amax)
            VMULPS(amax, amax, scale)
            VMOVSS([d], scale.as_xmm)
            VMOVSS([s], amax.as_xmm)
            VPACKSSDW(values[0], values[0], values[1])
            VPACKSSDW(values[2], values[2], values[3])
            VPACKSSWB(values[0], values[0], values[2])
            VPERMD(values[0], order, values[0])
            VMOVDQA([qs], values[0])
            ADD(x, BLOCK * 4)
            ADD(qs, BLOCK)
            ADD(d, 4)
            ADD(s, 4)
            SUB(left, 1)
            JNZ(loop.begin)
        RETURN()
    return Kernel(fn, "quant", isa, tile=f"{BLOCK}", args=sig)


def emit(isa):
    return [emit_quantize_q8(isa)]
