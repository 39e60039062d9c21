"""Grouped-query causal attention over an f32 KV cache, for one query or a block of queries.

For query i (absolute position pos0 + i) and query head h in [h0, h1):

    s_j      = scale * q[i, h] . k[kv(h), j]      for j = 0 .. pos0 + i     (causal)
    p        = softmax(s)                           (max-subtracted)
    out[i,h] = sum_j p_j v[kv(h), j]                kv(h) = h // group

Two kernels: ``attention`` sees every earlier key; ``attention_window`` (Gemma's
sliding-window layers) only the last ``window`` ones, j > pos0 + i - window
(llama.cpp's standard SWA masks p - j >= window). It is the same code with the
first key and the key count of each query moved to the window: its scores,
softmax and P V passes run over min(pos0 + i + 1, window) keys, never a
masked one. ``attention`` is emitted exactly as before the window existed.

Query heads that share a KV head are processed together, up to MAX_HEADS at a
time: each K and V row is then read once per query and KV head instead of once
per query head, and at long contexts decode is bound by reading the cache.

Three streaming passes per (query, heads sharing a KV head):

 1. scores: the cache rows are contiguous along head_dim, so dot products are
    vectorised over head_dim with a tile of heads x keys accumulating in
    registers (independent FMA chains hide the FMA latency), each accumulator
    reduced to a score with VHADDPS; scores go to one scratch row per head;
 2. softmax in place on those rows (max; exp and sum; scale by 1/sum), which
    stay in L1/L2 (16 KB per head at 4096 keys);
 3. out = P V, vectorised over head_dim with a tile of heads x head_dim chunks
    in registers. Keys go in blocks of KEY_BLOCK so that when head_dim needs
    more than one tile, the V rows of a block are still in L1 for the next
    tile; each tile adds its block's partial sums into out.

Nothing is quadratic: the work per query is linear in its number of keys.
head_dim that is not a multiple of 8 ends in one masked chunk (VMASKMOVPS), so
nothing past a row is read and nothing past out's row is written.

Loop state that does not fit in the 14 usable GP registers lives in stack
slots (PeachPy LocalVariable): each pass loads the few values it needs.
"""
from types import SimpleNamespace

from peachpy import Constant
from peachpy.x86_64 import (GeneralPurposeRegister64, YMMRegister, LocalVariable, LOAD, Loop, Block,
                            RETURN, MOV, LEA, ADD, SUB, IMUL, SHL, SHR, AND, CMP, TEST, DEC, CMOVA,
                            JA, JB, JAE, JE, JNE, JZ, JNZ, JMP, XOR,
                            VMOVUPS, VMOVAPS, VMOVSS, VMASKMOVPS, VBROADCASTSS, VXORPS, VANDPS, VCVTTSS2SI,
                            VFMADD231PS, VADDPS, VSUBPS, VMULPS, VMULSS, VDIVPS, VMAXPS, VHADDPS,
                            VPERM2F128, VBLENDPS, VBLENDVPS, VEXTRACTF128)

from .common import Kernel, fold_lanes, function, symbol, tail_mask
from .vmath import exp_ps

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

# The caller's scratch holds MAX_HEADS score rows, each n_ctx rounded up to a
# multiple of 8 floats (runtime/native/attention.py sizes it; the manifest's
# tile "h<MAX_HEADS>" lets the binding check that the two agree).

SIGNATURE = [("q", "const float*"), ("k_cache", "const float*"), ("v_cache", "const float*"),
             ("out", "float*"), ("scratch", "float*"),
             ("m", "size_t"), ("head_dim", "size_t"), ("n_head", "size_t"), ("group", "size_t"),
             ("n_ctx", "size_t"), ("pos0", "size_t"), ("h0", "size_t"), ("h1", "size_t"),
             ("scale", "float")]
# The window travels as a float: a plan record has 13 integer slots and the
# signature above fills them. float32 holds every integer below 2^24 exactly
# (the binding checks window < n_ctx <= 2^24); the kernel truncates it back.
WINDOW_SIGNATURE = SIGNATURE + [("window", "float")]


def gp():
    return GeneralPurposeRegister64()


def ymms(n):
    return [YMMRegister() for _ in range(n)]


def row(base, stride, r, disp=0):
    """Address of row ``r`` (0..2) of a block of rows ``stride`` bytes apart."""
    if r == 0:
        return [base + disp]
    return [base + stride * r + disp]


