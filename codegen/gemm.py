"""Floating-point linear layer: C[m, n] = A[m, k] . W[n, k]^T on packed weight panels.

The weights come packed by runtime/layout_float.py: panels of NR = 16 weight
rows, k-major inside a panel, so one k step of a panel is 16 contiguous
weights (two ymm or one zmm of f32; f16 widened with VCVTPH2PS as it loads, bf16 by
zero-extending each to 32 bits and shifting it up 16: both exact, so a BF16 model gives
the same bits as its weights widened to f32 would).
The activations A stay as they are (row-major, any row stride): each k step
broadcasts one element of each row of the tile.

Summation order (batch invariance, DESIGN.md "Many sequences"): every output
C[i, j] is ONE chain of FMAs over k in order 0, 1, ..., k-1, starting from
+0.0, in one f32 lane. No tile splits k over several accumulators, and a k
block after the first (``accumulate`` = 1) loads the partial sums from out
and continues the same chain, so blocking changes no bit. Tile shapes, ISAs
and the row's position only change which lane and register hold the chain:
a row's result is the same bits whatever m is, wherever the row sits in its
tile, and on either kernel (tests/test_gemm.py checks all three).

With one chain per output, a tile needs enough outputs for the FMA latency
(4 cycles x 2 pipes = 8 chains in flight). A call walks the columns in
blocks of ``block_panels`` panels; inside a block the rows go in tiles, and a
tile of few rows covers several panels of the block at once so that even
m = 1 has 4 (AVX2) or 3 (AVX-512) vectors in flight on as many weight streams:

    avx2    block of 2 panels: 6-, 5-, 4-row tiles 1 panel wide (two ymm per panel,
            12 + 2 weights + 1 broadcast = 15 ymm); 3-, 2-, 1-row tiles 2 panels wide
    avx512  block of 3 panels: 8-row tiles x 3 panels = 24 zmm accumulators (zmm16-31
            named directly) + 3 weights + 2 broadcasts; 1..7-row tiles also 3 wide

Columns after the last whole block (fewer than block_panels panels, the last
possibly partial) run ymm tiles one panel wide with masked loads and stores
(the same code on both ISAs: PeachPy 2021 cannot track AVX-512 mask registers).
Rows beyond m are never computed; columns beyond ncols are never stored.

Loop order: blocks outside, row tiles inside. The first row tile streams the
block's panels from memory (software-prefetched, one PREFETCHT0 per 64-byte
line of each stream); the other tiles read them from L2.

    llb_gemm_<wtype>_f32_<tile>__<isa>(a, w, out, lda, ldo, ncols, m, kc, panel_stride, accumulate)

    a             &A[0, k0]                  f32, row stride lda elements
    w             &panel[n0 / 16][k0][0]     f32, or f16 or bf16 (as uint16), panel stride panel_stride elements
    out           &C[0, n0]                  f32, row stride ldo elements
    ncols         columns to compute from n0; m rows; kc k steps from k0
    accumulate    0: C = A . W^T over the block; 1: C += (continuing each chain)
"""
import itertools
from dataclasses import dataclass

from peachpy.x86_64 import (GeneralPurposeRegister64, YMMRegister, ZMMRegister, LOAD, Loop, Label, LABEL, RETURN,
                            LocalVariable, JA, JBE, AND, VMOVAPS, VPMOVZXWD, VPSLLD, VXORPS, VMOVUPS, VMASKMOVPS, VBROADCASTSS, VFMADD231PS, VCVTPH2PS,
                            VZEROUPPER, PREFETCHT0, PREFETCHT1, MOV, LEA, ADD, SUB, SHL, IMUL, CMP, TEST, JB, JAE, JNE, JZ, JNZ, JMP)

from .common import Kernel, function, symbol, tail_mask
from .contract import PANEL as NR
from .peachpy_ext import UPPER_ZMM, upper_zmm_function

