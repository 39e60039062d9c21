"""Embedding lookup: out[i] = row ids[i] of a quantized weight, dequantized to f32.

The token embedding of a GGUF model is a q8_0 or q4_1 PackedWeight
(runtime/layout_quant.py): rows come in groups of 8, each 32-weight block
interleaved 4 bytes of a row at a time. One row of one block is therefore 8
(q8_0) or 4 (q4_1) dwords 32 bytes apart, plus f16 scales 16 bytes apart.
The kernel gathers those dwords into an xmm register with VPINSRD, widens the
bytes to int32 lanes, converts and scales.

The arithmetic is exactly runtime.layouts.rows' numpy: int8 -> f32 and
f16 -> f32 are exact, then one rounded multiply (q8_0: q * d), or a rounded
multiply and a rounded add (q4_1: d * q + m -- not an FMA, which would round
once and differ in the last bit).

The ids are read from memory on every call, so a recorded plan stays valid as
the model writes new token ids into the same buffer. They are trusted to be
in [0, n): the binding checks them.
"""
from peachpy import Constant
from peachpy.x86_64 import (GeneralPurposeRegister64, XMMRegister, YMMRegister, LOAD, Loop, RETURN,
                            ADD, SUB, MOV, IMUL, SHR, SHL, AND, LEA, JNZ, word, VMOVD, VPINSRD,
                            VPMOVSXBD, VPMOVZXBD, VPSHUFD, VPAND, VPSRLW, VPBROADCASTW, VCVTPH2PS,
                            VCVTDQ2PS, VMULPS, VADDPS, VMOVUPS)

from .common import Kernel, function, symbol

FAMILY = "embed"
from .contract import GROUP
CHUNK_STRIDE = 32        # bytes from one 4-byte chunk of a row to its next
SCALE_STRIDE = 2 * GROUP  # bytes from one f16 scale row of a block to the next field
VECTOR_BYTES = 32

# per kind: quant C type, chunks per block (dwords of one row), f16 fields per row and block
KINDS = {
    "q8_0": dict(quant_type="const int8_t*", chunks=8, fields=1),
    "q4_1": dict(quant_type="const uint8_t*", chunks=4, fields=2),
}


def signature(kind):
    return [("qs", KINDS[kind]["quant_type"]), ("scales", "const uint16_t*"), ("ids", "const int32_t*"),
            ("out", "float*"), ("m", "size_t"), ("blocks", "size_t")]


def gather_chunks(dest, qs_row, first):
    """dest.xmm = the row's 4-byte chunks first..first+3 of the current block (16 bytes)."""
    VMOVD(dest, [qs_row + CHUNK_STRIDE * first])
    for lane in range(1, 4):
        VPINSRD(dest, dest, [qs_row + CHUNK_STRIDE * (first + lane)], lane)


def widen_bytes(extend, low, high, packed):
    """low, high = the 8 low / 8 high bytes of xmm ``packed`` as int32 lanes (``extend``: sign or zero)."""
    extend(low, packed)
    VPSHUFD(high.as_xmm, packed, 0b1110)
    extend(high, high.as_xmm)


def broadcast_f16(dest, address):
    VPBROADCASTW(dest.as_xmm, word[address])
    VCVTPH2PS(dest, dest.as_xmm)


def store_scaled(out_row, offset, lanes, d, m=None):
    """out[offset:] = float(lanes) * d (+ m), 8 floats."""
    VCVTDQ2PS(lanes, lanes)
    VMULPS(lanes, lanes, d)
    if m is not None:
        VADDPS(lanes, lanes, m)
    VMOVUPS([out_row + offset], lanes)


def q8_0_block(qs_row, scale_row, out_row):
    """32 weights: chunks c hold weights 4c..4c+3, signed, times d."""
    d = YMMRegister()
    broadcast_f16(d, scale_row)
    for half in range(2):
        packed = XMMRegister()
        gather_chunks(packed, qs_row, 4 * half)
        low, high = YMMRegister(), YMMRegister()
        widen_bytes(VPMOVSXBD, low, high, packed)
        store_scaled(out_row, 64 * half, low, d)
        store_scaled(out_row, 64 * half + VECTOR_BYTES, high, d)


