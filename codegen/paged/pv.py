"""Pass 3 of paged attention: out = P V over the segment's keys in key blocks, run by run
through the block table, into each head's partial record."""
from peachpy.x86_64 import (ADD, Block, CMOVA, CMP, DEC, JAE, JB, JE, JMP, JNE, JNZ, LEA, Loop, MOV,
                            PREFETCHT1, SHL, SHR, SUB, VADDPS, VBROADCASTSS, VCVTDQ2PS, VCVTPH2PS,
                            VFMADD231PS, VMASKMOVPS, VMOVUPS, VMULPS, VPMOVSXBD, VXORPS, YMMRegister)

from ..attention import CHUNK, FLOAT, KEY_BLOCK, PV_CHUNKS, gp, row
from ..common import tail_mask
from ..contract import KV_SEGMENT
from ..peachpy_ext import UPPER_ZMM, broadcast

from .frame import PV_CHUNKS_Q8, block_row_address, run_length, zeroed_vectors
from .scores import CACHE_LINE, ROW_B_SCORES, attended_ahead, pv_prefetch_lines


def pv_first_key(frame):
    """A P V tile's start: frame.key and frame.keys_left the key block's first key and count;
    returns a register at its first p (head 0's score row)."""
    probs, t = gp(), gp()
    MOV(probs, frame.kb_first)
    SHL(probs, 2)
    ADD(probs, frame.scores)
    MOV(t, frame.kb_first)
    ADD(t, frame.first)
    MOV(frame.key, t)
    MOV(t, frame.kb_keys)
    MOV(frame.keys_left, t)
    return probs


def pv_runs(frame, probs, chunks, key_body):
    """The key block's keys, run by run through the block table (a run: the keys of one KV
    block), ``key_body(values, stride4, scales)`` for each key: ``values`` at this tile's
    columns of the key's V row, ``stride4`` between heads' score rows (probs at the key's p),
    ``scales`` (q8_0) from the row to the tile's first scale. Each key asks for the lines
    the tile reads of the V row KEY_BLOCK keys on."""
    with Loop() as runs:
        values, run, key, keys_left, hd4, stride4 = gp(), gp(), gp(), gp(), gp(), gp()
        MOV(key, frame.key)
        MOV(keys_left, frame.keys_left)
        block_row_address(frame, key, frame.v_head, values)
        offset = gp()
        MOV(offset, frame.offset)
        scales = None
        if frame.q8:
            SHR(offset, 2)                           # out's f32 columns -> the arena's bytes
            scales = gp()                            # the tile's first scale from its first quant:
            MOV(scales, offset)                      # head_dim - quants + quants / 32 * 4
            SHR(scales, 5)
            SHL(scales, 2)
            SUB(scales, offset)
            ADD(scales, frame.head_dim)
        elif frame.half:
            SHR(offset, 1)                           # out's f32 columns -> the arena's halves
        ADD(values, offset)
        later, ahead = gp(), gp()                    # the V row KEY_BLOCK keys on
        LEA(later, [key + KEY_BLOCK])
        attended_ahead(frame, later, key)
        block_row_address(frame, later, frame.v_head, ahead)
        ADD(ahead, offset)                           # this tile's columns of that row
        if frame.q8_ahead:
            # A q8_0 segment's scores pass reads its K tiles faster than one core's memory
            # delivers them, while P V computes for longer on fewer bytes: P V asks for the
            # next segment's K tile of this key's block, a key's share of it per key: the tile
            # is KV_BLOCK shares of kd bytes, and the lines of each share's first byte and of
            # 64 bytes on cover it while kd <= 128 (head_dim <= 112; a wider tile's other
            # lines come with the scores pass's own requests).
            k_ahead = gp()
            LEA(later, [key + KV_SEGMENT])
            attended_ahead(frame, later, key)
            block_row_address(frame, later, frame.k_head, k_ahead)
        run_length(key, keys_left, run)
        ADD(key, run)
        SUB(keys_left, run)
        MOV(frame.key, key)
        MOV(frame.keys_left, keys_left)
        MOV(hd4, frame.kd)
        MOV(stride4, frame.stride4)
        with Loop() as keys:
            key_body(values, stride4, scales)
            for i in range(pv_prefetch_lines(frame, chunks)):
                PREFETCHT1([ahead + i * CACHE_LINE])
            ADD(ahead, hd4)
            if frame.q8_ahead:                       # the next segment's K tile, this key's share
                for i in range(2):
                    PREFETCHT1([k_ahead + i * CACHE_LINE])
                ADD(k_ahead, hd4)
            ADD(probs, FLOAT)
            ADD(values, hd4)
            DEC(run)
            JNZ(keys.begin)
        CMP(frame.keys_left, 0)
        JNE(runs.begin)


