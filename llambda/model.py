"""The LLaMA forward pass on llambda's kernels.

Reads like the math (llama2.c's ``forward``): every buffer is allocated once
in ``__init__``; ``_blocks`` and ``_head`` only call ops. Prefill runs a whole
chunk of prompt tokens through batched GEMMs; decode is the same code with
m = 1.

The ops go to one of two places. With the AVX2 backend, ``_blocks`` runs once
per chunk size against a ``PlanRecorder``: the kernel calls of a whole chunk
become a plan, split across the worker pool, that later runs with one native
call per thread (only the position is patched between tokens). With the numpy
backend the same code calls the reference ops directly.
"""

import numpy as np

from llambda.runtime import buffers, layouts
from llambda.runtime.kinds import traits
from llambda.runtime.linear import Linear

# Prompt tokens per prefill chunk: big enough for GEMM efficiency, small
# enough that the activation buffers stay in L2.
DEFAULT_BATCH = 128


class LlamaModel:
    def __init__(self, config, weights, backend, n_ctx, max_batch=DEFAULT_BATCH, threads=None):
        c = self.config = config
        self.backend = backend
        self.n_ctx = n_ctx
        self.max_batch = max_batch = max(1, min(max_batch, n_ctx))
        self.embedding = weights["token_embd.weight"]
        self.lm_head = self.embedding if c.tied_embeddings else weights["output.weight"]
        self.output_norm = weights["output_norm.weight"]
        self.layers = [_LayerWeights(weights, i) for i in range(c.n_layer)]

        q_dim, kv_dim = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
        # Activations (one row per token of the current chunk)
        self.x = buffers.zeros((max_batch, c.dim))          # residual stream
        self.xn = buffers.zeros((max_batch, c.dim))         # normalised input of a block
        self.q = buffers.zeros((max_batch, q_dim))
        self.k = buffers.zeros((max_batch, kv_dim))
        self.v = buffers.zeros((max_batch, kv_dim))
        self.att = buffers.zeros((max_batch, q_dim))        # attention output, per head
        self.proj = buffers.zeros((max_batch, c.dim))       # block output before the residual add
        self.gate = buffers.zeros((max_batch, c.ffn_dim))
        self.up = buffers.zeros((max_batch, c.ffn_dim))
        self.logits = buffers.zeros((1, c.vocab_size))
        self.positions = buffers.zeros(max_batch, np.int32)
        # KV cache: [layer][kv_head, position, head_dim]
        self.k_cache = [buffers.zeros((c.n_kv_head, n_ctx, c.head_dim)) for _ in range(c.n_layer)]
        self.v_cache = [buffers.zeros((c.n_kv_head, n_ctx, c.head_dim)) for _ in range(c.n_layer)]
        self.att_scratch = backend.attention_scratch(n_ctx, max_batch)
        # Llama 3 GGUFs carry per-frequency divisors as a tensor; partial rotation via rope_dim
        self.rope_cos, self.rope_sin = backend.rope_tables(n_ctx, c.head_dim, c.rope_base, c.rope_style,
                                                           n_rot=c.rope_dim,
                                                           freq_factors=weights.get("rope_freqs.weight"))
        self.linear = Linear(backend, max_batch, max(c.dim, c.ffn_dim, q_dim))
        self.att_scale = 1.0 / np.sqrt(c.head_dim)

        # The plan path (AVX2): a pinned worker pool and one plan per (chunk size, with LM head).
        # The token embedding is looked up inside the plan (the kernel reads token_ids)
        # when its kind has a kernel; otherwise numpy fills x before the plan runs.
        self.token_ids = buffers.zeros(max_batch, np.int32)
        self._embed_in_plan = backend.runs_plans and traits(self.embedding.kind).embed
        self.pool = None
        self._plans = {}
        if backend.runs_plans:
            from llambda.runtime.pool import WorkerPool
            self.pool = WorkerPool(threads)
            self._plan(1, True)        # the decode plan: built with the model, not on the first token
        self.threads = self.pool.n_threads if self.pool else 1

    def close(self):
        if self.pool is not None:
            self.pool.close()

    # -- running --------------------------------------------------------------
    def forward(self, ids, pos0, all_logits=False):
        """Run tokens ``ids`` at positions pos0.. and return the logits of the last one
        (or of every one, [len(ids), vocab], when ``all_logits``)."""
        if pos0 + len(ids) > self.n_ctx:
            raise ValueError(f"positions {pos0}..{pos0 + len(ids) - 1} exceed the context of {self.n_ctx}")
        rows = []
        for start in range(0, len(ids), self.max_batch):
            chunk = ids[start:start + self.max_batch]
            m = len(chunk)
            last = start + m == len(ids)
            if min(chunk) < 0 or max(chunk) >= self.embedding.n:     # the embed kernel trusts ids
                raise ValueError(f"token ids must be in [0, {self.embedding.n}), got {min(chunk)}..{max(chunk)}")
            self.token_ids[:m] = chunk
            if not self._embed_in_plan:
                self.x[:m] = layouts.rows(self.embedding, chunk)
            self.positions[:m] = range(pos0 + start, pos0 + start + m)
            with_head = last and not all_logits
            if self.pool is not None:
                recorder = self._plan(m, with_head)
                recorder.set_pos0(pos0 + start)
                self.pool.run(recorder.plan)
            else:
                self._blocks(self.backend, self.linear, m, pos0 + start)
                if with_head:
                    self._head(self.backend, self.linear, m)
            if all_logits:
                out = buffers.empty((m, self.config.vocab_size))
                self.backend.rmsnorm(self.x[:m], self.output_norm, self.config.rms_eps, self.xn[:m])
                self.linear(self.xn[:m], self.lm_head, out)
                rows.append(out)
        return np.concatenate(rows) if all_logits else self.logits[0]

    def _plan(self, m, with_head, pos0=0):
        """The recorded plan of a chunk of ``m`` tokens (built once, then reused)."""
        key = (m, with_head)
        if key not in self._plans:
            from llambda.runtime.recorder import PlanRecorder
            rec = PlanRecorder(self.pool.n_threads, self.n_ctx, self.backend)
            lin = self.linear.on(rec)
            self._blocks(rec, lin, m, pos0)
            if with_head:
                self._head(rec, lin, m)
            self._plans[key] = rec.finish()
        return self._plans[key]

    def profile(self):
        """A context in which every plan run is timed, op by op, through the normal path:

            with net.profile() as timer:    # a llambda.profile.PlanTimer, standing in for the pool
                ...                         # forward() as usual; timer.runs collects the stamps
        """
        if self.pool is None:
            raise ValueError("profile: only the plan path (the AVX2 backend) runs plans to time")
        return _Profiling(self)

    # -- the math ---------------------------------------------------------------
    def _blocks(self, be, lin, m, pos0):
        """Every transformer block over the chunk's m tokens (their embeddings in x, or
        looked up first from token_ids when the plan does it)."""
        c = self.config
        x, xn, proj = self.x[:m], self.xn[:m], self.proj[:m]
        q, k, v, att = self.q[:m], self.k[:m], self.v[:m], self.att[:m]
        gate, up = self.gate[:m], self.up[:m]
        positions = self.positions[:m]
        if self._embed_in_plan:
            be.embed(self.embedding, self.token_ids[:m], x)
        q_heads = q.reshape(m, c.n_head, c.head_dim)
        k_heads = k.reshape(m, c.n_kv_head, c.head_dim)
        v_heads = v.reshape(m, c.n_kv_head, c.head_dim)
        att_heads = att.reshape(m, c.n_head, c.head_dim)

        for layer, L in enumerate(self.layers):
            # attention block
            be.rmsnorm(x, L.attn_norm, c.rms_eps, xn)
            lin.load(xn)
            lin.apply(L.wq, q)
            lin.apply(L.wk, k)
            lin.apply(L.wv, v)
            be.rope(q_heads, positions, self.rope_cos, self.rope_sin, c.rope_style, q_heads)
            be.rope(k_heads, positions, self.rope_cos, self.rope_sin, c.rope_style, k_heads)
            be.kv_store(k_heads, positions, self.k_cache[layer])
            be.kv_store(v_heads, positions, self.v_cache[layer])
            be.attention(q_heads, self.k_cache[layer], self.v_cache[layer], pos0, self.att_scale,
                         att_heads, self.att_scratch)
            lin(att, L.wo, proj)
            be.add(x, proj, x)
            # feed-forward block (SwiGLU)
            be.rmsnorm(x, L.ffn_norm, c.rms_eps, xn)
            lin.load(xn)
            lin.apply(L.w_gate, gate)
            lin.apply(L.w_up, up)
            be.silu_mul(gate, up, gate)
            lin(gate, L.w_down, proj)
            be.add(x, proj, x)

    def _head(self, be, lin, m):
        """Final norm and LM head for the chunk's last token, into self.logits."""
        c = self.config
        be.rmsnorm(self.x[m - 1:m], self.output_norm, c.rms_eps, self.xn[:1])
        lin(self.xn[:1], self.lm_head, self.logits)