def q4_1_block(qs_row, scale_row, out_row):
    """32 weights: GGUF byte j (chunk j/4) holds weight j in its low nibble, j + 16 in its high one."""
    d, m = YMMRegister(), YMMRegister()
    broadcast_f16(d, scale_row)
    broadcast_f16(m, scale_row + SCALE_STRIDE)
    packed, nibbles = XMMRegister(), XMMRegister()
    gather_chunks(packed, qs_row, 0)
    for half in range(2):
        if half == 0:
            VPAND(nibbles, packed, Constant.uint32x4(0x0F0F0F0F))
        else:
            VPSRLW(nibbles, packed, 4)
            VPAND(nibbles, nibbles, Constant.uint32x4(0x0F0F0F0F))
        low, high = YMMRegister(), YMMRegister()
        widen_bytes(VPMOVZXBD, low, high, nibbles)
        store_scaled(out_row, 64 * half, low, d, m)
        store_scaled(out_row, 64 * half + VECTOR_BYTES, high, d, m)


def times_power_of_two(dest, value, factor):
    """dest = value * factor by a shift. (PeachPy encodes IMUL r, r, 128 with a sign-extended
    8-bit immediate: -128.)"""
    assert factor & (factor - 1) == 0
    MOV(dest, value)
    SHL(dest, factor.bit_length() - 1)


BLOCK_EMITTERS = {"q8_0": q8_0_block, "q4_1": q4_1_block}


def emit_embed(isa, kind):
    """out[i, :] = W[ids[i], :] for i < m; W has ``blocks`` 32-weight blocks per row."""
    chunks, fields = KINDS[kind]["chunks"], KINDS[kind]["fields"]
    quant_block_bytes = chunks * CHUNK_STRIDE          # one block of a whole group
    scale_block_bytes = fields * SCALE_STRIDE
    sig = signature(kind)
    fn, args = function(symbol("embed", kind, "", isa), sig, isa)
    with fn:
        regs = []
        for arg in args:
            reg = GeneralPurposeRegister64()
            LOAD.ARGUMENT(reg, arg)
            regs.append(reg)
        qs, scales, ids, out, m, blocks = regs
        quant_group_bytes, scale_group_bytes = GeneralPurposeRegister64(), GeneralPurposeRegister64()
        times_power_of_two(quant_group_bytes, blocks, quant_block_bytes)
        times_power_of_two(scale_group_bytes, blocks, scale_block_bytes)

        with Loop() as row_loop:
            row_id, group = GeneralPurposeRegister64(), GeneralPurposeRegister64()
            MOV(row_id.as_dword, [ids])                     # zero-extends: ids are >= 0
            MOV(group, row_id)
            SHR(group, 3)
            AND(row_id, GROUP - 1)                          # the row within its group
            qs_row, scale_row = GeneralPurposeRegister64(), GeneralPurposeRegister64()
            MOV(qs_row, group)
            IMUL(qs_row, quant_group_bytes)
            ADD(qs_row, qs)
            LEA(qs_row, [qs_row + row_id * 4])
            IMUL(group, scale_group_bytes)
            ADD(group, scales)
            LEA(scale_row, [group + row_id * 2])
            blocks_left = GeneralPurposeRegister64()
            MOV(blocks_left, blocks)
            with Loop() as block_loop:
                BLOCK_EMITTERS[kind](qs_row, scale_row, out)
                ADD(qs_row, quant_block_bytes)
                ADD(scale_row, scale_block_bytes)
                ADD(out, 4 * 32)
                SUB(blocks_left, 1)
                JNZ(block_loop.begin)
            ADD(ids, 4)
            SUB(m, 1)
            JNZ(row_loop.begin)
        RETURN()
    return Kernel(fn, FAMILY, isa, tile="", args=sig)


def emit(isa):
    return [emit_embed(isa, kind) for kind in KINDS]
