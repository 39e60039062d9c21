"""The paged attention kernels' drivers: the row loop (rows alone or in pairs), the segment
and head loops that call the three passes, the argument setup, and ``attention_paged`` and
``attention_combine`` themselves."""
from peachpy.x86_64 import (ADD, AND, Block, CMOVA, CMOVB, CMP, IMUL, JA, JB, JE, JMP, JNE, JNZ, JZ, LEA,
                            LOAD, Loop, MOV, RETURN, SHL, SHR, SUB, TEST, VCVTTSS2SI, VMOVSS, XOR, YMMRegister)

from ..attention import FLOAT, LANES, MAX_HEADS, gp
from ..common import Kernel, function, symbol
from ..contract import ATTENTION_ROWS, KV_BLOCK, KV_SEGMENT, PARTIAL_EXTRA
from ..peachpy_ext import upper_zmm_function

from .frame import (ARENA_BYTES, ATTENTION_SIGNATURE, COMBINE_SIGNATURE, FAMILY, INDEX, LOG2_KV_BLOCK,
                    LOG2_SEGMENT, SCORE_SLACK, bump, new_frame, typed, unpack_tiles)
from .pv import emit_pv
from .scores import emit_query_quants, emit_scores
from .softmax import emit_combine, emit_partial_softmax


def emit_segments(heads, frame):
    """The segments s = seg0 (mod seg_step) of this row's keys [row_first, row_last]: each
    one's scores, softmax and P V into the tile's partial records at hbase + s * seg_stride."""
    s, t = gp(), gp()
    MOV(s, frame.seg_start)
    skip = Loop()
    with skip:                                       # segments wholly before the row's first key
        LEA(t, [s + 1])
        SHL(t, LOG2_SEGMENT)
        CMP(t, frame.row_first)
        JA(skip.end)
        ADD(s, frame.seg_step)
        JMP(skip.begin)
    MOV(frame.seg, s)
    segments = Loop()
    with segments:
        s, first, last, bound = gp(), gp(), gp(), gp()
        MOV(s, frame.seg)
        MOV(first, s)
        SHL(first, LOG2_SEGMENT)
        MOV(bound, frame.row_last)
        CMP(first, bound)
        JA(segments.end)
        LEA(last, [first + KV_SEGMENT - 1])
        CMP(last, bound)
        CMOVA(last, bound)
        MOV(bound, frame.row_first)
        CMP(first, bound)
        CMOVB(first, bound)
        MOV(frame.first, first)
        SUB(last, first)
        ADD(last, 1)
        MOV(frame.n_keys, last)
        rec = gp()
        MOV(rec, s)
        IMUL(rec, frame.seg_stride)
        ADD(rec, frame.hbase)
        MOV(frame.rec_heads, rec)
        emit_scores(heads, frame)
        emit_partial_softmax(heads, frame)
        emit_pv(heads, frame)
        bump(frame.seg, frame.seg_step)
        JMP(segments.begin)


def emit_row_combine(heads, frame):
    """Whole rows: combine the tile's heads' segments into out."""
    whole = Block()
    with whole:
        CMP(frame.whole, 0)
        JE(whole.end)
        for h in range(heads):
            lo, hi, rec, t = gp(), gp(), gp(), gp()
            MOV(lo, frame.row_first)
            SHR(lo, LOG2_SEGMENT)
            MOV(hi, frame.row_last)
            SHR(hi, LOG2_SEGMENT)
            SUB(hi, lo)
            ADD(hi, 1)
            MOV(frame.combine_count, hi)
            MOV(rec, lo)
            IMUL(rec, frame.seg_stride)
            ADD(rec, frame.hbase)
            if h:
                MOV(t, frame.rec4)
                IMUL(t, t, h)
                ADD(rec, t)
            MOV(frame.combine_rec, rec)
            MOV(t, frame.out_heads)
            if h:
                ADD(t, frame.hd4)
                if h == 2:
                    ADD(t, frame.hd4)
            MOV(frame.combine_out, t)
            emit_combine(frame)


