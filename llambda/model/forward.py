"""The transformer forward pass on llambda's kernels, for every architecture in llambda/model/arch.py.

Reads like the math (llama2.c's ``forward``): every buffer is allocated once
in ``__init__``; ``_blocks`` and ``_head`` only call ops. What differs between
architectures (biases, Q/K norms, post norms, activation, per-layer window and
RoPE) is read from the model's Architecture and config, never asked by name.
A step is a set of rows, each a token of some sequence at some position: the
prompt chunk of a sequence being prefilled and the next token of every sequence
decoding (llambda/serving/engine.py builds steps). Every row goes through batched GEMMs
together; attention reads each row's own sequence from the paged KV cache
(llambda/serving/kv_pool.py). Every op is batch invariant, so a row's logits do not
depend on which rows share its step.

The ops go to one of two places. With the AVX2 backend, ``_blocks`` runs once
per step shape (rows, head rows; padded to a few buckets) against a
``PlanRecorder``: the kernel calls of a whole step become a plan, split across
the worker pool, that later runs with one native call per thread. Nothing is
patched between steps: tokens, positions, block tables and head rows are read
from memory when the plan runs. With the numpy backend the same code calls the
reference ops directly.
"""

import contextlib
import math

import numpy as np

from llambda.runtime import buffers, layouts
from llambda.runtime.kinds import quantized_kinds, traits
from llambda.runtime.linear import Linear
from llambda.runtime.thread_choice import ThreadChoice

from llambda.codegen.contract import KV_BLOCK

from llambda.model.arch import LM_HEAD
from llambda.serving.kv_pool import KVPool

# Rows per step (prompt tokens of a prefill chunk and decode rows): big enough for GEMM
# efficiency, small enough that the activation buffers stay in L2.
DEFAULT_BATCH = 128
# Rows per step when the blocks' weights are float (f32, f16, bf16): they are 2-4 bytes a
# weight against the quantized kinds' 0.3-1.1, and a float GEMM block waits on its weights
# from memory; twice the rows read each weight byte half as often. A gain where memory is
# slow against the FMAs, level where it is not (docs/perf-journal/2026-12-01-1413-float-models.md). Quantized models
# keep 128 rows: the larger buffers would raise their peak RSS (issue 11's part 4) for a
# smaller gain.
FLOAT_BATCH = 256
# Head rows a step can compute at least (all-logits runs go this many rows at a time)
MIN_HEAD_ROWS = 16
# A step of at least this many rows multiplies each weight byte it reads this many times:
# compute-bound, it is not tried on fewer threads while their cores are idle
# (runtime/thread_choice.py).
COMPUTE_BOUND_ROWS = 32
# Step shapes are padded up to one of these (then to the buffers' size): a plan per bucket,
# and at most a third of a step's rows wasted on padding.
BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def default_batch(layers):
    """Rows per step for these blocks (``_LayerWeights``): FLOAT_BATCH when every projection
    weight of the blocks is a float kind, DEFAULT_BATCH otherwise."""
    weights = [w for layer in layers for w in vars(layer).values() if isinstance(w, layouts.PackedWeight)]
    if weights and not any(w.kind in quantized_kinds() for w in weights):
        return FLOAT_BATCH
    return DEFAULT_BATCH


def bucket(n, limit):
    """The smallest bucket >= n, at most ``limit`` (n itself beyond the largest bucket)."""
    for b in BUCKETS:
        if b >= n:
            return min(b, limit)
    return n


# The tag the LM head's ops carry in a recorded plan (the profiler's "(LM head)" rows).
HEAD_TAG = "lm_head"
# The plan variant of a step that also leaves every row's final-norm output in ``hidden``
# (embeddings: llambda/serving/embedding.py), with h head rows beside it (0: no LM head at all).
HIDDEN = "hidden"