def new_frame(windowed):
    """Stack slots for the loop state (8 bytes each, the scale 4).

    ``windowed`` adds the window, the keys up to the current query (``total``)
    and the bytes from a head's first cache row to the window's (``key_skip``)."""
    names = ["q_row", "out_row", "queries_left", "n_keys", "h", "h1", "kv", "group_end", "group",
             "k", "v", "kv_stride", "row_stride", "hd4", "full_chunks", "tail", "stride4", "scores",
             "q_heads", "k_head", "v_head", "out_heads", "heads_count", "h0", "kv0", "group_end0"]
    if windowed:
        names += ["window", "total", "key_skip"]
    frame = SimpleNamespace(**{name: LocalVariable(8) for name in names})
    frame.scale = LocalVariable(4)
    frame.windowed = windowed
    return frame


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

    accs = [ymms(keys) for _ in range(heads)]
    for a in sum(accs, []):
        VXORPS(a, a, a)
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


def emit_scores(heads, frame):
    """Scores rows [head][key] = scale * q . k for every key of this query."""
    keys = SCORE_KEYS[heads]
    k_rows, out, keys_left, stride4 = gp(), gp(), gp(), gp()
    MOV(k_rows, frame.k_head)
    MOV(out, frame.scores)
    MOV(keys_left, frame.n_keys)
    MOV(stride4, frame.stride4)

    blocks = Loop()
    CMP(keys_left, keys)
    JB(blocks.end)
    with blocks:
        accs = score_dots(heads, keys, frame, frame.q_heads, k_rows)
        scale = YMMRegister()
        VBROADCASTSS(scale, frame.scale)
        for h in range(heads):
            s = reduce_to_scores(accs[h])
            VMULPS(s, s, scale.as_xmm if keys == 4 else scale)
            VMOVUPS(row(out, stride4, h), s)
        step = gp()
        MOV(step, frame.hd4)
        IMUL(step, step, keys)
        ADD(k_rows, step)
        ADD(out, keys * FLOAT)
        SUB(keys_left, keys)
        CMP(keys_left, keys)
        JAE(blocks.begin)

    singles = Loop()
    TEST(keys_left, keys_left)
    JZ(singles.end)
    with singles:
        accs = score_dots(heads, 1, frame, frame.q_heads, k_rows)
        for h in range(heads):
            s = reduce_to_scalar(accs[h][0])
            VMULSS(s, s, frame.scale)
            VMOVSS(row(out, stride4, h), s)
        ADD(k_rows, frame.hd4)
        ADD(out, FLOAT)
        DEC(keys_left)
        JNZ(singles.begin)


# ---------------------------------------------------------------- pass 2: softmax

def emit_softmax_row(frame, score_row):
    """In place: s -> exp(s - max s) / sum, over the first n_keys entries of the row."""
    p, chunks, tail = gp(), gp(), gp()

    def for_each_chunk(body, masked_body):
        MOV(p, score_row)
        MOV(chunks, frame.n_keys)
        SHR(chunks, 3)
        loop = Loop()
        JZ(loop.end)
        with loop:
            body()
            ADD(p, CHUNK)
            DEC(chunks)
            JNZ(loop.begin)
        last = Block()
        with last:
            MOV(tail, frame.n_keys)
            AND(tail, LANES - 1)
            JZ(last.end)
            mask = YMMRegister()
            tail_mask(mask, tail)
            masked_body(mask)

    peak = YMMRegister()
    VMOVAPS(peak, NEG_INF)

    def max_masked(mask):
        x, neg_inf = YMMRegister(), YMMRegister()
        VMASKMOVPS(x, mask, [p])
        VMOVAPS(neg_inf, NEG_INF)
        VBLENDVPS(x, neg_inf, x, mask)
        VMAXPS(peak, peak, x)
    for_each_chunk(lambda: VMAXPS(peak, peak, [p]), max_masked)
    fold_lanes(VMAXPS, peak)

    total = YMMRegister()
    VXORPS(total, total, total)

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
    for_each_chunk(exp_chunk, exp_chunk)
    fold_lanes(VADDPS, total)

    inverse = YMMRegister()
    VMOVAPS(inverse, Constant.float32x8(1.0))
    VDIVPS(inverse, inverse, total)

    def normalise_chunk(mask=None):
        x = YMMRegister()
        if mask is None:
            VMULPS(x, inverse, [p])
            VMOVUPS([p], x)
        else:
            VMASKMOVPS(x, mask, [p])
            VMULPS(x, x, inverse)
            VMASKMOVPS([p], mask, x)
    for_each_chunk(normalise_chunk, normalise_chunk)


def emit_softmax(heads, frame):
    score_row = gp()
    MOV(score_row, frame.scores)
    for h in range(heads):
        if h:
            ADD(score_row, frame.stride4)
        emit_softmax_row(frame, score_row)


