"""numpy reference: grouped-query causal attention over a KV cache (optionally within a sliding
window), in float64, from the math."""
import numpy as np

from ..native.attention import attention_scratch

__all__ = ["attention", "attention_scratch"]


def attention(q, k_cache, v_cache, pos0, scale, out, scratch, heads=None, window=0):
    """out[i, h] = sum_j p_j v[kv, j], p = softmax_j(scale * q[i, h] . k[kv, j]) over the keys
    query i at position p = pos0 + i sees: j <= p, and p - j < window when window > 0
    (llama.cpp's standard sliding window masks p - j >= window);
    kv = h // (n_head // n_kv_head). ``scratch`` is unused here (same signature as the kernel)."""
    m, n_head, _ = q.shape
    n_kv_head = k_cache.shape[0]
    group = n_head // n_kv_head
    h0, h1 = heads if heads is not None else (0, n_head)
    keys = k_cache[:, :pos0 + m].astype(np.float64)
    values = v_cache[:, :pos0 + m].astype(np.float64)
    for i in range(m):
        position = pos0 + i
        visible = np.arange(position + 1)
        if window:
            visible = visible[position - visible < window]
        for h in range(h0, h1):
            kv = h // group
            scores = scale * (keys[kv, visible] @ q[i, h].astype(np.float64))
            p = np.exp(scores - scores.max())
            out[i, h] = (p / p.sum()) @ values[kv, visible]
