"""Elementwise and row-wise FP32 kernels: add, scale, SiLU*mul, RMSNorm, softmax, RoPE.

Every kernel handles any length: full 8-lane steps, then one masked step for
the tail (VMASKMOVPS), so nothing beyond ``n`` is read or written.
"""
from peachpy.x86_64 import (GeneralPurposeRegister64, YMMRegister, LOAD, Loop, Block, RETURN,
                            VADDPS, VMOVUPS, VMASKMOVPS, CMP, JB, JAE, JZ, ADD, SUB, TEST)

from .common import Kernel, function, symbol, tail_mask

LANES = 8


def emit_add(isa):
    """out[i] = a[i] + b[i] for i < n."""
    sig = [("a", "const float*"), ("b", "const float*"), ("out", "float*"), ("n", "size_t")]
    fn, args = function(symbol("add", "f32", "", isa), sig, isa)
    with fn:
        a, b, out, n = (GeneralPurposeRegister64() for _ in range(4))
        for reg, arg in zip((a, b, out, n), args):
            LOAD.ARGUMENT(reg, arg)
        x = YMMRegister()
        full = Loop()
        CMP(n, LANES)
        JB(full.end)
        with full:
            VMOVUPS(x, [a])
            VADDPS(x, x, [b])
            VMOVUPS([out], x)
            ADD(a, 32)
            ADD(b, 32)
            ADD(out, 32)
            SUB(n, LANES)
            CMP(n, LANES)
            JAE(full.begin)
        tail = Block()
        with tail:
            TEST(n, n)
            JZ(tail.end)
            mask, y = YMMRegister(), YMMRegister()
            tail_mask(mask, n)
            VMASKMOVPS(x, mask, [a])
            VMASKMOVPS(y, mask, [b])
            VADDPS(x, x, y)
            VMASKMOVPS([out], mask, x)
        RETURN()
    return Kernel(fn, "elementwise", isa, tile=f"{LANES}", args=sig)


def emit(isa):
    return [emit_add(isa)]
