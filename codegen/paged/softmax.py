"""Pass 2 of paged attention: each head's segment softmax in place on its score row (max,
e_j = exp(s_j - max), their sum into the partial record), and the combine that merges a
row's partial records in segment order."""
from peachpy import Constant
from peachpy.x86_64 import (ADD, AND, Block, DEC, IMUL, JNZ, JZ, Loop, MOV, SHR, SUB, TEST, VADDPS, VANDPS,
                            VBLENDVPS, VBROADCASTSS, VDIVPS, VEXTRACTF64X4, VFMADD231PS, VMASKMOVPS, VMAXPS,
                            VMOVAPS, VMOVSS, VMOVUPS, VMULPS, VSUBPS, VXORPS, XOR, YMMRegister, ZMMRegister)

from ..attention import CHUNK, FLOAT, LANES, NEG_INF, gp
from ..common import fold_lanes, tail_mask
from ..vmath import exp_ps, first_dword

from .scores import ROW_B_SCORES


def head_address(out, base, stride, h):
    """out = the stack slot ``base`` + h times the stack slot ``stride``: head h of the tile's
    score rows or partial records."""
    MOV(out, base)
    if h:
        t = gp()
        MOV(t, stride)
        IMUL(t, t, h)
        ADD(out, t)


def emit_partial_softmax(heads, frame, row_b=False):
    """Per head of the tile: the segment's max score, e_j = exp(s_j - max) in place on the
    score row, and their sum (the same order as codegen/attention.py's softmax), max and sum
    stored in the head's partial record; nothing is normalised (the combine does it).
    ``row_b``: row B of a pair (its score rows and records)."""
    for h in range(heads):
        score_row = gp()
        head_address(score_row, frame.scores, frame.stride4, h)
        if row_b:
            ADD(score_row, ROW_B_SCORES)
        peak, total = emit_exp_row(frame, score_row)
        rec = gp()
        head_address(rec, frame.rec_heads_b if row_b else frame.rec_heads, frame.rec4, h)
        ADD(rec, frame.stat)
        VMOVSS([rec], peak.as_xmm)
        VMOVSS([rec + 4], total.as_xmm)


def emit_exp_row(frame, score_row):
    """codegen/attention.py's softmax up to the sum: (peak, total) ymm, every lane equal.

    The avx512 variant runs both passes on zmm over the row's whole 16s, then on ymm over
    what is left (an 8, then a masked tail): each e_j is the same bits either way (exp_ps
    computes lane by lane); the sum is the zmm partials (high half + low half) plus the
    ymm chunks' (an 8, then the tail), in an order that depends on n_keys alone."""
    p, chunks, tail = gp(), gp(), gp()
    wide = frame.wide

    def whole_chunks(lanes, body):
        """body() on each whole run of ``lanes`` scores from p on (p advanced past them)."""
        MOV(chunks, frame.n_keys)
        SHR(chunks, lanes.bit_length() - 1)
        loop = Loop()
        JZ(loop.end)
        with loop:
            body()
            ADD(p, lanes * FLOAT)
            DEC(chunks)
            JNZ(loop.begin)

    def for_each_chunk(body, masked_body, wide_body):
        MOV(p, score_row)
        if wide:
            whole_chunks(2 * LANES, wide_body)
            eight = Block()
            with eight:
                TEST(frame.n_keys, LANES)
                JZ(eight.end)
                body()
                ADD(p, CHUNK)
        else:
            whole_chunks(LANES, body)
        last = Block()
        with last:
            MOV(tail, frame.n_keys)
            AND(tail, LANES - 1)
            JZ(last.end)
            mask = YMMRegister()
            tail_mask(mask, tail)
            masked_body(mask)

    peak = YMMRegister()
    if wide:
        wide_peak = ZMMRegister()
        VBROADCASTSS(wide_peak, first_dword(NEG_INF))
    VMOVAPS(peak, NEG_INF)

    def max_wide():
        VMAXPS(wide_peak, wide_peak, [p])

    def max_masked(mask):
        x, neg_inf = YMMRegister(), YMMRegister()
        VMASKMOVPS(x, mask, [p])
        VMOVAPS(neg_inf, NEG_INF)
        VBLENDVPS(x, neg_inf, x, mask)
        VMAXPS(peak, peak, x)
    for_each_chunk(lambda: VMAXPS(peak, peak, [p]), max_masked, max_wide)
    if wide:
        fold_high_half(VMAXPS, peak, wide_peak)
    fold_lanes(VMAXPS, peak)

    total = YMMRegister()
    VXORPS(total, total, total)
    if wide:
        wide_total, wide_shift = ZMMRegister(), ZMMRegister()
        VXORPS(wide_total, wide_total, wide_total)
        VBROADCASTSS(wide_shift, peak.as_xmm)

    def exp_wide():
        x, t1, t2 = ZMMRegister(), ZMMRegister(), ZMMRegister()
        VMOVUPS(x, [p])
        VSUBPS(x, x, wide_shift)
        exp_ps(x, x, t1, t2)
        VMOVUPS([p], x)
        VADDPS(wide_total, wide_total, x)

    def exp_chunk(mask=None):
        x, t1, t2 = YMMRegister(), YMMRegister(), YMMRegister()
        if mask is None:
            VMOVUPS(x, [p])
        else:
            VMASKMOVPS(x, mask, [p])
        VSUBPS(x, x, peak)
        exp_ps(x, x, t1, t2)
        if mask is None:
            VMOVUPS([p], x)
        else:
            VANDPS(x, x, mask)          # lanes past n_keys loaded as 0: exp(0 - max) must not count
            VMASKMOVPS([p], mask, x)
        VADDPS(total, total, x)
    for_each_chunk(exp_chunk, exp_chunk, exp_wide)
    if wide:
        fold_high_half(VADDPS, total, wide_total)
    fold_lanes(VADDPS, total)
    return peak, total


