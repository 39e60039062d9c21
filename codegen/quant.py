"""Activation quantization: f32 rows -> int8 blocks of 32 with a scale (GGUF Q8_0, plus Q8_1's sum).

    llb_quantize_q8_f32__avx2(x, qs, d, s, blocks)

For each block of 32 floats: ``d = amax / 127``, ``q = round(x * (1/d))``
clamped to [-127, 127], ``s = d * sum(q)``. The arithmetic is GGUF's
(``1/d`` then a multiply, both IEEE single), so q matches
``gguf.quants.quantize(.., Q8_0)`` except at exact .5 ties, which
``vcvtps2dq`` rounds to even where GGUF rounds away from zero.

``x``, ``qs``, ``d``, ``s`` are contiguous, so a [m, k] matrix with k a
multiple of 32 is simply ``m * k / 32`` consecutive blocks.

The blocks go GROUP at a time: each block's amax and sum of quants end in its own lane of
one vector (a transposing reduction), so the two divisions, the d and s stores and the
float conversion of the sums are done once for GROUP blocks; the blocks left over go one at a
time. Every lane gets the single-block code's IEEE operations on the same values (max and
integer sums are exact in any order), so the output is the same bits either way -- unless a
block holds a NaN, whose amax then depends on the order of the maxima (NaN activations are
the model's failure, caught at the logits).
"""
from peachpy import Constant
from peachpy.x86_64 import (GeneralPurposeRegister64, YMMRegister, LOAD, Loop, RETURN, LocalVariable,
                            ADD, SUB, CMP, TEST, LEA, JNZ, JZ, JB, JAE,
                            VMOVAPS, VMOVUPS, VANDPS, VMAXPS, VMINPS, VDIVPS, VMULPS, VBROADCASTSS,
                            VCVTPS2DQ, VCVTDQ2PS, VPADDD, VPACKSSDW, VPACKSSWB,
                            VPERMD, VMOVDQA, VMOVSS, VUNPCKLPS, VUNPCKHPS, VUNPCKLPD, VUNPCKHPD, VPERM2F128)

from .common import Kernel, fold_lanes, function, symbol

from .contract import BLOCK
LANES = 8
FLT_MAX = 3.4028234663852886e38


GROUP = 8                  # blocks whose amax and sum share one vector (one lane each): the lanes of a ymm
ABS_MASK = 0x7FFFFFFF


def quantize_one_block(values, amax, scale, inverse, tmp, order, x, qs, d, s):
    """The block at x: values (4 vectors) loaded, amax folded, then quantized and stored."""
    for i, v in enumerate(values):
        VMOVAPS(v, [x + 32 * i])
    VANDPS(amax, values[0], Constant.uint32x8(ABS_MASK))
    for v in values[1:]:
        VANDPS(tmp, v, Constant.uint32x8(ABS_MASK))
        VMAXPS(amax, amax, tmp)
    fold_lanes(VMAXPS, amax, tmp)
    scale_and_inverse(amax, scale, inverse)
    quantize_values(values, inverse)
    sum_quants(amax, tmp, values)
    fold_lanes(VPADDD, amax, tmp, integer=True)
    VCVTDQ2PS(amax, amax)
    VMULPS(amax, amax, scale)
    VMOVSS([d], scale.as_xmm)
    VMOVSS([s], amax.as_xmm)
    pack_and_store(values, order, [qs])


def scale_and_inverse(amax, scale, inverse):
    VDIVPS(scale, amax, Constant.float32x8(127.0))
    # 1/0 = inf for an all-zero block; capped, 0 * FLT_MAX still gives q = 0
    VMOVAPS(inverse, Constant.float32x8(1.0))
    VDIVPS(inverse, inverse, scale)
    VMINPS(inverse, inverse, Constant.float32x8(FLT_MAX))


def quantize_values(values, inverse):
    for v in values:
        VMULPS(v, v, inverse)
        # |x * (1/d)| can exceed 127 by an ulp; with a subnormal d, by far
        VMINPS(v, v, Constant.float32x8(127.0))
        VMAXPS(v, v, Constant.float32x8(-127.0))
        VCVTPS2DQ(v, v)


def sum_quants(out, spare, values):
    """out = the four vectors of quants added lane by lane (int32, exact in any order)."""
    VPADDD(spare, values[0], values[1])
    VPADDD(out, values[2], values[3])
    VPADDD(out, out, spare)


def pack_and_store(values, order, at):
    VPACKSSDW(values[0], values[0], values[1])
    VPACKSSDW(values[2], values[2], values[3])
    VPACKSSWB(values[0], values[0], values[2])
    VPERMD(values[0], order, values[0])
    VMOVDQA(at, values[0])


