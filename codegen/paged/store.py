"""The paged KV cache's other kernels: ``kv_store_paged`` (this step's K/V rows into their
blocks, as f32, f16 or q8_0) and ``gather_rows`` (the rows the LM head wants)."""
from types import SimpleNamespace

from peachpy.x86_64 import (ADD, AND, DEC, IMUL, JNZ, LEA, LocalVariable, Loop, MOV, MOVZX, RETURN, SHL, SHR,
                            SUB, VCVTPS2PH, VMOVUPS, XOR, YMMRegister, byte, dword, word)

from ..attention import CHUNK, FLOAT, gp, row
from ..common import Kernel, function, stream, symbol
from ..contract import KV_BLOCK

from .frame import (ARENA_BYTES, FAMILY, GATHER_SIGNATURE, INDEX, LOG2_KV_BLOCK, ROUND_NEAREST_EVEN,
                    STORE_SIGNATURE, load_all, quantize_row, typed, unpack_tiles)


def copy_row(length, src, dst):
    """dst[0 .. length) = src[0 .. length) floats (masked tail: nothing past either row touched)."""
    count, index = gp(), gp()
    MOV(count, length)
    XOR(index.as_dword, index.as_dword)

    def step(v):
        value = YMMRegister()
        v.load(value, src)
        v.store(dst, value)
    stream(count, [index], step, 4)


