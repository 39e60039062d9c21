"""Vector math building blocks emitted inline by kernels (no kernels of its own;
the elementwise family's ``exp`` kernel wraps ``exp_ps`` so it can be tested).

``exp_ps`` is a Cephes-style single-precision exp: range-reduce by ln 2 (split
in two constants so the reduction is exact to float precision), a degree-7
polynomial on [-ln2/2, ln2/2], then scale by a power of two built in the
exponent bits. Error < 1 ulp over [-86.9, 88.72] (measured on a dense
sweep in tests/test_vmath.py).

Edges, chosen for softmax and SiLU rather than for IEEE purity:
- results below 2^-125 (x < ~-87) are +0, never subnormal: -inf gives 0, and
  no subnormal ever slows down the caller;
- results above FLT_MAX (x > ~88.72) are +inf, so 1 / (1 + exp(-x)) goes to 0;
- NaN gives NaN.
"""
from peachpy import Constant
from peachpy.x86_64 import (ZMMRegister, VMINPS, VMAXPS, VMULPS, VROUNDPS, VRNDSCALEPS, VFNMADD231PS,
                            VFMADD213PS, VFMADD231PS, VMOVAPS, VBROADCASTSS, VCVTPS2DQ, VPADDD, VPSLLD,
                            VADDPS)
from peachpy.x86_64.operand import MemoryOperand

LOG2E = 1.44269504088896341
LN2_HI = 0.693359375            # 9 significant bits: n * LN2_HI is exact for |n| <= 128
LN2_LO = -2.12194440e-4         # ln 2 - LN2_HI
POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
        1.6666665459e-1, 5.0000001201e-1)

# The clamp keeps n = round(x * log2 e) within [-126, 128], where 2^(n-1) is
# either a normal float or, for n = -126, exactly +0 (exponent field 0).
# Scaling 2*p(r) by 2^(n-1) instead of p(r) by 2^n lets n = 128 reach the top
# of the float range and overflow to inf by an ordinary multiply.
EXP_HI = 89.0       # n = 128: overflows to inf (ln FLT_MAX = 88.72)
EXP_LO = -87.5      # n = -126: exactly 0


class _Ymm:
    """exp_ps's constants and rounding on ymm: 32-byte constants as memory operands."""
    @staticmethod
    def const(value):
        return Constant.float32x8(value)

    @staticmethod
    def int_const(value):
        return Constant.uint32x8(value)

    @staticmethod
    def load(out, value):
        VMOVAPS(out, Constant.float32x8(value))

    @staticmethod
    def round_nearest(out, x):
        VROUNDPS(out, x, 0)                 # 0: round to nearest even


class _Zmm:
    """The same on zmm. PeachPy has no 64-byte constants and lays out one constant size per
    function, so each constant stays a 32-byte one (as the ymm code beside it uses) read as
    its first float: broadcast {1to16} as an operand, or VBROADCASTSS. VRNDSCALEPS with
    scale 2^0 and imm 0 rounds as VROUNDPS 0 does: every lane computes the ymm code's bits."""
    @staticmethod
    def const(value):
        return first_dword(Constant.float32x8(value), broadcast=16)

    @staticmethod
    def int_const(value):
        return first_dword(Constant.uint32x8(value), broadcast=16)

    @staticmethod
    def load(out, value):
        VBROADCASTSS(out, first_dword(Constant.float32x8(value)))

    @staticmethod
    def round_nearest(out, x):
        VRNDSCALEPS(out, x, 0)


def first_dword(constant, broadcast=None):
    """A dword operand at a constant's first element (PeachPy sizes a constant's operand as
    the whole constant, and has no {1toN} form for one)."""
    operand = MemoryOperand(constant, broadcast=broadcast)
    operand.size = 4
    return operand


def exp_ps(out, x, t1, t2):
    """out = exp(x) for 8 floats (ymm registers) or 16 (zmm). ``t1``, ``t2`` are scratch
    registers of the same width.

    ``x`` is not modified unless it is ``out``."""
    v = _Zmm if isinstance(out, ZMMRegister) else _Ymm
    # Clamp with the constant as first operand: MINPS/MAXPS return the second
    # operand when either is NaN, so a NaN in x survives the clamp.
    v.load(t1, EXP_HI)
    VMINPS(out, t1, x)
    v.load(t1, EXP_LO)
    VMAXPS(out, t1, out)
    # n = round(x * log2(e)); r = x - n*ln2 (two steps, exact)
    VMULPS(t1, out, v.const(LOG2E))
    v.round_nearest(t1, t1)
    VFNMADD231PS(out, t1, v.const(LN2_HI))
    VFNMADD231PS(out, t1, v.const(LN2_LO))
    # 2*p(r) = 2 + 2r + r^2 * 2c(r), c by Horner. The factor 2 is folded into
    # the constants (exact: powers of two), so this costs nothing extra.
    v.load(t2, 2 * POLY[0])
    for c in POLY[1:]:
        VFMADD213PS(t2, out, v.const(2 * c))                # t2 = t2*r + 2c
    VMULPS(t2, t2, out)
    VMULPS(t2, t2, out)                                     # r^2 * 2c(r)
    VFMADD231PS(t2, out, v.const(2.0))                      # + 2r
    VADDPS(t2, t2, v.const(2.0))                            # + 2
    # 2^(n-1) via the exponent field: (n - 1 + 127) << 23
    VCVTPS2DQ(t1, t1)
    VPADDD(t1, t1, v.int_const(126))
    VPSLLD(t1, t1, 23)
    VMULPS(out, t2, t1)
