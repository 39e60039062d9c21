"""The passes of grouped-query causal attention that codegen/paged.py's kernel shares.

For query row i (at position p) and query head h, over the keys the row sees:

    s_j      = scale * q[i, h] . k[kv(h), j]
    p        = softmax(s)                           (max-subtracted)
    out[i,h] = sum_j p_j v[kv(h), j]                kv(h) = h // group

Query heads that share a KV head are processed together, up to MAX_HEADS at a
time: each K and V row is then read once per query and KV head instead of once
per query head, and at long contexts decode is bound by reading the cache.

Three streaming passes per (query, heads sharing a KV head, key segment: codegen/paged.py):

 1. scores: dot products vectorised over head_dim with a tile of heads x keys
    accumulating in registers (independent FMA chains hide the FMA latency),
    each accumulator reduced to a score with VHADDPS (``score_dots``,
    ``reduce_to_scores``, ``reduce_to_scalar``: one fixed order of additions);
 2. exp(s - max) in place on the score rows and their sum (codegen/paged.py's
    ``emit_exp_row``: a segment is not normalised, the combine divides);
 3. out = P V in key blocks of KEY_BLOCK keys (codegen/paged.py).

head_dim that is not a multiple of 8 ends in one masked chunk (VMASKMOVPS), so
nothing past a row is read. This module emits no kernel of its own (no ``emit``).
"""
from peachpy import Constant
from peachpy.x86_64 import (GeneralPurposeRegister64, YMMRegister, Loop, Block,
                            MOV, LEA, ADD, TEST, DEC, JZ, JNZ,
                            VMOVUPS, VMASKMOVPS, VXORPS,
                            VFMADD231PS, VADDPS, VHADDPS,
                            VPERM2F128, VBLENDPS, VEXTRACTF128)

from .common import tail_mask


LANES = 8
FLOAT = 4
CHUNK = LANES * FLOAT          # bytes of one ymm chunk of a row

MAX_HEADS = 3                  # query heads sharing a KV head done together
# Register tiles (16 ymm, PeachPy does not spill):
#   scores:  heads x keys accumulators + one q chunk per head
#   P V:     heads x head_dim-chunk accumulators + one broadcast p per head
SCORE_KEYS = {1: 8, 2: 4, 3: 4}       # 1x8+1, 2x4+2, 3x4+3 ymm
PV_CHUNKS = {1: 8, 2: 4, 3: 4}        # 1x8+1, 2x4+2, 3x4+3 ymm
KEY_BLOCK = 64                 # keys per P V block: 16 KB of V at head_dim 64, L1-resident

NEG_INF = Constant.uint32x8(0xFF800000)

def gp():
    return GeneralPurposeRegister64()


def ymms(n):
    return [YMMRegister() for _ in range(n)]


def zeroed(heads, n):
    """A tile of accumulators [head][n], each set to 0."""
    accs = [ymms(n) for _ in range(heads)]
    for a in sum(accs, []):
        VXORPS(a, a, a)
    return accs


def row(base, stride, r, disp=0):
    """Address of row ``r`` (0..2) of a block of rows ``stride`` bytes apart."""
    if r == 0:
        return [base + disp]
    return [base + stride * r + disp]


# ---------------------------------------------------------------- horizontal reductions

def reduce_to_scores(accs):
    """Reduce 4 or 8 accumulators to one register of 4 (xmm) or 8 (ymm) lane sums, in order."""
    for a, b in zip(accs[0::2], accs[1::2]):
        VHADDPS(a, a, b)
    pairs = accs[0::2]
    for a, b in zip(pairs[0::2], pairs[1::2]):
        VHADDPS(a, a, b)
    quads = pairs[0::2]
    # each quad now holds [lane sums over lanes 0-3 | over lanes 4-7] of 4 accumulators
    if len(quads) == 1:
        high = YMMRegister()
        VEXTRACTF128(high.as_xmm, quads[0], 1)
        VADDPS(quads[0].as_xmm, quads[0].as_xmm, high.as_xmm)
        return quads[0].as_xmm
    lo, hi = quads
    crossed = YMMRegister()
    VPERM2F128(crossed, lo, hi, 0x21)       # [lo.high | hi.low]
    VBLENDPS(lo, lo, hi, 0xF0)              # [lo.low  | hi.high]
    VADDPS(lo, lo, crossed)
    return lo


def reduce_to_scalar(acc):
    """Lane 0 = the sum of ``acc``'s lanes, added in the same order as ``reduce_to_scores``:
    a key's score is then bit-identical whichever tile computed it, so splitting
    heads between threads does not change any result."""
    VHADDPS(acc, acc, acc)
    VHADDPS(acc, acc, acc)
    high = YMMRegister()
    VEXTRACTF128(high.as_xmm, acc, 1)
    VADDPS(acc.as_xmm, acc.as_xmm, high.as_xmm)
    return acc.as_xmm


# ---------------------------------------------------------------- pass 1: scores

def score_dots(heads, keys, frame, q_heads, k_rows):
    """Accumulators [head][key] of q_head . k_row over the whole head_dim (not reduced).

    ``k_rows`` points at the first of ``keys`` consecutive cache rows."""
    hd4 = gp()
    MOV(hd4, frame.hd4)
    if keys > 3:
        hd12 = gp()
        LEA(hd12, [hd4 + hd4 * 2])

    def key_addr(base_lo, base_hi, key, disp=0):
        base = base_lo if key < 4 else base_hi
        index = key % 4
        if index == 0:
            return [base + disp]
        if index == 3:
            return [base + hd12 * 1 + disp]
        return [base + hd4 * index + disp]

    accs = zeroed(heads, keys)
    qd, kd = gp(), gp()
    MOV(qd, q_heads)
    MOV(kd, k_rows)
    kd4 = None
    if keys > 4:
        kd4 = gp()
        LEA(kd4, [kd + hd4 * 4])
    chunks = gp()
    MOV(chunks, frame.full_chunks)
    full = Loop()
    TEST(chunks, chunks)
    JZ(full.end)
    with full:
        q = ymms(heads)
        for h in range(heads):
            VMOVUPS(q[h], row(qd, hd4, h))
        for c in range(keys):
            for h in range(heads):
                VFMADD231PS(accs[h][c], q[h], key_addr(kd, kd4, c))
        ADD(qd, CHUNK)
        ADD(kd, CHUNK)
        if kd4 is not None:
            ADD(kd4, CHUNK)
        DEC(chunks)
        JNZ(full.begin)
    tail = Block()
    with tail:
        MOV(chunks, frame.tail)
        TEST(chunks, chunks)
        JZ(tail.end)
        mask = YMMRegister()
        tail_mask(mask, chunks)
        for h in range(heads):
            qm = YMMRegister()
            VMASKMOVPS(qm, mask, row(qd, hd4, h))
            for c in range(keys):
                km = YMMRegister()
                VMASKMOVPS(km, mask, key_addr(kd, kd4, c))
                VFMADD231PS(accs[h][c], qm, km)
    return accs


