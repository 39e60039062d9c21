"""A backend that records kernel calls into a Plan instead of making them.

Model code runs its forward pass once against a ``PlanRecorder``: every op
(``rmsnorm``, ``qgemm``, ``attention``, ...) is validated by its binding's
``*_call`` twin, split across the pool's threads, and appended to a
``runtime.plan.Plan``. Running the plan then costs one native call per thread.

Splits: matrix products by output columns (16 at a time: one 64-byte line of
f32), attention by heads and rows, or for a decode step by heads and key segments
(then a combine op; each chunk with its own scratch), row-wise ops by
rows, elementwise ops by elements. A split op is a dynamic op of a few chunks
per thread (runtime/plan.py): whichever thread is free claims the next chunk,
so a thread that another process keeps off its core costs the others at most
the chunk it holds. Ops too small to be worth splitting are one chunk, run by
whichever thread gets there first. A chunk runs the same kernel over the same
k order whoever claims it, and chunks split by output columns (or rows, heads,
elements) only: a value never depends on the chunking or on the thread.

Barriers are placed where data flows, not after every op: the recorder
tracks the memory each op reads and writes since the last barrier and puts a
barrier before an op that reads what another may still be writing, or writes
what another may still be reading. Q, K and V projections of the same input,
for example, run back to back without one.

Every op that indexes reads its indices from memory when it runs (rope, the paged
KV cache's ``kv_store_paged`` and ``attention_paged`` read positions, sequences and
block tables; embed the token ids; ``gather_rows`` the head rows), so a plan serves
any step of its shape and its records are never patched.
"""
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from . import library
from .native import embed as n_embed
from .native import elementwise as n_elementwise
from .native import gemm as n_gemm
from .native import gemm_bf16 as n_bf16
from .native import paged as n_paged
from .native import quant as n_quant
from .native._lib import index_range
from .plan import Plan, chunk_ranges
from ..codegen.contract import kv_partial_floats, kv_segments

LINE = 16                 # f32 per 64-byte cache line: the unit of every split
MIN_SPLIT_ELEMENTS = 4096  # elementwise ops smaller than this are one chunk
# A split op's chunks per thread: enough for a free thread to take over a busy one's share,
# few enough that claiming them costs little. Long ops (prefill products, the LM head) get
# more: their chunks are long anyway, and finer ones even out a ragged end.
CHUNKS_PER_THREAD = 4
CHUNKS_PER_THREAD_LONG = 8
LONG_OP_FLOPS = 8e6       # an op with more work than either of these is long
LONG_OP_BYTES = 2e6
SPLIT_MAX_ROWS = 4        # attention of steps up to this many rows is split over key segments too
SPLIT_CHUNKS_PER_THREAD = 8   # chunks of (heads, segments) per thread
# A long context's split attention: chunks of every head, by key segments alone, this many per
# thread. (Measured when a KV block held its KV heads' tiles side by side: a core's prefetchers
# fetched past the tile a chunk of one KV head read into its neighbours', which that core never
# used, so two threads reading one KV head each read the cache two to three times over. The
# pool now keeps a KV head's blocks together, llambda/serving/kv_pool.py; segments still even out the
# threads where a model's KV heads do not divide among them.)
WHOLE_HEAD_CHUNKS_PER_THREAD = 2


def whole_head_split(n_threads, keys):
    """Whether a step of at most SPLIT_MAX_ROWS rows that see up to ``keys`` keys has enough
    key segments to split attention by segments alone, every chunk all the heads, and keep
    the threads even: model.py picks such a step's plan (recorded with ``whole_heads``) by it."""
    return n_threads > 1 and kv_segments(keys) >= WHOLE_HEAD_CHUNKS_PER_THREAD * n_threads


class Split:
    """A split op not yet cut into chunks: ``_add`` cuts it into a few chunks per thread,
    more for a long op, so that each chunk's call is made (and validated) once.
    ``make_calls``: ranges -> their calls, when the binding validates once for many."""

    def __init__(self, recorder, n, multiple, make_call, min_size, make_calls=None):
        self.recorder, self.n, self.multiple, self.min_size = recorder, n, multiple, min_size
        self.make_calls = make_calls or (lambda ranges: [make_call(r) for r in ranges])

    def chunked(self, per_thread):
        return Chunked(self.make_calls(self.recorder._chunk_ranges(self.n, self.multiple, self.min_size, per_thread)))


class Chunked(list):
    """The calls of a dynamic op, one ``(symbol, args)`` per chunk; ``writes``: more
    memory its chunks write (each chunk's own scratch), for placing barriers."""

    def __init__(self, calls, writes=()):
        super().__init__(calls)
        self.writes = list(writes)


