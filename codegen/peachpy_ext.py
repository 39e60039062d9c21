"""Extensions to the 2021 PeachPy that the AVX-512 kernels need (no kernels here).

- ``VPDPBUSD``: the AVX512_VNNI int8 dot-product instruction, with its own EVEX encoding;
- ``LOCK_XADD`` / ``LOCK_CMPXCHG``: the atomic read-modify-writes of a qword in memory that
  the plan executor's work claiming needs (PeachPy emits no LOCK prefix);
- ``broadcast``: a {1to16} dword operand, guarding a PeachPy displacement misencoding;
- ``UpperZmmFunction`` / ``upper_zmm_function``: functions that may name zmm16-31,
  which PeachPy's register allocator never hands out.
"""
from collections import Counter

import peachpy
import peachpy.stream
from peachpy import Argument
from peachpy.x86_64 import Function, ZMMRegister, dword
from peachpy.x86_64.generic import CMPXCHG, XADD
from peachpy.x86_64 import isa as peachpy_isa
from peachpy.x86_64.encoding import evex, modrm_sib_disp
from peachpy.x86_64.instructions import Instruction
from peachpy.x86_64.operand import check_operand, is_m64, is_r64, is_zmm, is_m512_m32bcst
from peachpy.x86_64.registers import XMMRegister
import peachpy.x86_64.registers as peachpy_registers

from .common import C_TYPES, ISAS as ISA_TARGETS


def broadcast(address):
    """A dword memory operand broadcast to 16 lanes (``{1to16}``).

    PeachPy (2021) encodes an 8-bit displacement of a broadcast operand scaled by the vector
    size (64) where the CPU scales it by the element size (4): a displacement that is a
    nonzero multiple of 64 would silently address the wrong byte. Other displacements get a
    32-bit encoding, which is right."""
    operand = dword.to16[address[0] if isinstance(address, list) else address]
    displacement = getattr(operand.address, "displacement", 0)
    if displacement and displacement % 64 == 0:
        raise ValueError(f"broadcast operand {operand}: PeachPy misencodes this displacement")
    return operand


class VPDPBUSD(Instruction):
    """vpdpbusd zmm1, zmm2, zmm3/m512/m32bcst (AVX512_VNNI): each int32 lane of zmm1 += the
    four products of zmm2's unsigned bytes and zmm3's signed bytes (no saturation).

    The 2021 PeachPy predates VNNI. Encoding EVEX.512.66.0F38.W0 50 /r, the same as the EVEX
    vpmaddubsw (66.0F38 04) but for the opcode; a broadcast's 8-bit displacement is scaled
    by 4. PeachPy knows no VNNI extension: the target check sees AVX512BW, and the runtime
    checks the CPU's avx512_vnni flag before choosing these kernels."""

    def __init__(self, accumulator, unsigned, signed):
        super().__init__("VPDPBUSD")
        self.operands = tuple(map(check_operand, (accumulator, unsigned, signed)))
        acc, uns, sig = self.operands
        self.in_regs = (True, True, True)
        self.out_regs = (True, False, False)
        self.out_operands = (True, False, False)
        self.avx_mode = True
        self.isa_extensions = frozenset([peachpy_isa.avx512bw])
        if not (is_zmm(acc) and is_zmm(uns)):
            raise SyntaxError(f"VPDPBUSD: expected zmm, zmm, zmm/m512/m32bcst, got {self.operands}")
        if is_zmm(sig):
            self.encodings.append((0x00, lambda op: bytearray([
                0x62,
                ((op[0].hcode << 7) | (op[2].ehcode << 5) | (op[0].ecode << 4)) ^ 0xF2,
                0x7D ^ (op[1].hlcode << 3),
                (op[1].ecode << 3 ^ 0x8) | 0x40,
                0x50,
                0xC0 | op[0].lcode << 3 | op[2].lcode])))
        elif is_m512_m32bcst(sig):
            scale = 4 if sig.broadcast else 64
            self.encodings.append((0x10, lambda op, sib=False, min_disp=0: (
                evex(0b10, 0x05, 0b10, op[0].ehcode, op[2].address, op[1].code, b=op[2].bcode)
                + bytearray([0x50])
                + modrm_sib_disp(op[0].lcode, op[2].address, sib, min_disp, disp8xN=scale))))
        else:
            raise SyntaxError(f"VPDPBUSD: expected zmm, zmm, zmm/m512/m32bcst, got {self.operands}")
        if peachpy.stream.active_stream is not None:
            peachpy.stream.active_stream.add_instruction(self)


LOCK_PREFIX = 0xF0