def pv_store(frame, records, accs, mask=None):
    """A tile's sums into the heads' partial records at ``records`` (rec4 bytes apart): stored
    by the first key block, added to what they hold by the later ones."""
    out, hd4 = gp(), gp()
    MOV(hd4, frame.rec4)
    MOV(out, records)
    ADD(out, frame.offset)
    width = CHUNK if mask is not None else frame.chunk
    accumulate = Block()
    with accumulate:
        CMP(frame.kb_first, 0)
        JE(accumulate.end)
        for h, per_head in enumerate(accs):
            for c, acc in enumerate(per_head):
                if mask is not None:
                    old = YMMRegister()
                    VMASKMOVPS(old, mask, row(out, hd4, h, c * width))
                    VADDPS(acc, acc, old)
                else:
                    VADDPS(acc, acc, row(out, hd4, h, c * width))
    for h, per_head in enumerate(accs):
        for c, acc in enumerate(per_head):
            if mask is not None:
                VMASKMOVPS(row(out, hd4, h, c * width), mask, acc)
            else:
                VMOVUPS(row(out, hd4, h, c * width), acc)


def emit_pv_tile(heads, chunks, masked, frame):
    """out[heads, offset .. offset + chunks*8) (+)= P[heads, key block] V[key block, same columns],
    the key block's V rows found run by run through the block table. The first key block
    stores, later blocks add to what out holds."""
    accs = zeroed_vectors(frame, heads, chunks)
    probs = pv_first_key(frame)
    mask = None
    if masked:
        tail = gp()
        MOV(tail, frame.tail)
        mask = YMMRegister()
        tail_mask(mask, tail)

    def key_body(values, stride4, scales):
        p = [frame.vec() for _ in range(heads)]
        if not frame.q8:
            for h in range(heads):
                VBROADCASTSS(p[h], row(probs, stride4, h))
        for c in range(chunks):
            if frame.q8:
                if c % frame.q8_chunks == 0:             # the block's scale d
                    d = frame.vec()
                    VBROADCASTSS(d, [values + scales * 1 + c // frame.q8_chunks * 4])
                    if not frame.wide:                   # AVX2: p times d, per head
                        p = [frame.vec() for _ in range(heads)]
                        for h in range(heads):
                            VBROADCASTSS(p[h], row(probs, stride4, h))
                            VMULPS(p[h], p[h], d)
                vm = frame.vec()
                VPMOVSXBD(vm, [values + c * frame.lanes])
                VCVTDQ2PS(vm, vm)
                if frame.wide:
                    # d v once per chunk, shared by the heads, then each head's p broadcast
                    # straight from its score row: 26 ops a key at head_dim 64 and 3 heads
                    # where p d per head and block took 34 (the FMA pipes run 16 zmm ops a
                    # key, not 18)
                    VMULPS(vm, vm, d)
                    for h in range(heads):
                        VFMADD231PS(accs[h][c], vm, broadcast(row(probs, stride4, h)))
                else:
                    for h in range(heads):
                        VFMADD231PS(accs[h][c], p[h], vm)
            elif frame.half:
                vm = frame.vec()
                VCVTPH2PS(vm, [values + c * frame.chunk // 2])
                for h in range(heads):
                    VFMADD231PS(accs[h][c], p[h], vm)
            elif masked:
                vm = YMMRegister()
                VMASKMOVPS(vm, mask, [values + c * CHUNK])
                for h in range(heads):
                    VFMADD231PS(accs[h][c], p[h], vm)
            else:
                for h in range(heads):
                    VFMADD231PS(accs[h][c], p[h], [values + c * frame.chunk])
    pv_runs(frame, probs, chunks, key_body)
    pv_store(frame, frame.rec_heads, accs, mask)


# P V tiles of a pair: chunks of 16 columns. Row B's heads x chunks accumulators in zmm16-31,
# then row A's in what is left of them and in the 16 others, beside each row's p of the key and
# the key's V vector: 3 heads x 4 chunks x 2 rows = 16 + 8, then 3 + 3 + 1.
PAIR_PV_CHUNKS = 4


def emit_pv_tile_pair(heads, chunks, frame):
    """emit_pv_tile for two rows at once (emit_row_pair): each V vector loaded (and widened)
    once for both rows' heads, row A's records at frame.rec_heads, row B's at
    frame.rec_heads_b. Each output column is emit_pv_tile's chain in its order (the tile's
    width changes no bit): the same bits as the row alone."""
    assert frame.pairs
    upper = iter(UPPER_ZMM)
    accs_b = [[next(upper) for _ in range(chunks)] for _ in range(heads)]
    accs = [[next(upper, None) or frame.vec() for _ in range(chunks)] for _ in range(heads)]
    for a in sum(accs + accs_b, []):
        VXORPS(a, a, a)
    probs = pv_first_key(frame)

    def key_body(values, stride4, scales):
        p = [frame.vec() for _ in range(heads)]
        p_b = [frame.vec() for _ in range(heads)]
        for h in range(heads):
            VBROADCASTSS(p[h], row(probs, stride4, h))
            VBROADCASTSS(p_b[h], row(probs, stride4, h, ROW_B_SCORES))
        for c in range(chunks):
            vm = frame.vec()
            if frame.half:
                VCVTPH2PS(vm, [values + c * frame.chunk // 2])
            else:
                VMOVUPS(vm, [values + c * frame.chunk])
            for h in range(heads):
                VFMADD231PS(accs[h][c], p[h], vm)
                VFMADD231PS(accs_b[h][c], p_b[h], vm)
    pv_runs(frame, probs, chunks, key_body)
    pv_store(frame, frame.rec_heads, accs)
    pv_store(frame, frame.rec_heads_b, accs_b)


def advance_offset(frame, chunks):
    t = gp()
    MOV(t, frame.offset)
    ADD(t, chunks * frame.chunk)
    MOV(frame.offset, t)


def emit_pv(heads, frame, pair=False):
    tile = PAIR_PV_CHUNKS if pair else (PV_CHUNKS_Q8 if frame.q8 else PV_CHUNKS)[heads]

    def emit_tile(chunks):
        if pair:
            emit_pv_tile_pair(heads, chunks, frame)
        else:
            emit_pv_tile(heads, chunks, False, frame)
    # q8_0 (head_dim % 32 == 0) leaves only whole scale blocks after the full tiles
    narrower = [c for c in range(1, tile) if not frame.q8 or c % frame.q8_chunks == 0]
    t = gp()
    MOV(frame.kb_first, 0)
    with Loop() as key_blocks:
        block_keys, limit = gp(), gp()
        MOV(block_keys, frame.n_keys)
        SUB(block_keys, frame.kb_first)
        MOV(limit, KEY_BLOCK)
        CMP(block_keys, limit)
        CMOVA(block_keys, limit)
        MOV(frame.kb_keys, block_keys)

        MOV(frame.offset, 0)
        MOV(t, frame.pass_chunks)
        MOV(frame.chunks_left, t)
        full_tiles = Loop()
        CMP(frame.chunks_left, tile)
        JB(full_tiles.end)
        with full_tiles:
            emit_tile(tile)
            advance_offset(frame, tile)
            left = gp()
            MOV(left, frame.chunks_left)
            SUB(left, tile)
            MOV(frame.chunks_left, left)
            CMP(left, tile)
            JAE(full_tiles.begin)
        remainder = Block()
        with remainder:
            for chunks in narrower:
                width = Block()
                with width:
                    CMP(frame.chunks_left, chunks)
                    JNE(width.end)
                    emit_tile(chunks)
                    advance_offset(frame, chunks)
                    JMP(remainder.end)
        if frame.arena == "f32" and not frame.wide:  # f16, q8_0, AVX-512: no tail
            masked = Block()
            with masked:
                CMP(frame.tail, 0)
                JE(masked.end)
                emit_pv_tile(heads, 1, True, frame)

        first = gp()
        MOV(first, frame.kb_first)
        ADD(first, KEY_BLOCK)
        MOV(frame.kb_first, first)
        CMP(first, frame.n_keys)
        JB(key_blocks.begin)