def convert_row(length, src, dst):
    """dst[0 .. length) = src[0 .. length) rounded to halves (length % 8 == 0)."""
    count, from_at, to_at = gp(), gp(), gp()
    MOV(count, length)
    SHR(count, 3)
    MOV(from_at, src)
    MOV(to_at, dst)
    with Loop() as chunks:
        value = YMMRegister()
        VMOVUPS(value, [from_at])
        VCVTPS2PH([to_at], value, ROUND_NEAREST_EVEN)
        ADD(from_at, CHUNK)
        ADD(to_at, CHUNK // 2)
        DEC(count)
        JNZ(chunks.begin)


MAX_KEY_ROW_BYTES = 2048            # a key row's stack copy: f16 head_dim <= 1024 (the binding checks)


def scatter_key(head_dim, row, tile, element):
    """Copy a key row (head_dim elements of ``element`` bytes at ``row``, as the value
    layout holds it) into its lane of a key tile: element d to tile + d * KV_BLOCK * element
    (``tile`` already points at the lane). A row per store: this is not a hot loop."""
    move = {4: (dword, "as_dword"), 2: (word, "as_word"), 1: (byte, "as_low_byte")}[element]
    count, src, dst, t = gp(), gp(), gp(), gp()
    MOV(count, head_dim)
    MOV(src, row)
    MOV(dst, tile)
    with Loop() as loop:
        if element == 4:
            MOV(t.as_dword, [src])
        else:
            MOVZX(t.as_dword, move[0][src])
        MOV([dst], getattr(t, move[1]))
        ADD(src, element)
        ADD(dst, KV_BLOCK * element)
        DEC(count)
        JNZ(loop.begin)


def emit_kv_store_paged(isa, arena_type, keys=False):
    """arena[block, h, p % KV_BLOCK] = src[i, h] for rows i < m in order and heads h < n_heads,
    block = tables[row_seq[i], p / KV_BLOCK], p = positions[i]. The binding offsets src and
    arena to the first head; ``kv_heads`` = n_kv | block_tiles << 16 | head_tiles << 40
    (ARENA_TILES): src rows are n_kv heads long, and the arena's tiles are block_tiles tiles
    from one block to the next, head_tiles from one KV head to the next.

    ``keys``: the key layout (codegen/contract.py), each (block, head) a tile [head_dim]
    [KV_BLOCK] (q8_0: the quants so, then [head_dim / 32][KV_BLOCK] scales): the row is
    made as for values (the same rounding, the same quants), then put in lane p % KV_BLOCK."""
    signature = typed(STORE_SIGNATURE, arena_type, ("arena",))
    fn, args = function(symbol("key_store_paged" if keys else "kv_store_paged", arena_type, "", isa),
                        signature, isa)
    with fn:
        src, positions, row_seq, tables, arena, m, n_heads, head_dim, kv_heads, table_stride = load_all(args)
        n_kv, block_tiles, head_tiles = gp(), gp(), gp()
        unpack_tiles(kv_heads, n_kv, block_tiles, head_tiles)
        saved = SimpleNamespace(**{name: LocalVariable(8) for name in
                                   ("tables", "table_stride4", "n_heads", "block_stride", "src_stride", "m",
                                    "arena", "lane")})
        saved.row = LocalVariable(MAX_KEY_ROW_BYTES, alignment=8) if keys and arena_type != "f32" else None
        MOV(saved.tables, tables)
        MOV(saved.arena, arena)
        MOV(saved.m, m)
        MOV(saved.n_heads, n_heads)
        SHL(table_stride, 2)
        MOV(saved.table_stride4, table_stride)
        hd4, kd, head_stride = gp(), gp(), gp()
        LEA(hd4, [head_dim * FLOAT])
        if arena_type == "q8_0":                      # an arena row's bytes
            MOV(kd, head_dim)
            SHR(kd, 3)
            ADD(kd, head_dim)
        else:
            LEA(kd, [head_dim * ARENA_BYTES[arena_type]])
        MOV(head_stride, kd)
        SHL(head_stride, LOG2_KV_BLOCK)              # a tile's bytes
        IMUL(block_tiles, head_stride)
        MOV(saved.block_stride, block_tiles)
        IMUL(head_stride, head_tiles)                # from one KV head to the next
        IMUL(n_kv, hd4)                               # src row bytes: n_kv * hd4
        MOV(saved.src_stride, n_kv)
        with Loop() as rows:
            dst, position, t = gp(), gp(), gp()
            MOV(position.as_dword, [positions])
            MOV(t.as_dword, [row_seq])
            IMUL(t, saved.table_stride4)
            ADD(t, saved.tables)
            MOV(dst, position)
            SHR(dst, LOG2_KV_BLOCK)
            MOV(dst.as_dword, [t + dst * INDEX])
            IMUL(dst, saved.block_stride)
            AND(position, KV_BLOCK - 1)
            if keys:                                  # the lane's first element
                SHL(position, ARENA_BYTES[arena_type].bit_length() - 1)
            else:                                     # the row
                IMUL(position, kd)
            ADD(dst, position)
            ADD(dst, saved.arena)
            if keys:
                MOV(saved.lane, position)
            src_head, heads_left = gp(), gp()
            MOV(src_head, src)
            MOV(heads_left, saved.n_heads)
            with Loop() as heads:
                if keys:
                    emit_key_row(arena_type, head_dim, src_head, dst, saved)
                elif arena_type == "q8_0":
                    quantize_row(head_dim, src_head, dst)
                elif arena_type == "f16":
                    convert_row(head_dim, src_head, dst)
                else:
                    copy_row(head_dim, src_head, dst)
                ADD(src_head, hd4)
                ADD(dst, head_stride)
                DEC(heads_left)
                JNZ(heads.begin)
            ADD(src, saved.src_stride)
            ADD(positions, INDEX)
            ADD(row_seq, INDEX)
            SUB(saved.m, 1)
            JNZ(rows.begin)
        RETURN()
    return Kernel(fn, FAMILY, isa, tile="", args=signature)


def emit_key_row(arena_type, head_dim, src, tile_lane, saved):
    """One key row into its tile lane (``tile_lane`` = the tile + lane * element bytes)."""
    if arena_type == "f32":
        scatter_key(head_dim, src, tile_lane, 4)
        return
    row = gp()
    LEA(row, saved.row)
    if arena_type == "f16":
        convert_row(head_dim, src, row)
        scatter_key(head_dim, row, tile_lane, 2)
        return
    quantize_row(head_dim, src, row)
    scatter_key(head_dim, row, tile_lane, 1)
    # the scales: [head_dim / 32][KV_BLOCK] f32 after the tile's quants
    count, scales, t = gp(), gp(), gp()
    ADD(row, head_dim)                               # row still points at the stack copy
    MOV(scales, head_dim)
    SHL(scales, LOG2_KV_BLOCK)
    ADD(scales, tile_lane)
    SUB(scales, saved.lane)                          # the tile's first byte
    MOV(t, saved.lane)
    LEA(scales, [scales + t * FLOAT])
    MOV(count, head_dim)
    SHR(count, 5)
    with Loop() as loop:
        MOV(t.as_dword, [row])
        MOV([scales], t.as_dword)
        ADD(row, FLOAT)
        ADD(scales, KV_BLOCK * FLOAT)
        DEC(count)
        JNZ(loop.begin)


def emit_gather_rows(isa):
    """out[r] = src[rows[r]] for r < n_rows, rows of d floats."""
    fn, args = function(symbol("gather_rows", "f32", "", isa), GATHER_SIGNATURE, isa)
    with fn:
        src, rows, out, n_rows, d = load_all(args)
        d4 = gp()
        LEA(d4, [d * FLOAT])
        with Loop() as loop:
            from_row = gp()
            MOV(from_row.as_dword, [rows])
            IMUL(from_row, d4)
            ADD(from_row, src)
            copy_row(d, from_row, out)
            ADD(out, d4)
            ADD(rows, INDEX)
            DEC(n_rows)
            JNZ(loop.begin)
        RETURN()
    return Kernel(fn, FAMILY, isa, tile="", args=GATHER_SIGNATURE)