@dataclass
class OpInfo:
    """What the profiler reports about one op of a plan."""
    name: str
    flops: float = 0.0
    bytes: float = 0.0
    window: int = 0        # attention: its sliding window (0: unlimited), for costing it at another pos0
    symbol: str = ""       # the kernel it calls (ISA and tile in the name); threads calling others: " + "-joined
    tag: str = ""          # what the model recorded it as, when it said (see PlanRecorder.tagged)
    kv_row_bytes: int = 0  # attention: bytes of one KV head's K (or V) row in its arena's type


def _interval(a):
    start = a.__array_interface__["data"][0]
    return start, start + a.nbytes


class PlanRecorder:
    """Backend-shaped: record ``op(...)`` calls into ``self.plan`` for ``n_threads``."""

    def __init__(self, n_threads, n_ctx, backend, whole_heads=False):
        """``whole_heads``: split attention of steps of few rows (decode) by key segments alone
        wherever the tables hold enough of them (whole_head_split): the plan of steps whose
        rows see that many keys. Without it, such attention is split by heads and segments,
        which keeps the threads even at any context."""
        self.n_threads = n_threads
        self._whole_heads = whole_heads
        self.plan = Plan(n_threads)
        self.ops = []                      # OpInfo per op handle
        self._manifest = library.load().manifest
        self._pending_reads, self._pending_writes = [], []
        self._n_ctx, self._backend = n_ctx, backend
        self._scratch = []                 # attention scratch per chunk index, made when first needed
        self._keep = []                    # every scratch a recorded call points at
        self._partial_buffers = {}         # split attention's partial records, by shape
        self._tag = ""

    @contextmanager
    def tagged(self, tag):
        """Ops recorded inside ``with recorder.tagged("lm_head"):`` carry that tag in
        their OpInfo, so the profiler tells them apart without guessing from the order."""
        outer, self._tag = self._tag, tag
        try:
            yield self
        finally:
            self._tag = outer

    # -- recording ----------------------------------------------------------
    def _add(self, calls, reads, writes, info):
        """Append one op: ``calls`` is a Split or a Chunked (a dynamic op), or one
        ``(symbol, args)`` per thread (None: idle)."""
        if isinstance(calls, Split):
            calls = calls.chunked(CHUNKS_PER_THREAD_LONG if info.flops > LONG_OP_FLOPS or info.bytes > LONG_OP_BYTES
                                  else CHUNKS_PER_THREAD)
        reads = [_interval(a) for a in reads]
        writes = [_interval(a) for a in writes + getattr(calls, "writes", [])]
        if self.plan.n_ops and (_overlaps(reads, self._pending_writes)
                                or _overlaps(writes, self._pending_writes + self._pending_reads)):
            self.plan.set_barrier(self.plan.n_ops - 1)
            self._pending_reads, self._pending_writes = [], []
        symbol, first_args = next(c for c in calls if c is not None)
        symbols = dict.fromkeys(c[0] for c in calls if c is not None)
        info.symbol = " + ".join(symbols)
        info.tag = self._tag
        kinds = [ctype for _, ctype in self._manifest[symbol]["args"]]
        floats = [a for a, k in zip(first_args, kinds) if k == "float"]
        ints = [None if c is None else [a for a, k in zip(c[1], kinds) if k != "float"] for c in calls]
        if isinstance(calls, Chunked):
            handle = self.plan.add(symbol, float_args=floats, chunks=ints, barrier=False)
        else:
            handle = self.plan.add(symbol, float_args=floats, per_thread=ints, barrier=False)
        self._pending_reads += reads
        self._pending_writes += writes
        self.ops.append(info)
        return handle

    def _serial(self, call):
        """One chunk: whichever thread comes first runs it."""
        return Chunked([call])

    def _split(self, n, multiple, make_call, min_size=0, per_thread=None, make_calls=None):
        """Chunks of ``[0, n)`` whose starts are multiples of ``multiple``, one chunk when small:
        ``per_thread`` per thread, or (None) as many as ``_add`` finds right for the op."""
        split = Split(self, n, multiple, make_call, min_size, make_calls)
        return split if per_thread is None else split.chunked(per_thread)

    def _chunk_ranges(self, n, multiple, min_size=0, per_thread=CHUNKS_PER_THREAD):
        if self.n_threads == 1 or n < max(min_size, 2 * multiple):
            return [(0, n)]
        units = -(-n // multiple)
        n_chunks = min(units, per_thread * self.n_threads)
        return chunk_ranges(n, -(-units // n_chunks) * multiple, multiple)

    def finish(self):
        """Close the plan: the executor ends every plan with a barrier anyway."""
        if self.plan.n_ops:
            self.plan.set_barrier(self.plan.n_ops - 1)
        return self

    # -- the ops (same signatures as the backends) ------------------------------
    def embed(self, w, ids, out):
        m = ids.shape[0]
        calls = self._split(m, 1, lambda r: n_embed.embed_call(w, ids, out, rows=r), min_size=8)
        self._add(calls, [*w.arrays.values(), ids], [out],
                  OpInfo("embed", 2.0 * out.size, w.nbytes * m / w.n + 4.0 * out.size))

    def rmsnorm(self, x, w, eps, out):
        rows, d = int(np.prod(x.shape[:-1])), x.shape[-1]
        calls = self._split(rows, 1, None, 8, make_calls=lambda rs: n_elementwise.rmsnorm_calls(x, w, eps, out, rs))
        self._add(calls, [x, w], [out], OpInfo("rmsnorm", 3.0 * rows * d, 8.0 * rows * d))

    def add(self, a, b, out):
        calls = self._split(a.size, LINE, None, MIN_SPLIT_ELEMENTS,
                            make_calls=lambda s: n_elementwise.add_calls(a, b, out, s))
        self._add(calls, [a, b], [out], OpInfo("add", a.size, 12.0 * a.size))

    def silu_mul(self, gate, up, out):
        calls = self._split(gate.size, LINE, None, MIN_SPLIT_ELEMENTS,
                            make_calls=lambda s: n_elementwise.silu_mul_calls(gate, up, out, s))
        self._add(calls, [gate, up], [out], OpInfo("silu_mul", 6.0 * gate.size, 12.0 * gate.size))

    def gelu_mul(self, gate, up, out):
        calls = self._split(gate.size, LINE, None, MIN_SPLIT_ELEMENTS,
                            make_calls=lambda s: n_elementwise.gelu_mul_calls(gate, up, out, s))
        self._add(calls, [gate, up], [out], OpInfo("gelu_mul", 10.0 * gate.size, 12.0 * gate.size))

    def scale(self, x, s, out):
        calls = self._split(x.size, LINE, None, MIN_SPLIT_ELEMENTS,
                            make_calls=lambda sp: n_elementwise.scale_calls(x, s, out, sp))
        self._add(calls, [x], [out], OpInfo("scale", x.size, 8.0 * x.size))

    def add_bias(self, x, bias, out):
        rows, n = int(np.prod(x.shape[:-1])), x.shape[-1]
        calls = self._split(rows, 1, None, 8, make_calls=lambda rs: n_elementwise.add_bias_calls(x, bias, out, rs))
        self._add(calls, [x, bias], [out], OpInfo("add_bias", rows * n, 8.0 * rows * n + 4.0 * n))

    def rope(self, x, positions, cos, sin, style, out):
        m = x.shape[0]
        calls = self._split(m, 1, None, 8,
                            make_calls=lambda rs: n_elementwise.rope_calls(x, positions, cos, sin, style, out, rs))
        self._add(calls, [x, positions, cos, sin], [out], OpInfo("rope", 3.0 * x.size, 16.0 * x.size))

    # -- the paged KV cache: indices read from memory when the plan runs, nothing to patch --
    def kv_store_paged(self, src, positions, row_seq, tables, arena, heads=None, keys=False):
        """Split by KV heads (each thread stores its heads of every row, rows in order)."""
        m, n_kv, hd = src.shape
        h0, h1 = index_range("heads", heads, n_kv, labels=("h0", "h1"), limit=f"n_kv={n_kv}")
        calls = self._split(h1 - h0, 1, lambda h: n_paged.kv_store_paged_call(
            src, positions, row_seq, tables, arena, heads=(h0 + h[0], h0 + h[1]), keys=keys),
            min_size=64 if m < 8 else 0)
        self._add(calls, [src, positions, row_seq, tables], [arena],
                  OpInfo("key_store" if keys else "kv_store", 0, 8.0 * m * (h1 - h0) * hd))

    def attention_paged(self, q, k_arena, v_arena, positions, row_seq, tables, scale, out, scratch,
                        heads=None, window=0):
        """``scratch`` is ignored (each chunk has its own, sized for the tables and window).
        Chunks keep whole groups of query heads sharing a KV head, so each K and V row is read
        once per group. A step of few rows (decode) is split over keys too: chunks of
        (heads, segments s = seg0 mod step) write partial records to the recorder's buffer,
        and a combine op merges each row's segments in segment order; more rows are chunked
        by (rows, heads) and each call combines its own. Both give the same bits (the
        kernel's segments and combine do not depend on the split). With ``whole_heads`` and
        tables long enough, a decode step's chunks are key segments alone, every head in each
        (whole_head_split). The cost is estimated at full tables."""
        m, n_head, hd = q.shape
        h0, h1 = index_range("heads", heads, n_head, labels=("h0", "h1"), limit=f"n_head={n_head}")
        max_keys = n_paged.most_keys(tables, window) if isinstance(tables, np.ndarray) and tables.ndim == 2 else 1
        n_kv = k_arena.shape[1] if isinstance(k_arena, np.ndarray) and k_arena.ndim == 4 else 1
        group = n_head // n_kv if n_kv and n_head % n_kv == 0 else 1
        multiple = group if h0 % group == 0 and (h1 - h0) % group == 0 else 1
        head_ranges = self._chunk_ranges(h1 - h0, multiple)
        segments = kv_segments(max_keys)
        split = self.n_threads > 1 and m <= SPLIT_MAX_ROWS and segments > 1
        wanted = CHUNKS_PER_THREAD * self.n_threads
        if split and self._whole_heads and whole_head_split(self.n_threads, max_keys):
            step = WHOLE_HEAD_CHUNKS_PER_THREAD * self.n_threads
            parts = [dict(heads=(h0, h1), segments=(s, step)) for s in range(step)]
        elif split:
            # residues first: the low ones hold a segment more when step does not divide the
            # row's segments, and are claimed first, so the threads end together
            step = min(segments, -(-SPLIT_CHUNKS_PER_THREAD * self.n_threads // len(head_ranges)))
            parts = [dict(heads=(h0 + a, h0 + b), segments=(s, step)) for s in range(step) for (a, b) in head_ranges]
        else:
            # a prompt chunk's later rows see more keys: finer row chunks, the later first, so
            # the threads claiming them in order end together
            wanted = CHUNKS_PER_THREAD_LONG * self.n_threads
            row_chunks = min(m, -(-wanted // len(head_ranges))) if self.n_threads > 1 and m >= 8 else 1
            row_ranges = chunk_ranges(m, -(-m // row_chunks), 1) if row_chunks > 1 else [(0, m)]
            parts = [dict(heads=(h0 + a, h0 + b), rows=r) for r in reversed(row_ranges) for (a, b) in head_ranges]
        need = n_paged.scratch_floats(max(max_keys, 1), hd)
        for c in range(len(parts)):
            if c == len(self._scratch):
                self._scratch.append(None)
            if self._scratch[c] is None or self._scratch[c].size < need:
                self._scratch[c] = n_paged.paged_attention_scratch(max(max_keys, self._n_ctx, 1), max(hd, 1))
                self._keep.append(self._scratch[c])
        scratches = self._scratch[:len(parts)]
        partials = self._partials(m, n_head, hd, tables) if split else None
        extra = dict(partials=partials) if split else {}
        calls = Chunked((n_paged.attention_paged_call(q, k_arena, v_arena, positions, row_seq, tables, scale, out,
                                                      scratches[c], window=window, **part, **extra)
                         for c, part in enumerate(parts)), writes=scratches + ([partials] if split else []))
        keys = min(max_keys, self._n_ctx)
        kv_heads = -(-(h1 - h0) // group)
        row_bytes = k_arena.strides[2] if isinstance(k_arena, np.ndarray) and k_arena.ndim == 4 else 4 * hd
        # each row reads its keys' K and V rows of its KV heads, in the arena's type
        info = OpInfo("attention", 4.0 * (h1 - h0) * hd * keys * m,
                      2.0 * kv_heads * keys * row_bytes * m, window=window, kv_row_bytes=int(row_bytes))
        self._add(calls, [q, k_arena, v_arena, positions, row_seq, tables], [] if split else [out], info)
        if split:
            combine = self._serial(n_paged.attention_combine_call(partials, positions, tables, out,
                                                                  heads=(h0, h1), window=window))
            self._add(combine, [partials, positions], [out],
                      OpInfo("attention_combine", 0,
                             4.0 * m * kv_segments(keys) * (h1 - h0) * kv_partial_floats(hd), window=window))

    def scratch_buffers(self):
        """Every scratch array the plan's records point at and the recorder owns (attention's
        score rows and split attention's partial records), flat: runtime/plan_cache.py
        allocates them again when it reads the plan back."""
        return list(self._keep) + [b.reshape(-1) for b in self._partial_buffers.values()]

    def _partials(self, m, n_head, hd, tables):
        """The partial records of split attention ops: one buffer per shape, shared by layers
        (the barriers between a layer's combine and the next layer's attention keep them apart)."""
        shape = n_paged.partial_shape(m, n_head, hd, tables)
        buffer = self._partial_buffers.get(shape)
        if buffer is None:
            buffer = self._partial_buffers[shape] = n_paged.attention_partials(m, n_head, hd, tables)
        return buffer

    def gather_rows(self, src, rows, out):
        n = rows.shape[0] if isinstance(rows, np.ndarray) and rows.ndim == 1 else 1
        calls = self._split(n, 1, lambda r: n_paged.gather_rows_call(src, rows, out, part=r), min_size=8)
        self._add(calls, [src, rows], [out], OpInfo("gather_rows", 0, 8.0 * out.size))

    def quantize_q8(self, x, qs, d, s):
        calls = self._split(x.shape[0], 8, None, 32, make_calls=lambda rs: n_quant.quantize_q8_calls(x, qs, d, s, rs))
        self._add(calls, [x], [qs, d, s], OpInfo("quantize_q8", 4.0 * x.size, 5.0 * x.size))

    def qgemm(self, qs, d, s, w, out):
        m = qs.shape[0]
        calls = self._split(w.n, LINE, None, make_calls=lambda rs: n_quant.qgemm_calls(qs, d, s, w, out, rs))
        self._add(calls, [qs, d, s, *w.arrays.values()], [out],
                  OpInfo(f"qgemm_{w.kind}", 2.0 * m * w.n * w.k, w.nbytes + qs.nbytes + 4.0 * out.size))

    def gemm_f32(self, x, w, out):
        self._gemm(n_gemm.gemm_f32_calls_ranges, "gemm_f32", x, w, out)

    def gemm_f16(self, x, w, out):
        self._gemm(n_gemm.gemm_f16_calls_ranges, "gemm_f16", x, w, out)

    def gemm_bf16(self, x, w, out):
        self._gemm(n_gemm.gemm_bf16_calls_ranges, "gemm_bf16", x, w, out)

    def round_bf16(self, x, xb):
        calls = self._split(x.shape[0], 1, None, 8, make_calls=lambda rs: n_bf16.round_bf16_calls(x, xb, rs))
        self._add(calls, [x], [xb], OpInfo("round_bf16", 3.0 * x.size, 6.0 * x.size))

    def gemm_bf16_pairs(self, xb, w, out):
        # one kernel call per column chunk (k is never blocked), split as the float kinds are
        m = xb.shape[0]
        long_op = 2.0 * m * w.n * w.k > LONG_OP_FLOPS or w.nbytes > LONG_OP_BYTES
        calls = self._split(w.n, self._column_multiple(w.n), None,
                            make_calls=lambda rs: n_bf16.gemm_bf16_pairs_calls_ranges(xb, w, out, rs),
                            per_thread=CHUNKS_PER_THREAD_LONG if long_op else CHUNKS_PER_THREAD)
        self._add(calls, [xb, *w.arrays.values()], [out],
                  OpInfo("gemm_bf16_pairs", 2.0 * m * w.n * w.k, w.nbytes + xb.nbytes + 4.0 * out.size))

    @staticmethod
    def _column_multiple(n):
        """Column chunks of whole column blocks of the float kernels when n allows."""
        if n >= 2 * n_gemm.SPLIT_COLUMNS:
            return n_gemm.SPLIT_COLUMNS
        if n >= 2 * n_gemm.SPLIT_COLUMNS_NARROW:
            return n_gemm.SPLIT_COLUMNS_NARROW
        return LINE

    def _gemm(self, make_calls, name, x, w, out):
        # A large product is several kernel calls per column range (m and k blocks), to be
        # run in order: one op each.
        # Each step a dynamic op over the same column chunks; the step order per column
        # is kept by the barriers between the steps (each writes what the last wrote).
        # Columns only (batch invariance), in whole column blocks of the kernels when n allows.
        multiple = self._column_multiple(w.n)
        long_op = 2.0 * x.shape[0] * w.n * w.k > LONG_OP_FLOPS or w.nbytes > LONG_OP_BYTES
        per_chunk = self._split(w.n, multiple, None, make_calls=lambda rs: make_calls(x, w, out, rs),
                                per_thread=CHUNKS_PER_THREAD_LONG if long_op else CHUNKS_PER_THREAD)
        steps = len(per_chunk[0])
        for step in range(steps):
            calls = Chunked(c[step] for c in per_chunk)
            self._add(calls, [x, *w.arrays.values()], [out],
                      OpInfo(name, 2.0 * x.shape[0] * w.n * w.k / steps,
                             (w.nbytes + x.nbytes + 4.0 * out.size) / steps))


def _overlaps(a, b):
    return any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)