class TransformerModel:
    def __init__(self, config, weights, backend, n_ctx, max_batch=None, threads=None, max_seqs=1,
                 kv_blocks=None, kv_type=None, source=None):
        """source: the model file the weights are mapped from; with it, recorded plans are
        kept on disk (runtime/plan_cache.py) and read back by later loads of that file.
        max_batch: rows per step (default: ``default_batch`` of the blocks' weights)."""
        c = self.config = config
        self.source = source
        self.arch = c.architecture
        self.backend = backend
        self.n_ctx = n_ctx
        self.layers = [_LayerWeights(weights, i, self.arch.layer_tensors(c), self.arch.biases)
                       for i in range(c.n_layer)]
        if max_batch is None:
            max_batch = default_batch(self.layers)
        # rows per step: a prefill chunk and the decode rows of the running sequences
        self.max_batch = max_batch = max(1, min(max_batch, n_ctx) if max_seqs == 1 else max_batch)
        self.max_seqs = max_seqs
        # rows whose logits one step computes: one per running sequence, and the chunk's last
        self.max_heads = max_heads = min(max_batch, max(max_seqs + 1, MIN_HEAD_ROWS))
        self.embedding = weights["token_embd.weight"]
        self.lm_head = self.embedding if c.tied_embeddings else weights[LM_HEAD]
        self.output_norm = weights["output_norm.weight"]

        q_dim, kv_dim = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
        # Activations (one row per row of the current step)
        self.x = buffers.zeros((max_batch, c.dim))          # residual stream
        self.xn = buffers.zeros((max_batch, c.dim))         # normalised input of a block
        self.q = buffers.zeros((max_batch, q_dim))
        self.k = buffers.zeros((max_batch, kv_dim))
        self.v = buffers.zeros((max_batch, kv_dim))
        self.att = buffers.zeros((max_batch, q_dim))        # attention output, per head
        self.proj = buffers.zeros((max_batch, c.dim))       # block output before the residual add
        self.gate = buffers.zeros((max_batch, c.ffn_dim))
        self.up = buffers.zeros((max_batch, c.ffn_dim))
        self.xh = buffers.zeros((max_heads, c.dim))         # the rows whose logits are wanted
        self.logits = buffers.zeros((max_heads, c.vocab_size))
        # What a step is, read by the ops when they run (the engine fills them; see step()):
        self.token_ids = buffers.zeros(max_batch, np.int32)
        self.positions = buffers.zeros(max_batch, np.int32)     # each row's position in its sequence
        self.row_seq = buffers.zeros(max_batch, np.int32)       # each row's block table (kv.tables row)
        self.head_rows = buffers.zeros(max_heads, np.int32)     # the rows gathered for the LM head
        # The paged KV cache: by default room for max_seqs full contexts, and one more for the
        # direct single-sequence path (api.Model.evaluate); pages nobody touches cost no memory
        if kv_blocks is None:
            kv_blocks = (max_seqs + 1) * KVPool.blocks_for(n_ctx) + 1
        self.kv = KVPool(c, kv_blocks, max_seqs + 1, n_ctx, kv_type)
        self.att_scratch = backend.paged_attention_scratch(self.kv.max_blocks * KV_BLOCK, c.head_dim)
        # RoPE tables per layer: one pair per distinct (base, scale), e.g. Gemma's local and global
        tables = {}
        factors = _rope_factors(weights, c, n_ctx)
        for base, scale in zip(c.layer_rope_base, c.layer_rope_scale):
            if (base, scale) not in tables:
                tables[base, scale] = _rope_tables(backend, c, n_ctx, base, scale, factors)
        self.rope = [tables[key] for key in zip(c.layer_rope_base, c.layer_rope_scale)]
        self.linear = Linear(backend, max_batch, max(c.dim, c.ffn_dim, q_dim))
        self.glu = self.arch.glu_op           # act(gate) * up: "silu_mul" or "gelu_mul"

        # The plan path (AVX2): a pinned worker pool and one plan per step shape (rows, head rows).
        # The token embedding is looked up inside the plan (the kernel reads token_ids)
        # when its kind has a kernel; otherwise numpy fills x before the plan runs.
        self._embed_in_plan = backend.runs_plans and traits(self.embedding.kind).embed
        self.pool = None
        self._plans = {}
        self._plan_key_parts = self._plan_key_base = None
        self._shapes = None                   # step_shapes(), once asked
        self._storing = []                    # threads writing plans to the disk cache
        self._direct_table = None             # forward()'s own sequence, once used
        self.threads = threads if threads is not None else 1
        if backend.runs_plans:
            from llambda.runtime.pool import default_threads
            self.threads = threads if threads is not None else default_threads()
            self._plan(1, 1)        # the decode plan: built with the model, not on the first token

    def start_pool(self):
        """Start the worker pool: from the thread that will run every step (worker 0, pinned)."""
        if self.backend.runs_plans and self.pool is None:
            from llambda.runtime.pool import WorkerPool
            self.pool = WorkerPool(self.threads)
            self.thread_choice = ThreadChoice(self.threads, usage=self.pool.cpu_usage)

    def close(self):
        if self.pool is not None:
            self.pool.close()
        for storing in self._storing:        # a plan being kept is written whole before exit
            storing.join(timeout=10)
        self._storing = []

    # -- running --------------------------------------------------------------
    def step(self, m, h, hidden=False):
        """Run the step the buffers describe and return the logits of its head rows, [h, vocab].

        Rows 0..m-1: token_ids (in [0, vocab)), positions, row_seq (a kv.tables row whose
        blocks hold every position up to the row's); head_rows[:h] (each < m) pick the rows whose
        logits are wanted. A row attends to its sequence's keys up to its own position, which
        every row of the step stores first. The shape is padded to a bucket (padding rows write
        only the trash block), so plans exist for few shapes.
        ``hidden``: also leave every row's final-norm output (what llama.cpp's embeddings are
        made of) in ``self.hidden[:m]``, until the next step; h may then be 0, and the step
        runs no LM head at all."""
        if h == 0 and not hidden:
            raise ValueError("step: a step without hidden states needs at least one head row")
        mb, hb = bucket(m, self.max_batch), (bucket(h, self.max_heads) if h else 0)
        if mb > m:                  # (a decode step's numpy calls are few: they run with cold caches)
            self.token_ids[m:mb] = 0
            self.positions[m:mb] = 0
            self.row_seq[m:mb] = self.kv.pad_table
        if hb > h:
            self.head_rows[h:hb] = 0
        if not self._embed_in_plan:
            self.x[:mb] = layouts.rows(self.embedding, self.token_ids[:mb])
        if self.backend.runs_plans:
            self.start_pool()
            keys = (int(self.positions[0]) if m == 1 else int(self.positions[:m].max())) + 1
            plan = self._plan(mb, hb, self._whole_heads(mb, keys), hidden)
            self.thread_choice.run(self.pool, plan.plan, compute_bound=mb >= COMPUTE_BOUND_ROWS)
            if mb > 1 and h and self._whole_heads(1, keys + 1):
                # a prompt this long decodes on that variant next: make it now, in the prompt's
                # time, rather than in its first token's
                self._plan(1, 1, True)
        else:
            self._blocks(self.backend, self.linear, mb)
            if hidden:
                self._final_norm(self.backend, mb)
            if hb:
                self._head(self.backend, self.linear, hb)
        return self._softcapped(self.logits[:h])

    @property
    def hidden(self):
        """The final-norm output of every row of the last ``step(..., hidden=True)``, [max_batch, dim]
        (the blocks' normalised-input buffer, free once the blocks have run)."""
        return self.xn

    def forward(self, ids, pos0, all_logits=False):
        """Run tokens ``ids`` at positions pos0.. of the model's own single sequence (one KV
        table apart from the engine's; positions from pos0 on are overwritten) and return the
        logits of the last one, or of every one ([len(ids), vocab]) with ``all_logits``.
        The low-level path of api.Model.evaluate/logits, and of tests."""
        if pos0 + len(ids) > self.n_ctx:
            raise ValueError(f"positions {pos0}..{pos0 + len(ids) - 1} exceed the context of {self.n_ctx}")
        if len(ids) and (min(ids) < 0 or max(ids) >= self.embedding.n):       # the embed kernel trusts ids
            raise ValueError(f"token ids must be in [0, {self.embedding.n}), got {min(ids)}..{max(ids)}")
        if self._direct_table is None:
            opened = self.kv.open([], self.n_ctx)
            if opened is None:
                raise ValueError("the KV cache is full: no room for the model's own sequence")
            self._direct_table, self._direct_blocks = opened[0], opened[1]
        chunk = self.max_heads if all_logits else self.max_batch
        rows = []
        for at in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - at)
            self.token_ids[:n] = ids[at:at + n]
            self.positions[:n] = range(pos0 + at, pos0 + at + n)
            self.row_seq[:n] = self._direct_table
            if all_logits:
                self.head_rows[:n] = range(n)
                rows.append(self.step(n, n).copy())
            else:
                self.head_rows[0] = n - 1
                logits = self.step(n, 1)[0]
        end = pos0 + len(ids)
        self.kv.filled(self._direct_blocks[pos0 // KV_BLOCK:end // KV_BLOCK])
        return np.concatenate(rows) if all_logits else logits

    def release_direct(self):
        """Give forward()'s own sequence's table and blocks back to the KV pool (they are taken
        again, lowest first, the next time it runs): generate()'s sequences then reuse the
        same memory instead of touching more of the cache."""
        if self._direct_table is not None:
            self.kv.close(self._direct_table, self._direct_blocks)
            self._direct_table = self._direct_blocks = None

    def _softcapped(self, logits):
        """Gemma-style final soft-capping, c tanh(logits / c), in place (numpy: one row per token)."""
        cap = self.config.logit_softcap
        if cap > 0:
            np.multiply(np.tanh(logits / np.float32(cap)), np.float32(cap), out=logits)
        return logits

    def _whole_heads(self, m, keys):
        """Whether a step of ``m`` rows (padded) that see up to ``keys`` keys runs the plan whose
        attention is split by key segments alone (runtime/recorder.py whole_head_split): a
        decode step deep into a long context, where that plan reads the cache once. Other
        steps keep the plan that splits by heads too, which keeps the threads even when the
        rows see few segments."""
        from llambda.runtime.recorder import SPLIT_MAX_ROWS, whole_head_split
        return m <= SPLIT_MAX_ROWS and whole_head_split(self.threads, keys)

    def _plan(self, m, h, whole_heads=False, hidden=False):
        """The recorded plan of a step of ``m`` rows and ``h`` head rows (built once, then
        reused; read from the disk cache when an earlier process kept it); ``whole_heads``:
        its variant for rows deep into a long context (_whole_heads); ``hidden``: the variant
        that keeps every row's final-norm output (step's ``hidden``)."""
        key = (m, h) + (("whole heads",) if whole_heads else ()) + ((HIDDEN,) if hidden else ())
        if key not in self._plans:
            self._plans[key] = self._kept_plan(*key) or self._record_plan(*key)
        return self._plans[key]

    def _record_plan(self, m, h, *variant):
        from llambda.runtime.recorder import PlanRecorder
        rec = PlanRecorder(self.threads, self.kv.max_blocks * KV_BLOCK, self.backend,
                           whole_heads="whole heads" in variant)
        lin = self.linear.on(rec)
        self._blocks(rec, lin, m)
        if HIDDEN in variant:
            self._final_norm(rec, m)
        if h:
            self._head(rec, lin, h)
        rec.finish()
        if self.source is not None:
            # kept on disk by another thread (the write ends with an fsync) while the step that
            # wants the plan runs; the records are not written to again
            from llambda.runtime import plan_cache
            storing = plan_cache.store_async(self._plan_key(m, h, *variant), rec.plan, rec.ops, self._plan_buffers(),
                                             rec.scratch_buffers())
            self._storing = [t for t in self._storing if t.is_alive()] + [storing]
        return rec

    def _kept_plan(self, m, h, *variant):
        """The plan of (m, h, *variant) from the disk cache, or None."""
        if self.source is None:
            return None
        from llambda.runtime import plan_cache
        kept = plan_cache.load(self._plan_key(m, h, *variant), self._plan_buffers())
        return None if kept is None else KeptPlan(*kept)

    def _plan_key(self, m, h, *variant):
        """Everything a recorded plan depends on besides the code, library and CPU (which
        plan_cache adds): the model file, the model and its buffers' shapes, the step shape."""
        from llambda.runtime import plan_cache
        if self._plan_key_parts is None:
            import os
            st = os.stat(self.source)
            self._plan_key_parts = [os.path.realpath(self.source), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                    repr(self.config), self.n_ctx, self.max_batch, self.max_heads, self.max_seqs,
                                    self.kv.n_blocks, self.kv.kv_type, self.threads, bool(self._embed_in_plan),
                                    type(self.backend).__name__]
            self._plan_key_base = plan_cache.key_text(self._plan_key_parts)
        return " ".join([self._plan_key_base, str(m), str(h), *variant])

    def _plan_buffers(self):
        """Every buffer a plan may point into, named, in a fixed order (plan_cache's regions)."""
        named = []

        def visit(name, obj):
            if isinstance(obj, np.ndarray):
                named.append((name, obj))
            elif isinstance(obj, (list, tuple)):
                if obj and isinstance(obj[0], (int, float, str)):
                    return                       # a list of numbers (the KV pool's free lists)
                for i, item in enumerate(obj):
                    visit(f"{name}[{i}]", item)
            elif isinstance(obj, dict):
                for k, item in obj.items():
                    visit(f"{name}.{k}", item)
            elif isinstance(obj, (_LayerWeights, layouts.PackedWeight, KVPool, Linear)):
                visit(name, vars(obj))

        visit("net", {k: v for k, v in vars(self).items() if k not in ("_plans", "pool", "backend", "config")})
        return named

    def step_shapes(self):
        """Every (rows, head rows) plan shape a step of the engine can have, padded to buckets:
        m rows in all, at most max_batch, and a head row for each of up to max_seqs sequences
        (at most one per row), and (rows, head rows, "whole heads") for the variants of few rows
        that steps deep into a long context run (_whole_heads), when the context is that long."""
        shapes = {(bucket(m, self.max_batch), bucket(h, self.max_heads))
                  for m in range(1, self.max_batch + 1) for h in range(1, min(m, self.max_seqs) + 1)}
        shapes |= {(m, h, "whole heads") for m, h in shapes if self._whole_heads(m, self.n_ctx)}
        return sorted(shapes)

    def warm_plans(self, shapes=None):
        """Record the plans of ``shapes`` (default: every step shape) now, so that no request
        waits for one; returns how many were recorded."""
        if not self.backend.runs_plans:
            return 0
        todo = [s for s in (shapes if shapes is not None else self.step_shapes()) if s not in self._plans]
        for shape in todo:
            self._plan(*shape)
        return len(todo)

    def cold_shape(self):
        """A step shape whose plan is not made yet (the smallest), or None."""
        if self._shapes is None:
            self._shapes = self.step_shapes()
        return next((s for s in self._shapes if s not in self._plans), None)

    def profile(self):
        """A context in which every plan run is timed, op by op, through the normal path:

            with net.profile() as timer:    # a llambda.bench.profile.PlanTimer, standing in for the pool
                ...                         # step() as usual; timer.runs collects the stamps
        """
        if not self.backend.runs_plans:
            raise ValueError("profile: only the plan path (the AVX2 backend) runs plans to time")
        self.start_pool()
        return _Profiling(self)

    # -- the math ---------------------------------------------------------------
    def _blocks(self, be, lin, m):
        """Every transformer block over the step's m rows (their embeddings in x, or
        looked up first from token_ids when the plan does it)."""
        c, a = self.config, self.arch
        x, xn, proj = self.x[:m], self.xn[:m], self.proj[:m]
        q, k, v, att = self.q[:m], self.k[:m], self.v[:m], self.att[:m]
        gate, up = self.gate[:m], self.up[:m]
        positions, row_seq, tables = self.positions[:m], self.row_seq[:m], self.kv.tables
        if self._embed_in_plan:
            be.embed(self.embedding, self.token_ids[:m], x)
        if c.embed_scale != 1.0:
            be.scale(x, c.embed_scale, x)
        q_heads = q.reshape(m, c.n_head, c.head_dim)
        k_heads = k.reshape(m, c.n_kv_head, c.head_dim)
        v_heads = v.reshape(m, c.n_kv_head, c.head_dim)
        att_heads = att.reshape(m, c.n_head, c.head_dim)
        q_rows = q.reshape(m * c.n_head, c.head_dim)          # one row per head, for Q/K norms
        k_rows = k.reshape(m * c.n_kv_head, c.head_dim)
        glu = getattr(be, self.glu)

        for layer, L in enumerate(self.layers):
            cos, sin = self.rope[layer]
            # attention block
            be.rmsnorm(x, L.attn_norm, c.rms_eps, xn)
            lin.load(xn)
            _project(be, lin, L.attn_q, L.bias["attn_q"], q)
            _project(be, lin, L.attn_k, L.bias["attn_k"], k)
            _project(be, lin, L.attn_v, L.bias["attn_v"], v)
            if a.qk_norm:
                be.rmsnorm(q_rows, L.attn_q_norm, c.rms_eps, q_rows)
                be.rmsnorm(k_rows, L.attn_k_norm, c.rms_eps, k_rows)
            be.rope(q_heads, positions, cos, sin, c.rope_style, q_heads)
            be.rope(k_heads, positions, cos, sin, c.rope_style, k_heads)
            k_arena, v_arena = self.kv.k[layer], self.kv.v[layer]
            be.kv_store_paged(k_heads, positions, row_seq, tables, k_arena, keys=True)
            be.kv_store_paged(v_heads, positions, row_seq, tables, v_arena)
            be.attention_paged(q_heads, k_arena, v_arena, positions, row_seq, tables, c.att_scale,
                               att_heads, self.att_scratch, window=c.layer_window[layer])
            lin.load(att)
            _project(be, lin, L.attn_output, L.bias["attn_output"], proj)
            if a.post_norms:
                be.rmsnorm(proj, L.post_attention_norm, c.rms_eps, proj)
            be.add(x, proj, x)
            # feed-forward block: act(gate) * up, then down
            be.rmsnorm(x, L.ffn_norm, c.rms_eps, xn)
            lin.load(xn)
            lin.apply(L.ffn_gate, gate)
            lin.apply(L.ffn_up, up)
            glu(gate, up, gate)
            lin(gate, L.ffn_down, proj)
            if a.post_norms:
                be.rmsnorm(proj, L.post_ffw_norm, c.rms_eps, proj)
            be.add(x, proj, x)

    def _final_norm(self, be, m):
        """The final norm of all m rows, into ``hidden`` (no LM head): the hidden states that
        embeddings pool. The same op on the same row as _head's, so a row's value is the one
        the LM head reads."""
        be.rmsnorm(self.x[:m], self.output_norm, self.config.rms_eps, self.hidden[:m])

    def _head(self, be, lin, h):
        """Final norm and LM head for the h rows listed in head_rows, into self.logits[:h]."""
        c = self.config
        xh = self.xh[:h]
        be.gather_rows(self.x, self.head_rows[:h], xh)
        be.rmsnorm(xh, self.output_norm, c.rms_eps, xh)
        with be.tagged(HEAD_TAG) if hasattr(be, "tagged") else contextlib.nullcontext():
            lin(xh, self.lm_head, self.logits[:h])


class KeptPlan:
    """A plan read back from the disk cache, shaped like the PlanRecorder that recorded it
    (``.plan``, ``.ops``); it owns the attention scratch its records point at."""

    def __init__(self, plan, ops, scratch):
        self.plan, self.scratch = plan, scratch
        self._ops = ops                  # a plan_cache.LazyOps: read by the profiler only

    @property
    def ops(self):
        if not isinstance(self._ops, list):
            from llambda.runtime.recorder import OpInfo
            self._ops = [OpInfo(**info) for info in self._ops.items()]
        return self._ops


class _Profiling:
    """Puts a PlanTimer in place of the model's pool while the context is open, and runs every
    step on all the pool's threads (the profile's rows are per thread)."""

    def __init__(self, net):
        from llambda.bench.profile import PlanTimer
        self.net = net
        self.timer = PlanTimer(net.pool, self.describe)
        self.choice = net.thread_choice

    def describe(self, plan):
        """(rows, with LM head, OpInfo per op, first row's position) of a plan about to run."""
        for (m, *_), recorder in self.net._plans.items():
            if recorder.plan is plan:
                return m, True, recorder.ops, int(self.net.positions[0])
        raise ValueError("plan: not one of this model's plans")

    def __enter__(self):
        self.net.pool = self.timer
        self.net.thread_choice = ThreadChoice(self.net.threads, adaptive=False)
        return self.timer

    def __exit__(self, *exc):
        self.net.pool = self.timer.pool
        self.net.thread_choice = self.choice


class _LayerWeights:
    """The tensors of block ``i``, as attributes named by their GGUF part (``attn_q``,
    ``post_ffw_norm``, ...), and ``bias[part]``: the part's bias vector or None."""

    def __init__(self, w, i, parts, bias_parts):
        p = f"blk.{i}."
        for part in parts:
            setattr(self, part, w[p + part + ".weight"])
        self.bias = {part: w.get(p + part + ".bias") if part in bias_parts else None
                     for part in ("attn_q", "attn_k", "attn_v", "attn_output")}


def _project(be, lin, w, bias, out):
    """out = x W^T (+ bias) for the activations loaded in ``lin``."""
    lin.apply(w, out)
    if bias is not None:
        be.add_bias(out, bias, out)


def _rope_factors(weights, c, n_ctx):
    """Divisors of the RoPE frequencies, as llama.cpp picks them: Llama 3's rope_freqs,
    else Phi-3's long factors beyond the original context and its short ones within."""
    if not c.architecture.rope_factors:
        return None
    if "rope_freqs.weight" in weights:
        return weights["rope_freqs.weight"]
    name = "rope_factors_long.weight" if n_ctx > c.rope_orig_ctx else "rope_factors_short.weight"
    return weights.get(name)


def _rope_tables(backend, c, n_ctx, base, scale, factors):
    """cos/sin tables of one (base, position scale). YaRN (rope_scaling "yarn") blends
    scaled and unscaled rotation per frequency and, as llama.cpp applies it, grows the
    magnitude by 1 + 0.1 ln(factor) (for factors > 1); the metadata's attention factor
    scales it in every case."""
    yarn = c.rope_scaling == "yarn" and scale != 1.0
    magnitude = c.rope_attn_factor
    if yarn:
        magnitude *= max(1.0, 1.0 + 0.1 * math.log(1.0 / scale))
    return backend.rope_tables(n_ctx, c.head_dim, base, c.rope_style, n_rot=c.rope_dim, freq_scale=scale,
                               freq_factors=factors, magnitude=magnitude,
                               yarn_orig_ctx=c.rope_orig_ctx if yarn else 0)