ISAS = ("avx2", "avx512")
K_UNROLL = 4          # k steps per main-loop iteration
# Software prefetch of the weight streams, this many bytes ahead (one PREFETCHT0
# per 64-byte line). A tile reads its panels side by side, and a panel is k x 32 or 64
# bytes: 18 KiB (f16) at k = 576. Asked 16 KiB ahead, a panel's stream was prefetched
# only over its last 2 KiB, the other asks landing in the next panel behind where its own
# stream was reading; 4 KiB ahead covers most of each panel. On the Intel host
# (2026-12-06, docs/perf-journal/2026-12-01-1413-float-models.md) that took two-thread F16 decode of SmolLM2 from
# 95-99 to 112-115 tok/s and BF16's from 102-104 to 112-117, one-thread m = 16 products
# streamed from memory from 100-103 to 115-116 GFLOP/s (576x576), with prefill unchanged.
# (On Zen 5, 16 KiB had been tuned against the hardware prefetcher alone: 44 -> 53-65 GB/s
# for one stream at m = 1, with 8 KiB half-way; not re-measured here.)
PREFETCH_DISTANCE = 4096

# Bytes of one element of the weight panel, by weight type.
WEIGHT_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
WEIGHT_C_TYPE = {"f32": "const float*", "f16": "const uint16_t*", "bf16": "const uint16_t*"}
WEIGHT_TYPES = tuple(WEIGHT_BYTES)


def widen(reg, at, weight_type):
    """reg = f32 of the 2-byte weights at ``at`` (as many as reg has lanes), exactly: f16 with
    F16C; bf16 is the high half of its f32, so zero-extend to 32 bits and shift up 16."""
    if weight_type == "f16":
        VCVTPH2PS(reg, at)
    else:
        VPMOVZXWD(reg, at)
        VPSLLD(reg, reg, 16)


@dataclass(frozen=True)
class Tiling:
    """How one ISA's kernel covers a block of ``block_panels`` panels."""
    lanes: int             # f32 lanes of the vector register
    block_panels: int      # panels per column block
    full_rows: int         # rows of the main tile
    panels: dict           # rows -> panels per tile (a divisor of block_panels)

    @property
    def name(self):
        return f"{self.full_rows}x{NR * self.block_panels}"


TILINGS = {
    "avx2": Tiling(lanes=8, block_panels=2, full_rows=6, panels={6: 1, 5: 1, 4: 1, 3: 2, 2: 2, 1: 2}),
    "avx512": Tiling(lanes=16, block_panels=3, full_rows=8, panels={r: 3 for r in range(1, 9)}),
}
# the ymm tiles of the columns after the last whole block (both ISAs)
EDGE_ROWS = 6
# AVX-512 f16 and bf16 with at least this many rows: each block's weights are widened to f32 once per
# CHUNK_K k steps into a stack buffer that every row tile then reads, instead of once per
# row tile (VCVTPH2PS zmm takes two uops on the FMA ports: 3 of them beside a k step's 24
# FMAs cost a fifth of the peak). Fewer rows widen as they load (fewer tiles share a chunk).
# The chunk is long: the buffer (3 panels x CHUNK_K x 64 bytes, 192 KiB) then sits in L2 as
# the f32 panels do, and each row tile streams it whole. Short chunks that stay in L1 were
# slower at m = 512 in A/B runs (docs/perf-journal/2026-12-01-1413-float-models.md), and so was k-chunking the f32
# kernel the same way (CHUNK_F32, kept for such runs). The stack must hold the buffer.
CONVERT_MIN_ROWS = 32
CHUNK_K = 1024
# Bytes between the buffer's panels beyond their CHUNK_K x 64: without them the three panels
# start 64 KiB apart, so the convert's three stores of a k step (and the tiles' three loads)
# land in the same L1 and L2 sets. Five lines apart, F16 at m = 128 ran 2-6% faster with
# the weights in cache and 1-4% streamed from memory, in alternating A/B runs (
# docs/perf-journal/2026-12-01-1413-float-models.md).
CONVERT_PANEL_GAP = 5 * 64
CHUNK_F32 = False
# While a converted block's row tiles compute, they ask L2 for the next block's weights
# (NEXT_BLOCK_LINES lines per unrolled k step, up to the next block's end), so its
# widening finds them near instead of waiting on memory: without it every block's convert
# streamed from memory while no FMA ran. Two lines an unrolled step (4 k steps) ask for a
# 2-byte block (3 panels x k x 32 bytes) within its first 3 row tiles, of the 4 or more that
# m >= CONVERT_MIN_ROWS gives.
NEXT_BLOCK_LINES = 2