def transposed_reduce(op, per_block, tmp):
    """GROUP vectors (an iterator, consumed in order; each block's partial values) -> one
    vector whose lane j is block j's lanes combined with ``op``: pairs of blocks interleaved
    and combined, then pairs of pairs, then the two 128-bit halves (three levels: GROUP = 8).
    Keeps at most four partial vectors live, so the caller may compute each block's vector
    as it is asked for."""
    assert GROUP == 8
    def pair(a, b, unpack_low, unpack_high):
        unpack_high(tmp, a, b)
        unpack_low(a, a, b)
        op(a, a, tmp)
        return a
    quads = []
    for _ in range(2):
        halves = []
        for _ in range(2):
            a, b = next(per_block), next(per_block)
            halves.append(pair(a, b, VUNPCKLPS, VUNPCKHPS))
        quads.append(pair(halves[0], halves[1], VUNPCKLPD, VUNPCKHPD))
    low, high = quads
    VPERM2F128(tmp, low, high, 0x31)
    VPERM2F128(low, low, high, 0x20)
    op(low, low, tmp)
    return low


def emit_quantize_q8(isa):
    sig = [("x", "const float*"), ("qs", "int8_t*"), ("d", "float*"), ("s", "float*"), ("blocks", "size_t")]
    fn, args = function(symbol("quantize_q8", "f32", f"{BLOCK}", isa), sig, isa)
    with fn:
        x, qs, d, s, left = (GeneralPurposeRegister64() for _ in range(5))
        for reg, arg in zip((x, qs, d, s, left), args):
            LOAD.ARGUMENT(reg, arg)
        values = [YMMRegister() for _ in range(BLOCK // LANES)]
        amax, scale, inverse, tmp, order = (YMMRegister() for _ in range(5))
        inverses = LocalVariable(4 * GROUP)        # the group's 1/d, one broadcast per block
        # vpackssdw/vpacksswb interleave their sources per 128-bit lane; this puts the dwords back
        VMOVDQA(order, Constant.uint32x8(0, 4, 1, 5, 2, 6, 3, 7))
        abs_mask = YMMRegister()
        VMOVAPS(abs_mask, Constant.uint32x8(ABS_MASK))
        inverses_at = GeneralPurposeRegister64()
        LEA(inverses_at, inverses)

        groups = Loop()
        CMP(left, GROUP)
        JB(groups.end)
        with groups:
            def block_amax():
                for j in range(GROUP):
                    a = YMMRegister()
                    VANDPS(a, abs_mask, [x + BLOCK * 4 * j])
                    for i in range(1, BLOCK // LANES):
                        VANDPS(tmp, abs_mask, [x + BLOCK * 4 * j + 32 * i])
                        VMAXPS(a, a, tmp)
                    yield a
            amaxes = transposed_reduce(VMAXPS, block_amax(), tmp)
            scale_and_inverse(amaxes, scale, inverse)
            VMOVUPS([d], scale)
            VMOVUPS([inverses_at], inverse)

            def block_sums():
                for j in range(GROUP):
                    for i, v in enumerate(values):
                        VMOVAPS(v, [x + BLOCK * 4 * j + 32 * i])
                    VBROADCASTSS(inverse, [inverses_at + 4 * j])
                    quantize_values(values, inverse)
                    total = YMMRegister()
                    sum_quants(total, amax, values)
                    pack_and_store(values, order, [qs + BLOCK * j])
                    yield total
            sums = transposed_reduce(VPADDD, block_sums(), tmp)
            VCVTDQ2PS(sums, sums)
            VMULPS(sums, sums, scale)
            VMOVUPS([s], sums)
            ADD(x, GROUP * BLOCK * 4)
            ADD(qs, GROUP * BLOCK)
            ADD(d, GROUP * 4)
            ADD(s, GROUP * 4)
            SUB(left, GROUP)
            CMP(left, GROUP)
            JAE(groups.begin)

        singles = Loop()
        TEST(left, left)
        JZ(singles.end)
        with singles:
            quantize_one_block(values, amax, scale, inverse, tmp, order, x, qs, d, s)
            ADD(x, BLOCK * 4)
            ADD(qs, BLOCK)
            ADD(d, 4)
            ADD(s, 4)
            SUB(left, 1)
            JNZ(singles.begin)
        RETURN()
    return Kernel(fn, "quant", isa, tile=f"{BLOCK}", args=sig)


def emit(isa):
    return [emit_quantize_q8(isa)]
