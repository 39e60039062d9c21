"""The LLaMA forward pass on llambda's kernels.

Reads like the math (llama2.c's ``forward``): every buffer is allocated once
in ``__init__``; ``forward`` only calls kernels. Prefill runs a whole chunk of
prompt tokens through batched GEMMs; decode is the same code with m = 1.
"""
import numpy as np

from llambda.runtime import buffers, layouts
from llambda.runtime.linear import Linear

# Prompt tokens per prefill chunk: big enough for GEMM efficiency, small
# enough that the activation buffers stay in L2.
DEFAULT_BATCH = 128


class LlamaModel:
    def __init__(self, config, weights, backend, n_ctx, max_batch=DEFAULT_BATCH):
        c = self.config = config
        self.backend = backend
        self.n_ctx = n_ctx
        self.max_batch = max_batch = max(1, min(max_batch, n_ctx))
        self.w = weights
        self.embedding = weights["token_embd.weight"]
        self.lm_head = self.embedding if c.tied_embeddings else weights["output.weight"]
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
        self.rope_cos, self.rope_sin = backend.rope_tables(n_ctx, c.head_dim, c.rope_base, c.rope_style)
        self.linear = Linear(backend, max_batch, max(c.dim, c.ffn_dim, q_dim))
        self.att_scale = 1.0 / np.sqrt(c.head_dim)

    def forward(self, ids, pos0, all_logits=False):
        """Run tokens ``ids`` at positions pos0.. and return the logits of the last one
        (or of every one, [len(ids), vocab], when ``all_logits``)."""
        if pos0 + len(ids) > self.n_ctx:
            raise ValueError(f"positions {pos0}..{pos0 + len(ids) - 1} exceed the context of {self.n_ctx}")
        rows = []
        for start in range(0, len(ids), self.max_batch):
            chunk = ids[start:start + self.max_batch]
            self._forward_chunk(chunk, pos0 + start)
            if all_logits:
                rows.append(self._logits(len(chunk), all_rows=True))
        if all_logits:
            return np.concatenate(rows)
        return self._logits(len(chunk))

    def _forward_chunk(self, ids, pos0):
        c, be, lin = self.config, self.backend, self.linear
        m = len(ids)
        x, xn, proj = self.x[:m], self.xn[:m], self.proj[:m]
        q, k, v, att = self.q[:m], self.k[:m], self.v[:m], self.att[:m]
        gate, up = self.gate[:m], self.up[:m]
        positions = self.positions[:m]
        positions[:] = np.arange(pos0, pos0 + m, dtype=np.int32)
        q_heads = q.reshape(m, c.n_head, c.head_dim)
        k_heads = k.reshape(m, c.n_kv_head, c.head_dim)

        x[:] = layouts.rows(self.embedding, ids)
        for layer, L in enumerate(self.layers):
            # attention block
            be.rmsnorm(x, L.attn_norm, c.rms_eps, xn)
            lin.load(xn)
            lin.apply(L.wq, q)
            lin.apply(L.wk, k)
            lin.apply(L.wv, v)
            be.rope(q_heads, positions, self.rope_cos, self.rope_sin, c.rope_style, q_heads)
            be.rope(k_heads, positions, self.rope_cos, self.rope_sin, c.rope_style, k_heads)
            self.k_cache[layer][:, pos0:pos0 + m, :] = k_heads.transpose(1, 0, 2)
            self.v_cache[layer][:, pos0:pos0 + m, :] = v.reshape(m, c.n_kv_head, c.head_dim).transpose(1, 0, 2)
            be.attention(q_heads, self.k_cache[layer], self.v_cache[layer], pos0, self.att_scale,
                         att.reshape(m, c.n_head, c.head_dim), self.att_scratch)
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

    def _logits(self, m, all_rows=False):
        """Final norm and LM head for the last row of the chunk (or all rows)."""
        c, be = self.config, self.backend
        if all_rows:
            out = buffers.empty((m, c.vocab_size))
            be.rmsnorm(self.x[:m], self.w["output_norm.weight"], c.rms_eps, self.xn[:m])
            self.linear(self.xn[:m], self.lm_head, out)
            return out
        last = self.x[m - 1:m]
        be.rmsnorm(last, self.w["output_norm.weight"], c.rms_eps, self.xn[:1])
        self.linear(self.xn[:1], self.lm_head, self.logits)
        return self.logits[0]


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