_label_ids = itertools.count()


def _unique(what):
    """A unique label name: PeachPy infers names from the source line, which
    collides when the same line emits many labels in a Python loop."""
    return f"{what}_{next(_label_ids)}"


def _label(what):
    return Label(_unique(what))


def tiling(isa):
    return TILINGS[isa]


def kernel_tile(isa):
    """The tile in the kernel's symbol: main-tile rows x block columns."""
    return TILINGS[isa].name


class RowPointers:
    """Row i of a tile at base[i // 3] + lda * (i % 3): LEA scales by 1 and 2 only."""

    def __init__(self, first_row, lda, rows):
        self.lda = lda
        self.bases = [GeneralPurposeRegister64() for _ in range(-(-rows // 3))]
        MOV(self.bases[0], first_row)
        for previous, base in zip(self.bases, self.bases[1:]):
            LEA(base, [previous + lda * 2])
            ADD(base, lda)

    def address(self, row, offset_bytes=0):
        base, step = self.bases[row // 3], row % 3
        return [base + offset_bytes] if step == 0 else [base + self.lda * step + offset_bytes]

    def advance(self, nbytes):
        for base in self.bases:
            ADD(base, nbytes)


class PanelPointers:
    """Panel p of a tile at w + stride * p (p < 3): one pointer and the panel stride, in bytes,
    in a register or (an int) a constant."""

    def __init__(self, first_panel, stride, panels, owned=False):
        assert panels <= 3
        self.stride, self.panels = stride, panels
        if owned:
            self.base = first_panel
        else:
            self.base = GeneralPurposeRegister64()
            MOV(self.base, first_panel)

    def address(self, panel, offset_bytes=0):
        if panel == 0:
            return [self.base + offset_bytes]
        if isinstance(self.stride, int):
            return [self.base + (self.stride * panel + offset_bytes)]
        return [self.base + self.stride * panel + offset_bytes]

    def advance(self, nbytes):
        ADD(self.base, nbytes)


class Source:
    """Where a tile's weights, k count and accumulate flag come from: by default the call's
    weight panels and arguments; the converted f16 path points the tiles at f32 panels on
    the stack (constant stride), with the chunk's count and flag in stack slots."""

    def __init__(self, args, weight_type, count=None, accumulate=None, panel_bytes=None, prefetch=True):
        self.args, self.weight_type = args, weight_type
        self.count, self.accumulate, self.panel_bytes, self.prefetch = count, accumulate, panel_bytes, prefetch

    def load_count(self, reg):
        LOAD.ARGUMENT(reg, self.args["kc"]) if self.count is None else MOV(reg, self.count)

    def load_accumulate(self, reg):
        LOAD.ARGUMENT(reg, self.args["accumulate"]) if self.accumulate is None else MOV(reg, self.accumulate)

    def panel_stride(self):
        """The panel stride in bytes: a constant, or a register holding it."""
        if self.panel_bytes is not None:
            return self.panel_bytes
        stride = GeneralPurposeRegister64()
        LOAD.ARGUMENT(stride, self.args["panel_stride"])
        SHL(stride, WEIGHT_BYTES[self.weight_type].bit_length() - 1)      # elements -> bytes
        return stride


def load_weights(regs, address, weight_type, lanes):
    """The 16 weights of one k step of one panel, as f32, into ``regs`` (16 / lanes vectors)."""
    esize = WEIGHT_BYTES[weight_type]
    for half, reg in enumerate(regs):
        at = list(address)
        at[0] = at[0] + half * lanes * esize
        if weight_type == "f32":
            VMOVUPS(reg, at)
        else:
            widen(reg, at, weight_type)


def emit_k_loop(acc, a_rows, panels, count, weight_type, lanes, prefetch=True, ahead=None):
    """acc[row][panel][half] += A[row, k] * W[panel, k, half] for ``count`` k steps, k in order.
    ``ahead``: a NextBlock whose lines each unrolled step asks L2 for."""
    rows, n_panels, halves = len(acc), len(acc[0]), len(acc[0][0])
    esize = WEIGHT_BYTES[weight_type]
    step_bytes = NR * esize
    vector = YMMRegister if lanes == 8 else ZMMRegister

    if lanes == 8:
        # per panel: its two weight vectors, then every row's broadcast (15 ymm at most)
        w_regs = [vector() for _ in range(halves)]
        a_bcast = vector()

        def k_step(u):
            for p in range(n_panels):
                if prefetch and (u * step_bytes) % 64 == 0:
                    PREFETCHT0(panels.address(p, PREFETCH_DISTANCE + u * step_bytes))
                load_weights(w_regs, panels.address(p, u * step_bytes), weight_type, lanes)
                for row in range(rows):
                    VBROADCASTSS(a_bcast, a_rows.address(row, 4 * u))
                    for h in range(halves):
                        VFMADD231PS(acc[row][p][h], w_regs[h], a_bcast)
    else:
        # every panel's weights, then each row's broadcast against all of them
        w_regs = [vector() for _ in range(n_panels)]
        a_bcasts = [vector(), vector()]

        def k_step(u):
            for p in range(n_panels):
                if prefetch and (u * step_bytes) % 64 == 0:
                    PREFETCHT0(panels.address(p, PREFETCH_DISTANCE + u * step_bytes))
                load_weights([w_regs[p]], panels.address(p, u * step_bytes), weight_type, lanes)
            for row in range(rows):
                bcast = a_bcasts[row % 2]
                VBROADCASTSS(bcast, a_rows.address(row, 4 * u))
                for p in range(n_panels):
                    VFMADD231PS(acc[row][p][0], w_regs[p], bcast)

    def advance(steps):
        a_rows.advance(4 * steps)
        panels.advance(step_bytes * steps)

    if ahead is None:
        emit_k_loops(count, k_step, advance, "k")
        return
    pointer = GeneralPurposeRegister64()
    MOV(pointer, ahead.at)

    def k_step_asking(u):
        if u == 0:
            ahead.ask(pointer)
        k_step(u)

    emit_k_loops(count, k_step_asking, advance, "k")
    MOV(ahead.at, pointer)


def emit_k_loops(count, k_step, advance, name):
    """``count`` k steps in k order: K_UNROLL at a time (``k_step(u)`` for u < K_UNROLL,
    then ``advance(K_UNROLL)``), then one at a time; ``count`` is consumed."""
    unrolled = Loop(_unique(f"{name}_unrolled"))
    CMP(count, K_UNROLL)
    JB(unrolled.end)
    with unrolled:
        for u in range(K_UNROLL):
            k_step(u)
        advance(K_UNROLL)
        SUB(count, K_UNROLL)
        CMP(count, K_UNROLL)
        JAE(unrolled.begin)

    single = Loop(_unique(f"{name}_single"))
    TEST(count, count)
    JZ(single.end)
    with single:
        k_step(0)
        advance(1)
        SUB(count, 1)
        JNZ(single.begin)


def out_vector_address(outs, row, panel, half, lanes, column_bytes):
    return outs.address(row, column_bytes + panel * NR * 4 + half * lanes * 4)


def out_vectors(acc, outs, lanes, column_bytes):
    """(accumulator, its vector of out, its half) for every accumulator of the tile, in order."""
    for row, per_panel in enumerate(acc):
        for p, halves in enumerate(per_panel):
            for h, reg in enumerate(halves):
                yield reg, out_vector_address(outs, row, p, h, lanes, column_bytes), h


def emit_init(acc, outs, src, lanes, column_bytes, masks=None):
    """acc = 0, or (accumulate) the partial sums in out; masked lanes load 0."""
    accumulate = GeneralPurposeRegister64()
    src.load_accumulate(accumulate)
    zero, done = _label("init_zero"), _label("init_done")
    TEST(accumulate, accumulate)
    JZ(zero)
    for reg, at, h in out_vectors(acc, outs, lanes, column_bytes):
        if masks is None:
            VMOVUPS(reg, at)
        else:
            VMASKMOVPS(reg, masks[h], at)
    JMP(done)
    LABEL(zero)
    for reg in (r for per_panel in acc for halves in per_panel for r in halves):
        VXORPS(reg, reg, reg)
    LABEL(done)


def emit_store(acc, outs, lanes, column_bytes, masks=None):
    for reg, at, h in out_vectors(acc, outs, lanes, column_bytes):
        if masks is None:
            VMOVUPS(at, reg)
        else:
            VMASKMOVPS(at, masks[h], reg)


def make_accumulators(rows, n_panels, lanes):
    halves = NR // lanes
    if lanes == 8:
        return [[[YMMRegister() for _ in range(halves)] for _ in range(n_panels)] for _ in range(rows)]
    upper = iter(UPPER_ZMM)
    return [[[next(upper, None) or ZMMRegister()] for _ in range(n_panels)] for _ in range(rows)]


def emit_tile(rows, n_panels, lanes, a_row, w_panel, out_row, g, src, masks=None,
              column_bytes=0, owns_w_panel=False, prefetch=True, ahead=None):
    """One tile: rows x n_panels panels over the call's k block (init, k loop, store), at
    ``column_bytes`` right of out_row; ``masks()`` emits the two ymm lane masks of an edge
    tile; ``owns_w_panel``: advance w_panel itself along k; ``ahead``: see emit_k_loop."""
    acc = make_accumulators(rows, n_panels, lanes)
    outs = RowPointers(out_row, g.ldo, rows)
    emit_init(acc, outs, src, lanes, column_bytes, masks and masks())
    a_rows = RowPointers(a_row, g.lda, rows)
    stride = src.panel_stride() if n_panels > 1 else None
    panels = PanelPointers(w_panel, stride, n_panels, owned=owns_w_panel)
    count = GeneralPurposeRegister64()
    src.load_count(count)
    emit_k_loop(acc, a_rows, panels, count, src.weight_type, lanes, src.prefetch and prefetch, ahead)
    outs = RowPointers(out_row, g.ldo, rows)
    emit_store(acc, outs, lanes, column_bytes, masks and masks())


def advance_rows(pointer, stride, rows):
    """pointer += rows * stride (LEA scales by 2, then one ADD, per 3 rows; the rest one ADD each)."""
    for _ in range(rows // 3):
        LEA(pointer, [pointer + stride * 2])
        ADD(pointer, stride)
    for _ in range(rows % 3):
        ADD(pointer, stride)


class Globals:
    """What a whole call keeps: pointers to the current column block, strides in bytes. With
    a stack frame (which takes rbp), A and out wait in stack slots to spare two registers."""

    def __init__(self, in_frame=False):
        self.a, self.out = (LocalVariable(8) if in_frame else GeneralPurposeRegister64() for _ in range(2))
        self.w, self.lda, self.ldo, self.ncols_left = (GeneralPurposeRegister64() for _ in range(4))

    def load(self, args):
        for name in ("a", "w", "out", "lda", "ldo", "ncols"):
            target = getattr(self, "ncols_left" if name == "ncols" else name)
            if isinstance(target, LocalVariable):
                reg = GeneralPurposeRegister64()
                LOAD.ARGUMENT(reg, args[name])
                MOV(target, reg)
            else:
                LOAD.ARGUMENT(target, args[name])
        SHL(self.lda, 2)
        SHL(self.ldo, 2)


def emit_rows(g, args, full_rows, emit_one, a_start=None, streams=False):
    """All rows of A against the current column block: ``full_rows``-row tiles, then the
    remainder. ``emit_one(rows, a_row, out_row)`` emits one tile; A from ``a_start``
    (default g.a). ``streams``: the first tile streams the block in from memory and the
    others find it in L2, so only the first full tile (and the remainder, which is the
    first when m < full_rows) prefetch: ``emit_one(..., prefetch=...)``."""
    a_row, out_row, m_left = GeneralPurposeRegister64(), GeneralPurposeRegister64(), GeneralPurposeRegister64()
    MOV(a_row, g.a if a_start is None else a_start)
    MOV(out_row, g.out)
    LOAD.ARGUMENT(m_left, args["m"])
    rows_done = _label("rows_done")

    def full_tile(**prefetch):
        emit_one(full_rows, a_row, out_row, **prefetch)
        advance_rows(a_row, g.lda, full_rows)
        advance_rows(out_row, g.ldo, full_rows)
        SUB(m_left, full_rows)

    full_tiles = Loop(_unique("full_tiles"))
    CMP(m_left, full_rows)
    JB(full_tiles.end)
    if streams:
        full_tile(prefetch=True)
        CMP(m_left, full_rows)
        JB(full_tiles.end)
    with full_tiles:
        full_tile(**({"prefetch": False} if streams else {}))
        CMP(m_left, full_rows)
        JAE(full_tiles.begin)

    for rows in range(full_rows - 1, 0, -1):
        not_this = _label(f"not_{rows}_rows")
        CMP(m_left, rows)
        JNE(not_this)
        emit_one(rows, a_row, out_row)
        JMP(rows_done)
        LABEL(not_this)
    LABEL(rows_done)


def emit_block(g, args, weight_type, t):
    """One whole block of t.block_panels panels."""
    esize = WEIGHT_BYTES[weight_type]
    src = Source(args, weight_type)

    def emit_one(rows, a_row, out_row, prefetch=True):
        per_tile = t.panels[rows]
        for first in range(0, t.block_panels, per_tile):
            w_panel = g.w
            if first:
                w_panel = GeneralPurposeRegister64()
                LOAD.ARGUMENT(w_panel, args["panel_stride"])
                IMUL(w_panel, w_panel, first * esize)
                ADD(w_panel, g.w)
            emit_tile(rows, per_tile, t.lanes, a_row, w_panel, out_row, g, src,
                      column_bytes=first * NR * 4, owns_w_panel=bool(first), prefetch=prefetch)

    emit_rows(g, args, t.full_rows, emit_one, streams=True)


def emit_edge_panel(g, args, weight_type):
    """One panel (the columns after the whole blocks): ymm tiles with masked loads and stores."""

    def masks():
        """The lanes of columns < ncols_left in each half (made twice a tile: no register
        is free for them during the k loop of a 6-row tile)."""
        low, high = YMMRegister(), YMMRegister()
        tail_mask(low, g.ncols_left)
        cols_in_high_half = GeneralPurposeRegister64()
        LEA(cols_in_high_half, [g.ncols_left - 8])     # <= 0 leaves the high mask empty
        tail_mask(high, cols_in_high_half)
        return [low, high]

    src = Source(args, weight_type)

    def emit_one(rows, a_row, out_row):
        emit_tile(rows, 1, 8, a_row, g.w, out_row, g, src, masks=masks)

    emit_rows(g, args, EDGE_ROWS, emit_one)


class ConvertFrame:
    """Stack slots of the k-chunked path (CONVERT_MIN_ROWS): the widened f16/bf16 chunk and
    the chunk loop's state."""

    def __init__(self, block_panels, weight_type="f16"):
        self.panel_bytes = CHUNK_K * NR * 4 + CONVERT_PANEL_GAP
        # aligned by hand: PeachPy 2021 gives an aligned LocalVariable an rbp frame and then
        # hands rbp out as a register too; f32 needs no buffer (its tiles read the panels)
        self.scratch = LocalVariable(block_panels * self.panel_bytes + 64, alignment=8) if weight_type != "f32" else None
        self.k_left, self.chunk_len, self.chunk_a, self.chunk_w, self.chunk_acc = \
            (LocalVariable(8) for _ in range(5))

    def scratch_address(self, reg):
        """reg = the buffer's first 64-byte aligned byte."""
        LEA(reg, self.scratch)
        ADD(reg, 63)
        AND(reg, -64)


class NextBlock:
    """The next block's weights, asked for while this block's tiles run: the next line to ask
    for and the block's end, in stack slots (a tile keeps the first in a register)."""

    def __init__(self):
        self.at, self.end = LocalVariable(8), LocalVariable(8)

    def start(self, g, args, block_panels, weight_type):
        """at, end = the block after g.w's (its panels follow this block's in memory), from
        this block's own start when its k is more than one chunk: the tiles of its first chunk
        then ask for the later chunks' lines too (a block is its panels, one after another)."""
        block_bytes, reg, kc = GeneralPurposeRegister64(), GeneralPurposeRegister64(), GeneralPurposeRegister64()
        LOAD.ARGUMENT(block_bytes, args["panel_stride"])
        IMUL(block_bytes, block_bytes, block_panels * WEIGHT_BYTES[weight_type])
        MOV(reg, g.w)
        LOAD.ARGUMENT(kc, args["kc"])
        several_chunks = _label("several_chunks")
        CMP(kc, CHUNK_K)
        JA(several_chunks)
        ADD(reg, block_bytes)
        LABEL(several_chunks)
        MOV(self.at, reg)
        LEA(reg, [g.w + block_bytes * 2])
        MOV(self.end, reg)

    def ask(self, pointer):
        """PREFETCHT1 NEXT_BLOCK_LINES lines at pointer (then advanced), unless past the end."""
        done = _label("next_block_asked")
        CMP(pointer, self.end)
        JAE(done)
        for line in range(NEXT_BLOCK_LINES):
            PREFETCHT1([pointer + 64 * line])
        ADD(pointer, 64 * NEXT_BLOCK_LINES)
        LABEL(done)


def emit_convert(frame, args, n_panels, count, weight_type="f16"):
    """scratch[p][kk][:] = f32(W[p][k0 + kk][:]) for kk < count (consumed), p < n_panels."""
    src, dst, stride = GeneralPurposeRegister64(), GeneralPurposeRegister64(), GeneralPurposeRegister64()
    MOV(src, frame.chunk_w)
    frame.scratch_address(dst)
    LOAD.ARGUMENT(stride, args["panel_stride"])
    SHL(stride, 1)                          # f16 elements -> bytes
    regs = [ZMMRegister() for _ in range(n_panels)]

    def panel(p, offset):
        return [src + offset] if p == 0 else [src + stride * p + offset]

    def steps(count_steps):
        for u in range(count_steps):
            for p, reg in enumerate(regs):
                if u % 2 == 0:
                    PREFETCHT0(panel(p, PREFETCH_DISTANCE + 32 * u))
                widen(reg, panel(p, 32 * u), weight_type)
                VMOVAPS([dst + (p * frame.panel_bytes + 64 * u)], reg)
        ADD(src, 32 * count_steps)
        ADD(dst, 64 * count_steps)

    pairs = Loop(_unique("convert_pairs"))
    CMP(count, 2)
    JB(pairs.end)
    with pairs:
        steps(2)
        SUB(count, 2)
        CMP(count, 2)
        JAE(pairs.begin)
    last = _label("convert_done")
    TEST(count, count)
    JZ(last)
    steps(1)
    LABEL(last)


def emit_block_converted(g, args, t, frame, weight_type="f16", ahead=None):
    """One whole block, CHUNK_K k steps at a time, every row tile running over a chunk
    before the next (continuing each chain after the first), so every row tile reuses the
    chunk's weights from cache. f16 and bf16: each chunk is first widened into the stack
    buffer that the tiles read; f32 (CHUNK_F32): the tiles read the panels in place (the
    first prefetching)."""
    converts = weight_type != "f32"
    reg = GeneralPurposeRegister64()
    LOAD.ARGUMENT(reg, args["kc"])
    MOV(frame.k_left, reg)
    MOV(reg, g.a)
    MOV(frame.chunk_a, reg)
    MOV(frame.chunk_w, g.w)
    accumulate = GeneralPurposeRegister64()
    LOAD.ARGUMENT(accumulate, args["accumulate"])
    MOV(frame.chunk_acc, accumulate)
    src = Source(args, "f32", count=frame.chunk_len, accumulate=frame.chunk_acc,
                 panel_bytes=frame.panel_bytes if converts else None, prefetch=not converts)
    if ahead is not None:
        ahead.start(g, args, t.block_panels, weight_type)

    chunks = Loop(_unique("chunks"))
    with chunks:
        count, whole = GeneralPurposeRegister64(), _label("whole_chunk")
        MOV(count, frame.k_left)
        CMP(count, CHUNK_K)
        JBE(whole)
        MOV(count, CHUNK_K)
        LABEL(whole)
        MOV(frame.chunk_len, count)
        if converts:
            emit_convert(frame, args, t.block_panels, count, weight_type)

        def emit_one(rows, a_row, out_row, prefetch=True):
            panel = GeneralPurposeRegister64()
            if converts:
                frame.scratch_address(panel)
            else:
                MOV(panel, frame.chunk_w)
            emit_tile(rows, t.block_panels, t.lanes, a_row, panel, out_row, g, src, owns_w_panel=True,
                      prefetch=prefetch, ahead=ahead)

        emit_rows(g, args, t.full_rows, emit_one, a_start=frame.chunk_a, streams=not converts)
        MOV(frame.chunk_acc, 1)
        ADD(frame.chunk_a, CHUNK_K * 4)
        ADD(frame.chunk_w, CHUNK_K * NR * WEIGHT_BYTES[weight_type])
        SUB(frame.k_left, CHUNK_K)
        JA(chunks.begin)


def advance_panels(g, args, weight_type, panels):
    stride = GeneralPurposeRegister64()
    LOAD.ARGUMENT(stride, args["panel_stride"])
    IMUL(stride, stride, panels * WEIGHT_BYTES[weight_type])
    ADD(g.w, stride)
    ADD(g.out, panels * NR * 4)
    SUB(g.ncols_left, panels * NR)


SIGNATURE_TAIL = [("out", "float*"), ("lda", "size_t"), ("ldo", "size_t"), ("ncols", "size_t"),
                  ("m", "size_t"), ("kc", "size_t"), ("panel_stride", "size_t"), ("accumulate", "size_t")]


def emit_gemm(isa, weight_type):
    t = TILINGS[isa]
    sig = [("a", "const float*"), ("w", WEIGHT_C_TYPE[weight_type])] + SIGNATURE_TAIL
    open_function = function if isa == "avx2" else upper_zmm_function
    fn, arguments = open_function(symbol("gemm", f"{weight_type}_f32", t.name, isa), sig, isa)
    args = dict(zip((name for name, _ in sig), arguments))
    with fn:
        # The first six arguments live in registers for the whole call; the
        # rest are re-read from the stack where needed (GP registers are short).
        converts = isa == "avx512" and (weight_type != "f32" or CHUNK_F32)
        frame = ConvertFrame(t.block_panels, weight_type) if converts else None
        ahead = NextBlock() if converts and NEXT_BLOCK_LINES else None
        g = Globals(in_frame=converts)
        g.load(args)
        block_columns = t.block_panels * NR
        blocks = Loop(_unique("blocks"))
        CMP(g.ncols_left, block_columns)
        JB(blocks.end)
        with blocks:
            if converts:
                few_rows, block_done = _label("few_rows"), _label("block_done")
                m = GeneralPurposeRegister64()
                LOAD.ARGUMENT(m, args["m"])
                CMP(m, CONVERT_MIN_ROWS)
                JB(few_rows)
                emit_block_converted(g, args, t, frame, weight_type, ahead)
                JMP(block_done)
                LABEL(few_rows)
            emit_block(g, args, weight_type, t)
            if converts:
                LABEL(block_done)
            advance_panels(g, args, weight_type, t.block_panels)
            CMP(g.ncols_left, block_columns)
            JAE(blocks.begin)

        edge = Loop(_unique("edge_panels"))
        TEST(g.ncols_left, g.ncols_left)
        JZ(edge.end)
        with edge:
            emit_edge_panel(g, args, weight_type)
            CMP(g.ncols_left, NR)
            JB(edge.end)
            advance_panels(g, args, weight_type, 1)
            TEST(g.ncols_left, g.ncols_left)
            JNE(edge.begin)
        VZEROUPPER()    # PeachPy does not add it; SSE code after us must not pay for dirty upper halves
        RETURN()
    return Kernel(fn, "gemm", isa, tile=t.name, args=sig)


def emit(isa):
    return [emit_gemm(isa, weight_type) for weight_type in WEIGHT_TYPES]
