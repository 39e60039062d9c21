"""What differs between the transformer architectures llambda runs, as data.

GGUF names a model's architecture (``general.architecture``). Every one llambda
runs is a pre-norm RMSNorm decoder; what varies is captured by one
``Architecture`` per name, which ``ModelConfig`` (numbers per model) and the
one forward pass in model.py read. The block they describe:

    x = token_embd[ids] * embed_scale                    sqrt(dim) for gemma3, else 1
    per layer l:
        h = rmsnorm(x) * attn_norm
        q, k, v = h Wq + bq, h Wk + bk, h Wv + bv        biases: qwen2 (optional for llama)
        q, k = rmsnorm_per_head(q) * q_norm, ... k       qk_norm: qwen3, gemma3
        q, k = RoPE(q), RoPE(k)                          style: pairs (llama) or halves;
                                                         base and scale of layer l
        a = softmax(att_scale q k^T + mask_l) v          mask_l: causal, and within the
                                                         sliding window of layer l (if any)
        o = a Wo (+ bo)
        x = x + rmsnorm(o) * post_attention_norm         post_norms: gemma3; else x + o
        h = rmsnorm(x) * ffn_norm
        f = (act(h Wgate) * (h Wup)) Wdown               act: SiLU, or tanh-GELU (gemma3)
        x = x + rmsnorm(f) * post_ffw_norm               post_norms: gemma3; else x + f
    logits = (rmsnorm(x) * output_norm) Wout             Wout = token_embd when tied;
                                                         softcap * tanh(logits / softcap) if set

Gemma's RMSNorm multiplies by (1 + w); its GGUF files already store 1 + w
(llama.cpp's converter adds the 1), so every norm is the plain one above.

Phi-3 stores Q, K and V as one fused ``attn_qkv`` matrix and gate and up as
one ``ffn_up`` of twice the rows. Conversion splits their rows into the
separate tensors (``fused``), exactly (each row is encoded on its own in every
GGUF type), so the forward only ever sees separate projections.

The numbers llama.cpp derives for each architecture (window pattern, local
RoPE base, attention scale) follow its src/models/<arch>.cpp.
"""
import math
from dataclasses import dataclass, field

# Per-layer tensors every architecture has: GGUF part name -> shape as (n, k) or (n,).
_BLOCK = {
    "attn_norm": lambda c: (c.dim,),
    "attn_q": lambda c: (c.n_head * c.head_dim, c.dim),
    "attn_k": lambda c: (c.n_kv_head * c.head_dim, c.dim),
    "attn_v": lambda c: (c.n_kv_head * c.head_dim, c.dim),
    "attn_output": lambda c: (c.dim, c.n_head * c.head_dim),
    "ffn_norm": lambda c: (c.dim,),
    "ffn_gate": lambda c: (c.ffn_dim, c.dim),
    "ffn_up": lambda c: (c.ffn_dim, c.dim),
    "ffn_down": lambda c: (c.dim, c.ffn_dim),
}
_QK_NORM = {
    "attn_q_norm": lambda c: (c.head_dim,),
    "attn_k_norm": lambda c: (c.head_dim,),
}
_POST_NORMS = {
    "post_attention_norm": lambda c: (c.dim,),
    "post_ffw_norm": lambda c: (c.dim,),
}
# Bias of a projection: as many values as the projection has output rows.
_BIAS_OF = {"attn_q", "attn_k", "attn_v", "attn_output"}

# Whole-model tensors, and the optional ones (RoPE frequency divisors: Llama 3's
# rope_freqs; Phi-3's long/short factors, the long ones used when the context
# exceeds the original one).
MODEL_TENSORS = {
    "token_embd.weight": lambda c: (c.vocab_size, c.dim),
    "output_norm.weight": lambda c: (c.dim,),
}
LM_HEAD = "output.weight"
ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _default_attention_scale(dim, n_head, head_dim, n_layer):
    return 1.0 / math.sqrt(head_dim)


def _gemma3_attention_scale(dim, n_head, head_dim, n_layer):
    # query_pre_attn_scalar is not in Gemma 3 GGUFs; llama.cpp takes it from the
    # model size: 27B (62 layers) scales by dim / n_head, the others by head_dim.
    return 1.0 / math.sqrt(dim / n_head if n_layer == 62 else head_dim)


@dataclass(frozen=True)
class Architecture:
    name: str
    rope_style: str                    # "pairs": (x[2i], x[2i+1]); "halves": (x[i], x[i + head_dim/2])
    activation: str = "silu"           # of the gate: "silu" (SwiGLU) or "gelu" (tanh-GELU: GeGLU)
    biases: tuple = ()                 # projections that may carry a .bias vector
    qk_norm: bool = False              # per-head RMSNorm of q and k before RoPE
    post_norms: bool = False           # RMSNorm of each block's output before its residual add
    embed_scale_sqrt_dim: bool = False  # the embedding is scaled by sqrt(dim)
    rope_factors: bool = False         # rope_freqs / rope_factors_* tensors divide the frequencies
    fused: dict = field(default_factory=dict)   # fused part -> the parts its rows hold, in order
    swa_period: int = 0                # local layers: every layer but each swa_period-th (0: none)
    local_rope_base: float = 10000.0   # RoPE base of local layers when the metadata has none
    attention_scale: callable = _default_attention_scale

    @property
    def glu_op(self):
        """The backend op that computes act(gate) * up."""
        return {"silu": "silu_mul", "gelu": "gelu_mul"}[self.activation]

    def layer_tensors(self, config):
        """{part: shape} of the tensors every block must have (after fused ones are split)."""
        parts = dict(_BLOCK)
        if self.qk_norm:
            parts.update(_QK_NORM)
        if self.post_norms:
            parts.update(_POST_NORMS)
        return {part: shape(config) for part, shape in parts.items()}

    def bias_tensors(self, config):
        """{part: shape} of the optional biases, named ``blk.N.<part>.bias``."""
        return {part: (_BLOCK[part](config)[0],) for part in self.biases}

    def split_sizes(self, part, config):
        """Row counts of the parts a fused tensor holds, in order."""
        return [_BLOCK[p](config)[0] for p in self.fused[part]]


ARCHITECTURES = {a.name: a for a in (
    # SmolLM, Llama 2/3, Mistral: GGUF calls them all "llama"; its converter
    # permutes Q/K rows so that RoPE rotates adjacent pairs.
    Architecture("llama", rope_style="pairs", biases=("attn_q", "attn_k", "attn_v", "attn_output"),
                 rope_factors=True),
    Architecture("qwen2", rope_style="halves", biases=("attn_q", "attn_k", "attn_v")),
    Architecture("qwen3", rope_style="halves", qk_norm=True),
    Architecture("phi3", rope_style="halves", rope_factors=True,
                 fused={"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_up": ("ffn_gate", "ffn_up")}),
    Architecture("gemma3", rope_style="halves", activation="gelu", qk_norm=True, post_norms=True,
                 embed_scale_sqrt_dim=True, swa_period=6, local_rope_base=10000.0,
                 attention_scale=_gemma3_attention_scale),
)}
assert all(set(a.biases) <= _BIAS_OF for a in ARCHITECTURES.values())


def get(name):
    """The Architecture called ``name``; KeyError if llambda does not run it."""
    return ARCHITECTURES[name]