def emit_heads(frame):
    """The next min(MAX_HEADS, heads left, heads left in the KV group) heads of this row."""
    def variant(heads):
        if frame.q8:
            emit_query_quants(heads, frame)
        emit_segments(heads, frame)
        emit_row_combine(heads, frame)
    emit_head_variants(frame, variant)


def emit_head_variants(frame, emit_variant):
    """frame.heads_count = min(MAX_HEADS, heads left, heads left in the KV group), and
    ``emit_variant(heads)`` for each count, the one that matches run."""
    count, heads_left, group_left = gp(), gp(), gp()
    MOV(heads_left, frame.h1)
    SUB(heads_left, frame.h)
    MOV(group_left, frame.group_end)
    SUB(group_left, frame.h)
    MOV(count, MAX_HEADS)
    CMP(count, heads_left)
    CMOVA(count, heads_left)
    CMP(count, group_left)
    CMOVA(count, group_left)
    MOV(frame.heads_count, count)
    done = Block()
    with done:
        for heads in range(1, MAX_HEADS + 1):
            variant = Block()
            with variant:
                if heads < MAX_HEADS:
                    CMP(count, heads)
                    JNE(variant.end)
                emit_variant(heads)
                JMP(done.end)



def emit_pair_segments(heads, frame):
    """The segments both rows of a pair see whole, s < pair_end = (min(row_last, row_last_b)
    + 1) / KV_SEGMENT (no window: every row's keys start at 0): scores, softmax and P V of
    both rows' heads, each K and V vector loaded once, each row's partial records its own."""
    end, t = gp(), gp()
    MOV(end, frame.row_last)
    CMP(end, frame.row_last_b)
    CMOVA(end, frame.row_last_b)
    ADD(end, 1)
    SHR(end, LOG2_SEGMENT)
    MOV(frame.pair_end, end)
    MOV(frame.seg, 0)
    segments = Loop()
    CMP(end, 0)
    JE(segments.end)
    with segments:
        s, first, rec = gp(), gp(), gp()
        MOV(s, frame.seg)
        MOV(first, s)
        SHL(first, LOG2_SEGMENT)
        MOV(frame.first, first)
        MOV(frame.n_keys, KV_SEGMENT)
        for base, slot in ((frame.hbase, frame.rec_heads), (frame.hbase_b, frame.rec_heads_b)):
            MOV(rec, s)
            IMUL(rec, frame.seg_stride)
            ADD(rec, base)
            MOV(slot, rec)
        emit_scores(heads, frame, pair=True)
        emit_partial_softmax(heads, frame)
        emit_partial_softmax(heads, frame, row_b=True)
        emit_pv(heads, frame, pair=True)
        s = bump(frame.seg, 1)
        CMP(s, frame.pair_end)
        JB(segments.begin)
    MOV(t, frame.pair_end)
    MOV(frame.seg_start, t)


def swap_rows(frame, to_b):
    """Put row B's pointers and last key where the one-row passes read row A's (to_b), or
    row A's back."""
    t = gp()
    for slot, a, b in ((frame.q_heads, frame.q_heads_a, frame.q_heads_b),
                       (frame.out_heads, frame.out_heads_a, frame.out_heads_b),
                       (frame.hbase, frame.hbase_a, frame.hbase_b),
                       (frame.row_last, frame.row_last_a, frame.row_last_b)):
        if to_b:
            MOV(t, slot)
            MOV(a, t)
        MOV(t, b if to_b else a)
        MOV(slot, t)


def emit_heads_pair(frame):
    """emit_heads for a pair of rows: the segments both see whole together, then each row's
    later segments alone (emit_segments from pair_end), then each row's combine."""
    def variant(heads):
        emit_pair_segments(heads, frame)
        emit_segments(heads, frame)              # row A's segments from pair_end
        swap_rows(frame, to_b=True)
        emit_segments(heads, frame)              # row B's
        emit_row_combine(heads, frame)
        swap_rows(frame, to_b=False)
        emit_row_combine(heads, frame)
    emit_head_variants(frame, variant)


