"""Vector math building blocks emitted inline by kernels (no kernels of its own).

``exp_ps`` is the classic Cephes-style single-precision exp: range-reduce by
ln 2 (split in two constants so the reduction is exact to float precision),
a degree-6 polynomial on [-ln2/2, ln2/2], then scale by 2^n through the
exponent bits. Max relative error ~2 ulp over the clamped range; inputs below
-87.3 give ~0 (exp of very negative scores in softmax), above 88.37 are clamped.
"""
from peachpy import Constant
from peachpy.x86_64 import (VMINPS, VMAXPS, VMULPS, VROUNDPS, VFNMADD231PS, VFMADD213PS,
                            VMOVAPS, VCVTPS2DQ, VPADDD, VPSLLD, VADDPS)

LOG2E = 1.44269504088896341
LN2_HI = 0.693359375
LN2_LO = -2.12194440e-4
POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
        1.6666665459e-1, 5.0000001201e-1)


def exp_ps(out, x, t1, t2):
    """out = exp(x) for 8 floats. ``t1``, ``t2`` are scratch ymm registers.

    ``x`` is not modified unless it is ``out``."""
    VMINPS(out, x, Constant.float32x8(88.3762626647949))
    VMAXPS(out, out, Constant.float32x8(-87.3365447504019))
    # n = round(x * log2(e)); r = x - n*ln2 (two steps, exact)
    VMULPS(t1, out, Constant.float32x8(LOG2E))
    VROUNDPS(t1, t1, 0)                     # 0: round to nearest even
    VFNMADD231PS(out, t1, Constant.float32x8(LN2_HI))
    VFNMADD231PS(out, t1, Constant.float32x8(LN2_LO))
    # p(r) = 1 + r + r^2 * (c5 + r*(c4 + ... ))  by Horner
    VMOVAPS(t2, Constant.float32x8(POLY[0]))
    for c in POLY[1:]:
        VFMADD213PS(t2, out, Constant.float32x8(c))     # t2 = t2*r + c
    VMULPS(t2, t2, out)                     # t2 = r * poly
    VMULPS(t2, t2, out)                     # t2 = r^2 * poly
    VADDPS(t2, t2, out)                     # + r
    VADDPS(t2, t2, Constant.float32x8(1.0))  # + 1
    # 2^n via the exponent field: (n + 127) << 23
    VCVTPS2DQ(t1, t1)
    VPADDD(t1, t1, Constant.uint32x8(127))
    VPSLLD(t1, t1, 23)
    VMULPS(out, t2, t1)