def fold_high_half(op, acc, wide):
    """acc (ymm) = op(op(high half of ``wide``, its low half), acc): a zmm's partials into a
    ymm accumulator, in that fixed order."""
    high = YMMRegister()
    VEXTRACTF64X4(high, wide, 1)
    op(high, high, wide.as_ymm)
    op(acc, high, acc)



def emit_combine(frame):
    """out[0 .. head_dim) of one head = sum_s w_s o_s / sum_s w_s l_s over the head's
    combine_count partial records from combine_rec (seg_stride bytes apart, in segment
    order), w_s = exp(max_s - max over s). Each w_s is kept in its record's spare float.
    The sums run in segment order: the same bits whoever wrote the records."""
    rec, n, stride, stat = gp(), gp(), gp(), gp()
    MOV(stride, frame.seg_stride)
    MOV(stat, frame.stat)

    def over_segments(body):
        MOV(rec, frame.combine_rec)
        MOV(n, frame.combine_count)
        with Loop() as loop:
            body()
            ADD(rec, stride)
            DEC(n)
            JNZ(loop.begin)

    peak = YMMRegister()
    VMOVAPS(peak, NEG_INF)

    def max_body():
        x = YMMRegister()
        VBROADCASTSS(x, [rec + stat * 1])
        VMAXPS(peak, peak, x)
    over_segments(max_body)
    total = YMMRegister()
    VXORPS(total, total, total)

    def weight_body():
        w, t1, t2, l = YMMRegister(), YMMRegister(), YMMRegister(), YMMRegister()
        VBROADCASTSS(w, [rec + stat * 1])
        VSUBPS(w, w, peak)
        exp_ps(w, w, t1, t2)
        VMOVSS([rec + stat * 1 + 8], w.as_xmm)
        VBROADCASTSS(l, [rec + stat * 1 + 4])
        VFMADD231PS(total, w, l)
    over_segments(weight_body)
    inverse = YMMRegister()
    VMOVAPS(inverse, Constant.float32x8(1.0))
    VDIVPS(inverse, inverse, total)
    ADD(stat, 8)                                     # the weights

    column, out, chunks = gp(), gp(), gp()
    XOR(column.as_dword, column.as_dword)
    MOV(out, frame.combine_out)

    def column_sum():
        acc = YMMRegister()
        VXORPS(acc, acc, acc)

        def body():
            w = YMMRegister()
            VBROADCASTSS(w, [rec + stat * 1])
            ADD(rec, column)
            VFMADD231PS(acc, w, [rec])
            SUB(rec, column)
        over_segments(body)
        VMULPS(acc, acc, inverse)
        return acc

    MOV(chunks, frame.full_chunks)
    full = Loop()
    TEST(chunks, chunks)
    JZ(full.end)
    with full:
        acc = column_sum()
        VMOVUPS([out + column * 1], acc)
        ADD(column, CHUNK)
        DEC(chunks)
        JNZ(full.begin)
    if frame.arena == "f32":
        masked = Block()
        with masked:
            tail = gp()
            MOV(tail, frame.tail)
            TEST(tail, tail)
            JZ(masked.end)
            acc = column_sum()
            mask = YMMRegister()
            MOV(tail, frame.tail)
            tail_mask(mask, tail)
            VMASKMOVPS([out + column * 1], mask, acc)