class _Profiling:
    """Puts a PlanTimer in place of the model's pool while the context is open."""

    def __init__(self, net):
        from llambda.profile import PlanTimer
        self.net = net
        self.timer = PlanTimer(net.pool, self.describe)

    def describe(self, plan):
        """(chunk size, with LM head, OpInfo per op, first position) of a plan about to run."""
        for (m, with_head), recorder in self.net._plans.items():
            if recorder.plan is plan:
                return m, with_head, recorder.ops, int(self.net.positions[0])
        raise ValueError("plan: not one of this model's plans")

    def __enter__(self):
        self.net.pool = self.timer
        return self.timer

    def __exit__(self, *exc):
        self.net.pool = self.timer.pool


class _LayerWeights:
    """The tensors of block ``i`` under the names GGUF gives them."""

    def __init__(self, w, i):
        p = f"blk.{i}."
        self.attn_norm = w[p + "attn_norm.weight"]
        self.wq = w[p + "attn_q.weight"]
        self.wk = w[p + "attn_k.weight"]
        self.wv = w[p + "attn_v.weight"]
        self.wo = w[p + "attn_output.weight"]
        self.ffn_norm = w[p + "ffn_norm.weight"]
        self.w_gate = w[p + "ffn_gate.weight"]
        self.w_up = w[p + "ffn_up.weight"]
        self.w_down = w[p + "ffn_down.weight"]
