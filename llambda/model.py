"""The transformer forward pass on llambda's kernels, for every architecture in llambda/arch.py.

Reads like the math (llama2.c's ``forward``): every buffer is allocated once
in ``__init__``; ``_blocks`` and ``_head`` only call ops. What differs between
architectures (biases, Q/K norms, post norms, activation, per-layer window and
RoPE) is read from the model's Architecture and config, never asked by name.
Prefill runs a whole chunk of prompt tokens through batched GEMMs; decode is
the same code with m = 1.

The ops go to one of two places. With the AVX2 backend, ``_blocks`` runs once
per chunk size against a ``PlanRecorder``: the kernel calls of a whole chunk
become a plan, split across the worker pool, that later runs with one native
call per thread (only the position is patched between tokens). With the numpy
backend the same code calls the reference ops directly.
"""

import contextlib
import math

import numpy as np

from llambda.runtime import buffers, layouts
from llambda.runtime.kinds import traits
from llambda.runtime.linear import Linear

from .arch import LM_HEAD

# Prompt tokens per prefill chunk: big enough for GEMM efficiency, small
# enough that the activation buffers stay in L2.
DEFAULT_BATCH = 128
# The tag the LM head's ops carry in a recorded plan (the profiler's "(LM head)" rows).
HEAD_TAG = "lm_head"


class TransformerModel:
    def __init__(self, config, weights, backend, n_ctx, max_batch=DEFAULT_BATCH, threads=None):
        c = self.config = config
        self.arch = c.architecture
        self.backend = backend
        self.n_ctx = n_ctx
        self.max_batch = max_batch = max(1, min(max_batch, n_ctx))
        self.embedding = weights["token_embd.weight"]
        self.lm_head = self.embedding if c.tied_embeddings else weights[LM_HEAD]
        self.output_norm = weights["output_norm.weight"]
        self.layers = [_LayerWeights(weights, i, self.arch.layer_tensors(c), self.arch.biases)
                       for i in range(c.n_layer)]

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
        # RoPE tables per layer: one pair per distinct (base, scale), e.g. Gemma's local and global
        tables = {}
        factors = _rope_factors(weights, c, n_ctx)
        for base, scale in zip(c.layer_rope_base, c.layer_rope_scale):
            if (base, scale) not in tables:
                tables[base, scale] = _rope_tables(backend, c, n_ctx, base, scale, factors)
        self.rope = [tables[key] for key in zip(c.layer_rope_base, c.layer_rope_scale)]
        self.linear = Linear(backend, max_batch, max(c.dim, c.ffn_dim, q_dim))
        self.glu = self.arch.glu_op           # act(gate) * up: "silu_mul" or "gelu_mul"

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
                rows.append(self._softcapped(out))
        return np.concatenate(rows) if all_logits else self._softcapped(self.logits)[0]

    def _softcapped(self, logits):
        """Gemma-style final soft-capping, c tanh(logits / c), in place (numpy: one row per token)."""
        cap = self.config.logit_softcap
        if cap > 0:
            np.multiply(np.tanh(logits / np.float32(cap)), np.float32(cap), out=logits)
        return logits

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
        c, a = self.config, self.arch
        x, xn, proj = self.x[:m], self.xn[:m], self.proj[:m]
        q, k, v, att = self.q[:m], self.k[:m], self.v[:m], self.att[:m]
        gate, up = self.gate[:m], self.up[:m]
        positions = self.positions[:m]
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
            be.kv_store(k_heads, positions, self.k_cache[layer])
            be.kv_store(v_heads, positions, self.v_cache[layer])
            be.attention(q_heads, self.k_cache[layer], self.v_cache[layer], pos0, c.att_scale,
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

    def _head(self, be, lin, m):
        """Final norm and LM head for the chunk's last token, into self.logits."""
        c = self.config
        be.rmsnorm(self.x[m - 1:m], self.output_norm, c.rms_eps, self.xn[:1])
        with be.tagged(HEAD_TAG) if hasattr(be, "tagged") else contextlib.nullcontext():
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