# ---------------------------------------------------------------- pass 3: out = P V

def emit_pv_tile(heads, chunks, masked, frame, first_key, block_keys, offset):
    """out[heads, offset .. offset + chunks*8) (+)= P[heads, block] V[block, same columns].

    The first key block stores, later blocks add to what out holds."""
    accs = [ymms(chunks) for _ in range(heads)]
    for a in sum(accs, []):
        VXORPS(a, a, a)
    probs, values, hd4, stride4, keys_left = gp(), gp(), gp(), gp(), gp()
    MOV(hd4, frame.hd4)
    MOV(stride4, frame.stride4)
    MOV(probs, frame.scores)
    LEA(probs, [probs + first_key * FLOAT])
    MOV(values, first_key)
    IMUL(values, hd4)
    ADD(values, frame.v_head)
    ADD(values, offset)
    MOV(keys_left, block_keys)
    mask = None
    if masked:
        tail = gp()
        MOV(tail, frame.tail)
        mask = YMMRegister()
        tail_mask(mask, tail)

    with Loop() as keys:
        p = ymms(heads)
        for h in range(heads):
            VBROADCASTSS(p[h], row(probs, stride4, h))
        for c in range(chunks):
            if masked:
                vm = YMMRegister()
                VMASKMOVPS(vm, mask, [values + c * CHUNK])
                for h in range(heads):
                    VFMADD231PS(accs[h][c], p[h], vm)
            else:
                for h in range(heads):
                    VFMADD231PS(accs[h][c], p[h], [values + c * CHUNK])
        ADD(probs, FLOAT)
        ADD(values, hd4)
        DEC(keys_left)
        JNZ(keys.begin)

    out = gp()
    MOV(out, frame.out_heads)
    ADD(out, offset)
    accumulate = Block()
    with accumulate:
        TEST(first_key, first_key)
        JZ(accumulate.end)
        for h in range(heads):
            for c in range(chunks):
                if masked:
                    old = YMMRegister()
                    VMASKMOVPS(old, mask, row(out, hd4, h, c * CHUNK))
                    VADDPS(accs[h][c], accs[h][c], old)
                else:
                    VADDPS(accs[h][c], accs[h][c], row(out, hd4, h, c * CHUNK))
    for h in range(heads):
        for c in range(chunks):
            if masked:
                VMASKMOVPS(row(out, hd4, h, c * CHUNK), mask, accs[h][c])
            else:
                VMOVUPS(row(out, hd4, h, c * CHUNK), accs[h][c])


def emit_pv(heads, frame):
    tile = PV_CHUNKS[heads]
    first_key, block_keys, limit = gp(), gp(), gp()
    MOV(first_key, 0)
    with Loop() as key_blocks:
        MOV(block_keys, frame.n_keys)
        SUB(block_keys, first_key)
        MOV(limit, KEY_BLOCK)
        CMP(block_keys, limit)
        CMOVA(block_keys, limit)

        offset, chunks_left = gp(), gp()
        MOV(offset, 0)
        MOV(chunks_left, frame.full_chunks)
        full_tiles = Loop()
        CMP(chunks_left, tile)
        JB(full_tiles.end)
        with full_tiles:
            emit_pv_tile(heads, tile, False, frame, first_key, block_keys, offset)
            ADD(offset, tile * CHUNK)
            SUB(chunks_left, tile)
            CMP(chunks_left, tile)
            JAE(full_tiles.begin)
        remainder = Block()
        with remainder:
            for chunks in range(1, tile):
                narrower = Block()
                with narrower:
                    CMP(chunks_left, chunks)
                    JNE(narrower.end)
                    emit_pv_tile(heads, chunks, False, frame, first_key, block_keys, offset)
                    ADD(offset, chunks * CHUNK)
                    JMP(remainder.end)
        masked = Block()
        with masked:
            CMP(frame.tail, 0)
            JE(masked.end)
            emit_pv_tile(heads, 1, True, frame, first_key, block_keys, offset)

        ADD(first_key, KEY_BLOCK)
        CMP(first_key, frame.n_keys)
        JB(key_blocks.begin)


# ---------------------------------------------------------------- driver

def emit_heads(frame):
    """Process the next min(MAX_HEADS, heads left, heads left in the KV group) heads."""
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
                emit_scores(heads, frame)
                emit_softmax(heads, frame)
                emit_pv(heads, frame)
                JMP(done.end)