def emit_row_pair(frame):
    """Heads h0..h1-1 of the current row (A) and the next (B), MAX_HEADS of a KV group at a
    time: emit_row for two rows of one sequence and no window (emit_row_keys has set up A;
    row_last_b and partial_scratch_b are B's)."""
    def group():
        p = gp()
        MOV(p, frame.q_heads)
        ADD(p, frame.row_stride)
        MOV(frame.q_heads_b, p)
        MOV(p, frame.out_heads)
        ADD(p, frame.dest_step)
        MOV(frame.out_heads_b, p)
        MOV(p, frame.h)
        IMUL(p, frame.phead)
        ADD(p, frame.partial_scratch_b)
        MOV(frame.hbase_b, p)
        emit_heads_pair(frame)
    emit_head_groups(frame, group)


def next_row(frame, rows):
    """Step the row pointers ``rows`` rows on."""
    step = gp()
    for _ in range(rows):
        MOV(step, frame.row_stride)
        ADD(frame.q_row, step)
        MOV(step, frame.dest_step)
        ADD(frame.out_row, step)
        ADD(frame.positions, INDEX)
        ADD(frame.row_seq, INDEX)


def emit_head_pointers(frame):
    """q, out of heads h.. of this row; K, V of their KV head in block 0; their partials."""
    head_offset, kv_offset, p = gp(), gp(), gp()
    MOV(head_offset, frame.h)
    IMUL(head_offset, frame.hd4)
    MOV(p, frame.q_row)
    ADD(p, head_offset)
    MOV(frame.q_heads, p)
    MOV(p, frame.out_row)
    ADD(p, head_offset)
    MOV(frame.out_heads, p)
    MOV(kv_offset, frame.kv)
    IMUL(kv_offset, frame.kv_stride)
    MOV(p, frame.k)
    ADD(p, kv_offset)
    MOV(frame.k_head, p)
    MOV(p, frame.v)
    ADD(p, kv_offset)
    MOV(frame.v_head, p)
    MOV(p, frame.h)
    IMUL(p, frame.phead)
    ADD(p, frame.pbase)
    MOV(frame.hbase, p)


def emit_row_keys(frame):
    """This row's keys [row_first, row_last] and block table, from positions / row_seq in
    memory, and where its partial records go."""
    position, seq, n1, t = gp(), gp(), gp(), gp()
    MOV(t, frame.positions)
    MOV(position.as_dword, [t])                      # zero-extends: positions are >= 0
    MOV(t, frame.row_seq)
    MOV(seq.as_dword, [t])
    IMUL(seq, frame.table_stride4)
    ADD(seq, frame.tables)
    MOV(frame.table_row, seq)
    MOV(frame.row_last, position)
    MOV(n1, frame.window1)                           # n_keys - 1 = min(p, window - 1)
    CMP(n1, position)
    CMOVA(n1, position)
    SUB(position, n1)
    MOV(frame.row_first, position)
    # partials: whole rows in the scratch, counted from the row's first segment; else dest's row
    pbase = gp()
    MOV(pbase, frame.out_row)
    split = Block()
    with split:
        CMP(frame.whole, 0)
        JE(split.end)
        SHR(position, LOG2_SEGMENT)
        IMUL(position, frame.seg_stride)
        MOV(pbase, frame.partial_scratch)
        SUB(pbase, position)
    MOV(frame.pbase, pbase)


def emit_row(frame):
    """Heads h0..h1-1 of the current row, MAX_HEADS of a KV group at a time."""
    t = gp()
    MOV(t, frame.seg0)
    MOV(frame.seg_start, t)
    emit_head_groups(frame, lambda: emit_heads(frame))


def emit_head_groups(frame, emit_group):
    """Heads h0..h1-1, a tile of up to MAX_HEADS of one KV group at a time: each tile's
    pointers (emit_head_pointers), then ``emit_group()``, which sets frame.heads_count."""
    t = gp()
    for slot, start in ((frame.h, frame.h0), (frame.kv, frame.kv0), (frame.group_end, frame.group_end0)):
        MOV(t, start)
        MOV(slot, t)
    with Loop() as head_groups:
        emit_head_pointers(frame)
        emit_group()
        h = bump(frame.h, frame.heads_count)
        next_kv = Block()
        with next_kv:
            CMP(h, frame.group_end)
            JNE(next_kv.end)
            ADD(frame.kv, 1)
            group = gp()
            MOV(group, frame.group)
            ADD(frame.group_end, group)
        CMP(h, frame.h1)
        JB(head_groups.begin)