def _with_lock_prefix(instruction, name):
    """Prefix every encoding of ``instruction`` (a memory-destination XADD/CMPXCHG) with LOCK.

    The instruction is already in the active stream (its constructor put it there);
    encodings are only called when the function is finalized, so swapping them here is
    in time. F0 goes before the REX prefix, as the manuals require."""
    destination, source = instruction.operands
    if not (is_m64(destination) and is_r64(source)):
        raise SyntaxError(f"{name}: expected m64, r64 (a qword in memory and a 64-bit register), "
                          f"got {instruction.operands}")

    def prefixed(encode):
        return lambda op, **options: bytearray([LOCK_PREFIX]) + encode(op, **options)

    instruction.encodings = [(flags, prefixed(encode)) for flags, encode in instruction.encodings]
    instruction.name = name
    instruction._gas_name = name.lower().replace("_", " ") + "q"


class LOCK_XADD(XADD):
    """lock xadd m64, r64: atomically ``tmp = [m]; [m] += r; r = tmp`` (F0 REX.W 0F C1 /r)."""

    def __init__(self, destination, source):
        super().__init__(destination, source)
        _with_lock_prefix(self, "LOCK_XADD")


class LOCK_CMPXCHG(CMPXCHG):
    """lock cmpxchg m64, r64: atomically ``if [m] == rax: [m] = r (ZF=1) else: rax = [m] (ZF=0)``
    (F0 REX.W 0F B1 /r). rax is an implicit operand that PeachPy's CMPXCHG does not declare:
    use it only with physical registers, as the executor does."""

    def __init__(self, destination, source):
        super().__init__(destination, source)
        _with_lock_prefix(self, "LOCK_CMPXCHG")


class UpperZmmFunction(Function):
    """A PeachPy function that also names zmm16-31 directly.

    The 2021 PeachPy allocates virtual vector registers only to xmm/ymm/zmm0-15 (its SysV
    table predates AVX-512), and its check that live registers fit counts physical ones
    against that limit of 16. zmm16-31 are caller-saved and the allocator never hands them
    out, so naming them leaves the virtual registers their 16; this check leaves them out.
    Only EVEX instructions can name them, and PeachPy picks an EVEX form (or refuses) for
    a physical register >= 16."""

    LIMITS = {peachpy_registers.GeneralPurposeRegister._kind: 15, peachpy_registers.MMXRegister._kind: 8,
              XMMRegister._kind: 16, peachpy_registers.KRegister._kind: 8}

    def _check_live_registers(self):
        for instruction in self._instructions:
            live = Counter(reg.kind for reg in instruction.live_registers if not _is_upper_vector(reg))
            if any(count > self.LIMITS.get(kind, count) for kind, count in live.items()):
                raise peachpy.RegisterAllocationError(
                    f"more live virtual registers than physical ones at {instruction}")


# zmm16-31 by name, for an UpperZmmFunction's accumulators beyond the 16 PeachPy allocates.
UPPER_ZMM = tuple(ZMMRegister(physical_id=i) for i in range(16, 32))


def _is_upper_vector(reg):
    return reg.kind == XMMRegister._kind and not reg.is_virtual and reg.physical_id >= 16


def upper_zmm_function(name, signature, isa):
    """``common.function`` for an UpperZmmFunction."""
    arguments = tuple(Argument(C_TYPES[ctype], name=argname) for argname, ctype in signature)
    return UpperZmmFunction(name, arguments, target=ISA_TARGETS[isa]["target"]), arguments


class VDPBF16PS(Instruction):
    """vdpbf16ps zmm1, zmm2, zmm3 (AVX512_BF16): each f32 lane of zmm1 += the two products of
    the bf16 pairs in the same dword of zmm2 and zmm3 (the odd element's product first).

    The 2021 PeachPy predates AVX512_BF16. Encoding EVEX.512.F3.0F38.W0 52 /r: the register
    form of VPDPBUSD above but for the prefix (F3: pp = 10) and the opcode. Register operands
    only (broadcast the activation pair with VPBROADCASTD). The runtime checks the CPU's
    avx512_bf16 flag before choosing a kernel that uses it."""

    def __init__(self, accumulator, first, second):
        super().__init__("VDPBF16PS")
        self.operands = tuple(map(check_operand, (accumulator, first, second)))
        acc, src1, src2 = self.operands
        self.in_regs = (True, True, True)
        self.out_regs = (True, False, False)
        self.out_operands = (True, False, False)
        self.avx_mode = True
        self.isa_extensions = frozenset([peachpy_isa.avx512bw])
        if not (is_zmm(acc) and is_zmm(src1) and is_zmm(src2)):
            raise SyntaxError(f"VDPBF16PS: expected zmm, zmm, zmm, got {self.operands}")
        self.encodings.append((0x00, lambda op: bytearray([
            0x62,
            ((op[0].hcode << 7) | (op[2].ehcode << 5) | (op[0].ecode << 4)) ^ 0xF2,
            0x7E ^ (op[1].hlcode << 3),
            (op[1].ecode << 3 ^ 0x8) | 0x40,
            0x52,
            0xC0 | op[0].lcode << 3 | op[2].lcode])))
        if peachpy.stream.active_stream is not None:
            peachpy.stream.active_stream.add_instruction(self)
