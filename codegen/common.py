"""Shared vocabulary of the kernel generators.

A family module builds PeachPy ``Function`` objects and wraps each in a
``Kernel`` that carries what the runtime needs to know about it: its symbol,
family, ISA, tile and C signature. The build driver finalizes, encodes and
links them; the runtime reads the manifest it writes.
"""
from dataclasses import dataclass, field

from peachpy import Argument, ptr, const_float_, float_, size_t, int32_t, uint32_t, \
    int8_t, const_int8_t, uint8_t, const_uint8_t, uint16_t, const_uint16_t, const_int32_t
from peachpy import Constant
from peachpy.x86_64 import (Function, uarch, Loop, Block, YMMRegister, CMP, JB, JAE, JZ, ADD, SUB, TEST,
                            VMOVD, VPBROADCASTD, VPCMPGTD, VPERM2F128, VPERM2I128, VPERMILPS, VPSHUFD,
                            VMOVUPS, VMASKMOVPS)

from .contract import symbol  # noqa: F401  (re-exported: the generators name symbols with it)

# The ISAs we emit for. AVX2+FMA(+F16C) is the baseline every kernel has.
ISAS = {
    "avx2": dict(target=uarch.haswell, cpu_flags=("avx2", "fma", "f16c")),
    # Optional wider variants, used only when the CPU has them (runtime/cpu.py).
    "avx512": dict(target=uarch.cannonlake, cpu_flags=("avx2", "fma", "f16c", "avx512f", "avx512bw",
                                                       "avx512dq", "avx512vl")),
}

# C types a kernel argument may have, by the names used in the manifest.
C_TYPES = {
    "const float*": ptr(const_float_),
    "float*": ptr(float_),
    "const int8_t*": ptr(const_int8_t),
    "int8_t*": ptr(int8_t),
    "const uint8_t*": ptr(const_uint8_t),
    "uint8_t*": ptr(uint8_t),
    "const uint16_t*": ptr(const_uint16_t),
    "uint16_t*": ptr(uint16_t),
    "const int32_t*": ptr(const_int32_t),
    "int32_t*": ptr(int32_t),
    "size_t": size_t,
    "int32_t": int32_t,
    "uint32_t": uint32_t,
    "float": float_,
}


@dataclass
class Kernel:
    """One emitted function plus the metadata the runtime binds it by."""
    function: Function
    family: str
    isa: str
    tile: str = ""
    args: list = field(default_factory=list)   # [(name, c_type_name)]

    @property
    def symbol(self):
        return self.function.name


def function(name, signature, isa):
    """Open a PeachPy function with explicitly named arguments.

    ``signature`` is a list of ``(name, c_type_name)``. Every ``Argument`` gets
    an explicit ``name=``: PeachPy's name inference from the source line breaks
    silently when two arguments share a line. Returns ``(Function, arguments)``.
    """
    arguments = tuple(Argument(C_TYPES[ctype], name=argname) for argname, ctype in signature)
    return Function(name, arguments, target=ISAS[isa]["target"]), arguments


def tail_mask(mask, remaining):
    """Set ymm ``mask`` lanes 0..remaining-1 to all-ones (for VMASKMOVPS / VPMASKMOVD).

    ``remaining`` is a 64-bit GP register holding 1..8. Built from a compare
    against the lane index, so it needs no table and no RIP-relative indexing."""
    VMOVD(mask.as_xmm, remaining.as_dword)
    VPBROADCASTD(mask, mask.as_xmm)
    VPCMPGTD(mask, mask, Constant.uint32x8(0, 1, 2, 3, 4, 5, 6, 7))


def fold_lanes(op, acc, tmp=None, integer=False):
    """Combine the 8 lanes of ``acc`` with ``op`` (VADDPS, VMAXPS, VPADDD...) so every lane
    holds the result. The butterfly pairs lanes symmetrically, so all lanes end bitwise
    equal and no broadcast is needed afterwards. ``integer`` uses the integer-domain
    shuffles (VPERM2I128, VPSHUFD) to stay off the float bypass."""
    permute_halves, shuffle = (VPERM2I128, VPSHUFD) if integer else (VPERM2F128, VPERMILPS)
    tmp = tmp if tmp is not None else YMMRegister()
    permute_halves(tmp, acc, acc, 0x01)
    op(acc, acc, tmp)
    shuffle(tmp, acc, 0b01001110)
    op(acc, acc, tmp)
    shuffle(tmp, acc, 0b10110001)
    op(acc, acc, tmp)


# Streaming loops over f32 arrays (elementwise kernels, the executor's copy).
LANES = 8
VECTOR_BYTES = 32


class Vector:
    """One 8-lane vector of a stream: lanes ``index + 32*group`` bytes from any base pointer.

    ``mask`` is None for a whole vector, else the tail's lane mask: masked
    loads give 0 in the unused lanes and masked stores leave memory alone."""

    def __init__(self, index, group, mask=None):
        self.index, self.group, self.mask = index, group, mask

    def address(self, base):
        return [base + self.index * 1 + VECTOR_BYTES * self.group]

    def load(self, reg, base):
        if self.mask is None:
            VMOVUPS(reg, self.address(base))
        else:
            VMASKMOVPS(reg, self.mask, self.address(base))

    def store(self, base, reg):
        if self.mask is None:
            VMOVUPS(self.address(base), reg)
        else:
            VMASKMOVPS(self.address(base), self.mask, reg)


def stream(count, indices, step, unroll):
    """Emit a loop over ``count`` floats (a GP register; consumed).

    ``step(*vectors)`` emits the work of one vector, one ``Vector`` per byte
    index register in ``indices`` (they all advance together; the caller
    zeroes or sets them). The unrolled loop passes groups 0..unroll-1, so a
    step can keep one accumulator per group."""
    for width in sorted({unroll, 1}, reverse=True):
        loop = Loop()
        CMP(count, width * LANES)
        JB(loop.end)
        with loop:
            for group in range(width):
                step(*(Vector(index, group) for index in indices))
            for index in indices:
                ADD(index, width * VECTOR_BYTES)
            SUB(count, width * LANES)
            CMP(count, width * LANES)
            JAE(loop.begin)
    tail = Block()
    with tail:
        TEST(count, count)
        JZ(tail.end)
        mask = YMMRegister()
        tail_mask(mask, count)
        step(*(Vector(index, 0, mask) for index in indices))