def low_high(packed, low, high):
    """Unpack ``packed`` = low | high << 32 into two registers."""
    MOV(low.as_dword, packed.as_dword)               # zero-extends
    MOV(high, packed)
    SHR(high, 32)


def record_layout(frame, head_dim):
    """rec4: a partial record's bytes; stat: the offset of its max, sum, weight."""
    t = gp()
    LEA(t, [head_dim + LANES - 1])
    AND(t, -LANES)
    SHL(t, 2)
    MOV(frame.stat, t)
    ADD(t, PARTIAL_EXTRA * FLOAT)
    MOV(frame.rec4, t)


def argument_loader(args):
    """load(name): a fresh register holding the integer or pointer argument ``name``."""
    by_name = {a.name: a for a in args}

    def load(name):
        reg = gp()
        LOAD.ARGUMENT(reg, by_name[name])
        return reg
    return load


def store_window(frame, arg):
    """frame.window1 = window - 1 from the float argument ``arg``."""
    window_f, window = YMMRegister(), gp()
    LOAD.ARGUMENT(window_f.as_xmm, arg)
    VCVTTSS2SI(window, window_f.as_xmm)
    SUB(window, 1)                                   # window 0 (unlimited) wraps to 2^64 - 1
    MOV(frame.window1, window)


def store_head_dim(frame, head_dim):
    """The frame's row sizes of head_dim (hd4, full ymm chunks, tail, record layout); returns hd4."""
    t, hd4 = gp(), gp()
    LEA(hd4, [head_dim * FLOAT])
    MOV(frame.hd4, hd4)
    MOV(t, head_dim)
    SHR(t, 3)
    MOV(frame.full_chunks, t)
    MOV(t, head_dim)
    AND(t, LANES - 1)
    MOV(frame.tail, t)
    record_layout(frame, head_dim)
    return hd4