def emit_head_pointers(frame):
    """q, out of heads h.. of this query; K, V of their KV head."""
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
    if frame.windowed:
        ADD(kv_offset, frame.key_skip)
    MOV(p, frame.k)
    ADD(p, kv_offset)
    MOV(frame.k_head, p)
    MOV(p, frame.v)
    ADD(p, kv_offset)
    MOV(frame.v_head, p)


def emit_query(frame):
    """Heads h0..h1-1 of the current query, MAX_HEADS of a KV group at a time."""
    t = gp()
    for slot, start in ((frame.h, frame.h0), (frame.kv, frame.kv0), (frame.group_end, frame.group_end0)):
        MOV(t, start)
        MOV(slot, t)
    with Loop() as head_groups:
        emit_head_pointers(frame)
        emit_heads(frame)
        h = gp()
        MOV(h, frame.h)
        ADD(h, frame.heads_count)
        MOV(frame.h, h)
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


def emit_setup(frame, args):
    """Arguments and the values derived from them into the frame (few registers live at once)."""
    by_name = {a.name: a for a in args}

    def load(name):
        reg = gp()
        LOAD.ARGUMENT(reg, by_name[name])
        return reg

    # register-passed arguments first, before anything else can take their registers
    for name, slot in (("q", frame.q_row), ("k_cache", frame.k), ("v_cache", frame.v),
                       ("out", frame.out_row), ("scratch", frame.scores), ("m", frame.queries_left)):
        MOV(slot, load(name))
    scale = YMMRegister()
    LOAD.ARGUMENT(scale.as_xmm, by_name["scale"])
    VMOVSS(frame.scale, scale.as_xmm)
    if frame.windowed:
        window_f, window = YMMRegister(), gp()
        LOAD.ARGUMENT(window_f.as_xmm, by_name["window"])
        VCVTTSS2SI(window, window_f.as_xmm)
        MOV(frame.window, window)
    for name, slot in (("group", frame.group), ("h0", frame.h0), ("h1", frame.h1)):
        MOV(slot, load(name))
    # kv0 = h0 // group by counting (no DIV: its implicit rax/rdx operands are
    # invisible to PeachPy's register allocator); a plan record has room for
    # 13 integer arguments, so the kernel derives this one itself.
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

    head_dim, t = load("head_dim"), gp()
    hd4 = gp()
    LEA(hd4, [head_dim * FLOAT])
    MOV(frame.hd4, hd4)
    MOV(t, head_dim)
    SHR(t, 3)
    MOV(frame.full_chunks, t)
    MOV(t, head_dim)
    AND(t, LANES - 1)
    MOV(frame.tail, t)
    n_head = load("n_head")
    IMUL(n_head, hd4)
    MOV(frame.row_stride, n_head)
    n_ctx = load("n_ctx")
    MOV(t, n_ctx)
    IMUL(t, hd4)
    MOV(frame.kv_stride, t)
    LEA(t, [n_ctx + LANES - 1])
    AND(t, -LANES)
    SHL(t, 2)
    MOV(frame.stride4, t)
    pos0 = load("pos0")
    ADD(pos0, 1)
    MOV(frame.total if frame.windowed else frame.n_keys, pos0)
    group_end = gp()
    MOV(group_end, frame.kv0)
    ADD(group_end, 1)
    IMUL(group_end, frame.group)
    MOV(frame.group_end0, group_end)


def emit_window(frame):
    """This query's keys: n_keys = min(total, window), the last of them at total - 1."""
    total, n_keys, skip = gp(), gp(), gp()
    MOV(total, frame.total)
    MOV(n_keys, frame.window)
    CMP(n_keys, total)
    CMOVA(n_keys, total)
    MOV(frame.n_keys, n_keys)
    MOV(skip, total)
    SUB(skip, n_keys)
    IMUL(skip, frame.hd4)
    MOV(frame.key_skip, skip)


def emit_attention(isa, windowed=False):
    name, signature = ("attention_window", WINDOW_SIGNATURE) if windowed else ("attention", SIGNATURE)
    fn, args = function(symbol(name, "f32", "", isa), signature, isa)
    with fn:
        frame = new_frame(windowed)
        emit_setup(frame, args)
        with Loop() as queries:
            if windowed:
                emit_window(frame)
            emit_query(frame)
            step = gp()
            MOV(step, frame.row_stride)
            ADD(frame.q_row, step)
            ADD(frame.out_row, step)
            ADD(frame.total if windowed else frame.n_keys, 1)
            SUB(frame.queries_left, 1)
            JNZ(queries.begin)
        RETURN()
    return Kernel(fn, "attention", isa, tile=f"h{MAX_HEADS}", args=signature)


def emit(isa):
    return [emit_attention(isa), emit_attention(isa, windowed=True)]