def emit_setup(frame, args):
    by_name = {a.name: a for a in args}
    load = argument_loader(args)

    for name, slot in (("q", frame.q_row), ("k_arena", frame.k), ("v_arena", frame.v),
                       ("dest", frame.out_row), ("scratch", frame.scores), ("positions", frame.positions),
                       ("row_seq", frame.row_seq), ("tables", frame.tables)):
        MOV(slot, load(name))
    ADD(frame.scores, SCORE_SLACK * FLOAT)           # score rows after the slack (emit_scores)
    packed = load("rows")
    m, table_stride = gp(), gp()
    low_high(packed, m, table_stride)
    MOV(frame.rows_left, m)
    scale = YMMRegister()
    LOAD.ARGUMENT(scale.as_xmm, by_name["scale"])
    VMOVSS(frame.scale, scale.as_xmm)
    store_window(frame, by_name["window"])

    packed = load("kv_heads")
    n_kv, group = gp(), gp()
    low_high(packed, n_kv, group)
    MOV(frame.group, group)
    packed = load("heads")
    h0, h1 = gp(), gp()
    low_high(packed, h0, h1)
    MOV(frame.h0, h0)
    MOV(frame.h1, h1)
    # kv0 = h0 // group by counting (no DIV: its implicit rax/rdx are invisible to PeachPy)
    kv0, group_start = gp(), gp()
    XOR(kv0, kv0)
    MOV(group_start, frame.group)
    with Loop() as count_groups:
        CMP(group_start, frame.h0)
        JA(count_groups.end)
        ADD(kv0, 1)
        ADD(group_start, frame.group)
        JMP(count_groups.begin)
    MOV(frame.kv0, kv0)
    group_end = gp()
    LEA(group_end, [kv0 + 1])
    IMUL(group_end, frame.group)
    MOV(frame.group_end0, group_end)

    head_dim, block_tiles, head_tiles, t = gp(), gp(), gp(), gp()
    unpack_tiles(load("head_dim"), head_dim, block_tiles, head_tiles)
    hd4 = store_head_dim(frame, head_dim)
    MOV(t, head_dim)
    SHR(t, frame.lanes.bit_length() - 1)
    MOV(frame.pass_chunks, t)
    MOV(frame.head_dim, head_dim)
    if frame.q8:
        MOV(t, head_dim)                             # head_dim quants + head_dim / 8 scale bytes
        SHR(t, 3)
        ADD(t, head_dim)
    else:
        LEA(t, [head_dim * ARENA_BYTES[frame.arena]])
    MOV(frame.kd, t)
    SHL(t, LOG2_KV_BLOCK)                            # a tile's bytes
    IMUL(head_tiles, t)
    MOV(frame.kv_stride, head_tiles)                 # from one KV head to the next
    IMUL(t, block_tiles)
    MOV(frame.block_stride, t)
    n_head = gp()
    MOV(n_head, group)                               # q, out rows: n_head = n_kv * group heads
    IMUL(n_head, n_kv)
    MOV(t, n_head)
    IMUL(t, hd4)
    MOV(frame.row_stride, t)
    MOV(frame.stride4, KV_SEGMENT * FLOAT)           # score rows: one segment each
    p = gp()
    MOV(p, frame.scores)
    ADD(p, ATTENTION_ROWS * MAX_HEADS * KV_SEGMENT * FLOAT)
    MOV(frame.partial_scratch, p)
    MOV(t, table_stride)
    SHL(t, 2)
    MOV(frame.table_stride4, t)

    packed = load("segments")
    seg0, step = gp(), gp()
    low_high(packed, seg0, step)
    whole, split = Block(), Block()
    # whole rows: every segment, records [segment][MAX_HEADS] in the scratch, combined into out
    rec4 = gp()
    MOV(rec4, frame.rec4)
    with whole:
        TEST(step, step)
        JNZ(whole.end)
        MOV(frame.whole, 1)
        MOV(frame.seg0, 0)
        MOV(frame.seg_step, 1)
        MOV(frame.phead, 0)
        MOV(t, rec4)
        IMUL(t, t, MAX_HEADS)
        MOV(frame.seg_stride, t)
        MOV(t, frame.row_stride)
        MOV(frame.dest_step, t)
        # row B of a pair keeps its records after row A's: the segments a table holds, + 1
        MOV(t, table_stride)
        ADD(t, KV_SEGMENT // KV_BLOCK - 1)
        SHR(t, LOG2_SEGMENT - LOG2_KV_BLOCK)
        ADD(t, 1)
        IMUL(t, frame.seg_stride)
        ADD(t, frame.partial_scratch)
        MOV(frame.partial_scratch_b, t)
        JMP(split.end)
    with split:                                      # records [row][segment][n_head] in dest
        MOV(frame.whole, 0)
        MOV(frame.seg0, seg0)
        MOV(frame.seg_step, step)
        MOV(frame.phead, rec4)
        IMUL(rec4, n_head)
        MOV(frame.seg_stride, rec4)
        ADD(table_stride, KV_SEGMENT // KV_BLOCK - 1)  # segments of a table
        SHR(table_stride, LOG2_SEGMENT - LOG2_KV_BLOCK)
        IMUL(rec4, table_stride)
        MOV(frame.dest_step, rec4)


def emit_attention_paged(isa, arena):
    signature = typed(ATTENTION_SIGNATURE, arena, ("k_arena", "v_arena"))
    open_function = upper_zmm_function if isa == "avx512" else function
    fn, args = open_function(symbol("attention_paged", arena, "", isa), signature, isa)
    with fn:
        frame = new_frame(arena, isa)
        emit_setup(frame, args)
        with Loop() as rows:
            emit_row_keys(frame)
            if frame.pairs:
                alone = Block()
                with alone:
                    # a pair: two rows left, whole rows, no window, one sequence
                    CMP(frame.rows_left, 2)
                    JB(alone.end)
                    CMP(frame.whole, 0)
                    JE(alone.end)
                    CMP(frame.window1, -1)
                    JNE(alone.end)
                    seqs, position = gp(), gp()
                    MOV(seqs, frame.row_seq)
                    MOV(position.as_dword, [seqs])
                    CMP(position.as_dword, [seqs + INDEX])
                    JNE(alone.end)
                    MOV(seqs, frame.positions)
                    MOV(position.as_dword, [seqs + INDEX])   # zero-extends
                    MOV(frame.row_last_b, position)
                    emit_row_pair(frame)
                    next_row(frame, 2)
                    SUB(frame.rows_left, 2)
                    JZ(rows.end)
                    JMP(rows.begin)
            emit_row(frame)
            next_row(frame, 1)
            SUB(frame.rows_left, 1)
            JNZ(rows.begin)
        RETURN()
    return Kernel(fn, FAMILY, isa, tile=f"h{MAX_HEADS}s{KV_SEGMENT}k{KV_BLOCK}r{ATTENTION_ROWS}", args=signature)


def emit_attention_combine(isa):
    """out[i, h] for rows i < m and heads h0 <= h < h1 from the partial records
    [m, n_segments, n_head, rec] that attention_paged's split calls wrote (segments of the
    table_stride blocks), each head as the whole-row kernel combines it."""
    fn, args = function(symbol("attention_combine", "f32", "", isa), COMBINE_SIGNATURE, isa)
    with fn:
        frame = new_frame("f32")
        by_name = {a.name: a for a in args}
        load = argument_loader(args)
        for name, slot in (("partials", frame.pbase), ("out", frame.out_row), ("positions", frame.positions),
                           ("m", frame.rows_left)):
            MOV(slot, load(name))
        store_window(frame, by_name["window"])
        head_dim, t = load("head_dim"), gp()
        hd4 = store_head_dim(frame, head_dim)
        n_head = load("n_head")
        MOV(t, n_head)
        IMUL(t, hd4)
        MOV(frame.row_stride, t)
        rec4 = gp()
        MOV(rec4, frame.rec4)
        IMUL(rec4, n_head)
        MOV(frame.seg_stride, rec4)
        table_stride = load("table_stride")
        ADD(table_stride, KV_SEGMENT // KV_BLOCK - 1)
        SHR(table_stride, LOG2_SEGMENT - LOG2_KV_BLOCK)
        IMUL(rec4, table_stride)
        MOV(frame.dest_step, rec4)
        packed = load("heads")
        h0, h1 = gp(), gp()
        low_high(packed, h0, h1)
        MOV(frame.h0, h0)
        MOV(frame.h1, h1)
        with Loop() as rows:
            position, n1, lo, hi = gp(), gp(), gp(), gp()
            MOV(t, frame.positions)
            MOV(position.as_dword, [t])
            MOV(n1, frame.window1)
            CMP(n1, position)
            CMOVA(n1, position)
            MOV(hi, position)
            SUB(position, n1)
            MOV(lo, position)
            SHR(lo, LOG2_SEGMENT)
            SHR(hi, LOG2_SEGMENT)
            SUB(hi, lo)
            ADD(hi, 1)
            MOV(frame.combine_count, hi)
            IMUL(lo, frame.seg_stride)
            ADD(lo, frame.pbase)
            MOV(frame.row_first, lo)                 # the row's first record of head 0
            MOV(t, frame.h0)
            MOV(frame.h, t)
            with Loop() as heads:
                h, p = gp(), gp()
                MOV(h, frame.h)
                MOV(p, h)
                IMUL(p, frame.rec4)
                ADD(p, frame.row_first)
                MOV(frame.combine_rec, p)
                MOV(p, h)
                IMUL(p, frame.hd4)
                ADD(p, frame.out_row)
                MOV(frame.combine_out, p)
                emit_combine(frame)
                h = bump(frame.h, 1)
                CMP(h, frame.h1)
                JB(heads.begin)
            MOV(t, frame.dest_step)
            ADD(frame.pbase, t)
            MOV(t, frame.row_stride)
            ADD(frame.out_row, t)
            ADD(frame.positions, INDEX)
            SUB(frame.rows_left, 1)
            JNZ(rows.begin)
        RETURN()
    return Kernel(fn, FAMILY, isa, tile="", args=COMBINE_SIGNATURE)
