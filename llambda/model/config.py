"""A model's hyper-parameters: what the forward pass needs to know besides the weights.

``ModelConfig.from_gguf_metadata`` reads them the way llama.cpp does for each
architecture (llambda/model/arch.py says what differs), down to plain numbers per
layer (attention window, RoPE base and scale), so the forward needs no
knowledge of where they came from. The config is stored in the converted file.
"""
import math
from dataclasses import asdict, dataclass, fields

from llambda.model import arch as architectures
from llambda.errors import UserError

SUPPORTED_ARCHITECTURES = tuple(architectures.ARCHITECTURES)

# RoPE scaling types as GGUF names them (rope.scaling.type). "linear" divides the
# positions by the factor; "yarn" blends that with unscaled rotation per frequency
# and scales the magnitude; "longrope" (Phi-3) is linear here plus the long/short
# factor tensors; "none" ignores any factor.
ROPE_SCALINGS = ("none", "linear", "yarn", "longrope")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    dim: int                 # width of the residual stream (embedding length)
    n_head: int
    n_kv_head: int           # < n_head: grouped-query attention
    head_dim: int
    ffn_dim: int
    vocab_size: int          # rows of the embedding and LM head (may exceed the tokenizer's tokens)
    n_ctx_train: int         # context length the model was trained for
    rms_eps: float
    rope_base: float         # RoPE base of the global layers (see layer_rope_base)
    rope_style: str          # "pairs": rotate (x[2i], x[2i+1]); "halves": (x[i], x[i + head_dim/2])
    rope_dim: int            # leading dimensions of each head that are rotated (head_dim: all)
    tied_embeddings: bool    # the LM head is token_embd.weight (no output.weight)
    rope_scaling: str        # one of ROPE_SCALINGS
    rope_orig_ctx: int       # context the scaling stretches from (yarn's ramp; Phi-3's long factors)
    rope_attn_factor: float  # magnitude of the RoPE tables (rope.scaling.attn_factor)
    layer_window: tuple      # per layer: sliding attention window (0: global, causal only)
    layer_rope_base: tuple   # per layer: RoPE base
    layer_rope_scale: tuple  # per layer: RoPE position scale (1 / linear factor)
    embed_scale: float       # the token embedding is multiplied by this
    att_scale: float         # attention scores are q.k times this
    logit_softcap: float     # logits = c tanh(logits / c) when c > 0; 0: none

    @classmethod
    def from_gguf_metadata(cls, metadata, tied_embeddings=False, embedding_rows=None):
        """Build from GGUF key/values (``{"llama.block_count": 30, ...}``); ``embedding_rows``
        (rows of token_embd.weight) is the vocabulary size when given."""
        name = metadata.get("general.architecture")
        if name not in architectures.ARCHITECTURES:
            raise UserError(f"model architecture {name!r} is not supported "
                            f"(llambda runs: {', '.join(SUPPORTED_ARCHITECTURES)})")
        a = architectures.get(name)
        key = _Reader(metadata, name)
        dim = key.integer("embedding_length", minimum=1)
        n_head = key.integer("attention.head_count", minimum=1)
        n_kv_head = key.integer("attention.head_count_kv", default=n_head, minimum=1)
        if n_head % n_kv_head:
            raise UserError(f"GGUF metadata {name}.attention.head_count = {n_head} query heads do not split "
                            f"into {name}.attention.head_count_kv = {n_kv_head} key/value heads")
        if f"{name}.attention.key_length" not in metadata and dim % n_head:
            raise UserError(f"GGUF metadata {name}.attention.head_count = {n_head} does not divide "
                            f"{name}.embedding_length = {dim} (and no attention.key_length gives the head size)")
        head_dim = key.integer("attention.key_length", default=dim // n_head, minimum=1)
        value_dim = key.integer("attention.value_length", default=head_dim)
        if value_dim != head_dim:
            raise UserError(f"GGUF metadata {name}.attention.value_length = {value_dim} differs from the "
                            f"key length {head_dim}; llambda needs them equal")
        n_layer = key.integer("block_count", minimum=1)
        n_ctx_train = key.integer("context_length", minimum=0)
        rope_base = key.number("rope.freq_base", default=10000.0, positive=True)
        rope_dim = key.integer("rope.dimension_count", default=head_dim, minimum=2)
        if rope_dim > head_dim or rope_dim % 2:
            raise UserError(f"GGUF metadata {name}.rope.dimension_count = {rope_dim} must be even and at most "
                            f"the head size {head_dim}")
        scaling, freq_scale = _rope_scaling(key)
        rope_orig_ctx = key.integer("rope.scaling.original_context_length", default=n_ctx_train, minimum=0)
        if scaling in ("yarn", "longrope") and rope_orig_ctx < 1:
            raise UserError(f"GGUF metadata {name}.rope.scaling.original_context_length = {rope_orig_ctx}: "
                            f"{scaling} RoPE scaling needs the context it stretches from")
        windows = _layer_windows(a, key, n_layer)
        local_base = key.number("rope.freq_base_swa", default=a.local_rope_base, positive=True)
        vocab_size = embedding_rows if embedding_rows is not None else \
            key.integer("vocab_size", default=_token_count(metadata))
        config = cls(
            arch=name,
            n_layer=n_layer,
            dim=dim,
            n_head=n_head,
            n_kv_head=n_kv_head,
            head_dim=head_dim,
            ffn_dim=key.integer("feed_forward_length", minimum=1),
            vocab_size=vocab_size,
            n_ctx_train=n_ctx_train,
            rms_eps=key.number("attention.layer_norm_rms_epsilon", positive=True),
            rope_base=rope_base,
            rope_style=a.rope_style,
            rope_dim=rope_dim,
            tied_embeddings=bool(tied_embeddings),
            rope_scaling=scaling,
            rope_orig_ctx=rope_orig_ctx,
            rope_attn_factor=key.number("rope.scaling.attn_factor", default=1.0, positive=True),
            layer_window=windows,
            # Local (sliding-window) layers rotate with their own base and no scaling.
            layer_rope_base=tuple(local_base if w else rope_base for w in windows),
            layer_rope_scale=tuple(1.0 if w else freq_scale for w in windows),
            embed_scale=float(math.sqrt(dim)) if a.embed_scale_sqrt_dim else 1.0,
            att_scale=a.attention_scale(dim, n_head, head_dim, n_layer),
            logit_softcap=key.number("final_logit_softcapping", default=0.0, minimum=0.0),
        )
        config.check()
        return config

    @property
    def architecture(self):
        """The block description (llambda.model.arch.Architecture) of this model."""
        return architectures.get(self.arch)

    def check(self):
        """Raise UserError if the numbers cannot describe a working model."""
        if self.arch not in architectures.ARCHITECTURES:
            raise UserError(f"model config: architecture {self.arch!r} is not supported "
                            f"(llambda runs: {', '.join(SUPPORTED_ARCHITECTURES)})")
        positive = ("n_layer", "dim", "n_head", "n_kv_head", "head_dim", "ffn_dim", "vocab_size")
        for name in positive:
            if getattr(self, name) < 1:
                raise UserError(f"model config: {name} = {getattr(self, name)} must be positive")
        if self.n_head % self.n_kv_head:
            raise UserError(f"model config: {self.n_head} query heads do not split into "
                            f"{self.n_kv_head} key/value heads")
        if not 0 < self.rope_dim <= self.head_dim or self.rope_dim % 2:
            raise UserError(f"model config: rope dimension {self.rope_dim} must be even and at most "
                            f"head_dim {self.head_dim}")
        if self.rope_style == "halves" and self.rope_dim != self.head_dim:
            raise UserError(f"model config: rope dimension {self.rope_dim} < head_dim {self.head_dim}: "
                            f"partial rotation is supported for llama-style (pairs) RoPE only")
        if not self.rms_eps > 0:
            raise UserError(f"model config: rms_eps = {self.rms_eps} must be positive")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise UserError(f"model config: RoPE scaling {self.rope_scaling!r} is not one of "
                            f"{', '.join(ROPE_SCALINGS)}")
        for name in ("layer_window", "layer_rope_base", "layer_rope_scale"):
            if len(getattr(self, name)) != self.n_layer:
                raise UserError(f"model config: {name} has {len(getattr(self, name))} entries "
                                f"for {self.n_layer} layers")
        if any(w < 0 for w in self.layer_window):
            raise UserError(f"model config: a sliding window is negative: {self.layer_window}")
        if not all(b > 0 for b in self.layer_rope_base) or not all(s > 0 for s in self.layer_rope_scale):
            raise UserError("model config: RoPE bases and scales must be positive")
        if not self.att_scale > 0 or not self.embed_scale > 0 or self.logit_softcap < 0:
            raise UserError(f"model config: att_scale {self.att_scale}, embed_scale {self.embed_scale} "
                            f"must be positive and logit_softcap {self.logit_softcap} not negative")

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, values):
        names = {f.name for f in fields(cls)}
        missing = names - set(values)
        if missing:
            raise UserError(f"model config lacks {', '.join(sorted(missing))}: convert the model again")
        # JSON gives lists back where the config holds tuples
        return cls(**{name: tuple(values[name]) if isinstance(values[name], list) else values[name]
                      for name in names})


def _rope_scaling(key):
    """(scaling type, position scale) as llama.cpp reads them: the type defaults to
    linear, the factor (or the older rope.scale_linear) to none; "none" never scales."""
    scaling = key.string("rope.scaling.type", default="linear")
    if scaling not in ROPE_SCALINGS:
        raise UserError(f"GGUF metadata {key.arch}.rope.scaling.type = {scaling!r}: llambda applies "
                        f"{', '.join(ROPE_SCALINGS)}")
    factor = key.number("rope.scaling.factor", default=key.number("rope.scale_linear", default=0.0, minimum=0.0),
                        minimum=0.0)
    if scaling == "none" or factor in (0.0, 1.0):     # a factor of 1 changes nothing, yarn included
        return "none", 1.0
    if not math.isfinite(1.0 / factor):
        raise UserError(f"GGUF metadata {key.arch}.rope.scaling.factor = {factor} is too small to divide by")
    return scaling, 1.0 / factor


def _layer_windows(a, key, n_layer):
    """Per layer the sliding attention window (0: global), llama.cpp's way: with a window
    in the metadata, layer l is local unless l % period == period - 1 (the period from
    attention.sliding_window_pattern, else the architecture's), or as a per-layer
    list when the pattern is one."""
    if not a.swa_period:
        return (0,) * n_layer
    # absent: no local layers; present, a window of no position would attend to nothing
    window = key.integer("attention.sliding_window", default=0)
    if f"{key.arch}.attention.sliding_window" in key.metadata and window < 1:
        raise UserError(f"GGUF metadata {key.arch}.attention.sliding_window = {window}: a sliding window "
                        "must hold at least 1 position")
    if window <= 0:
        return (0,) * n_layer
    pattern = key.raw("attention.sliding_window_pattern", default=a.swa_period)
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise UserError(f"GGUF metadata {key.arch}.attention.sliding_window_pattern lists "
                            f"{len(pattern)} layers, the model has {n_layer}")
        local = [bool(p) for p in pattern]
    else:
        period = key.integer("attention.sliding_window_pattern", default=a.swa_period)
        local = [period == 0 or layer % period < period - 1 for layer in range(n_layer)]
    return tuple(window if is_local else 0 for is_local in local)


def _token_count(metadata):
    tokens = metadata.get("tokenizer.ggml.tokens")
    return len(tokens) if tokens is not None else None


class _Reader:
    """Typed access to ``<arch>.<name>`` keys with errors that name the missing key."""

    def __init__(self, metadata, arch):
        self.metadata = metadata
        self.arch = arch

    def _get(self, name, default):
        key = f"{self.arch}.{name}"
        value = self.metadata.get(key, default)
        if value is None:
            raise UserError(f"GGUF metadata lacks {key}")
        return key, value

    def raw(self, name, default=None):
        return self._get(name, default)[1]

    def integer(self, name, default=None, minimum=None):
        key, value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"GGUF metadata {key} = {value!r} is not an integer")
        if minimum is not None and value < minimum:
            raise UserError(f"GGUF metadata {key} = {value} must be at least {minimum}")
        return value

    def number(self, name, default=None, positive=False, minimum=None):
        """A finite number (NaN and infinities are refused: they reach the model's tables);
        ``positive``: > 0; ``minimum``: at least that."""
        key, value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"GGUF metadata {key} = {value!r} is not a number")
        value = float(value)
        if not math.isfinite(value):
            raise UserError(f"GGUF metadata {key} = {value} is not a finite number")
        if positive and not value > 0:
            raise UserError(f"GGUF metadata {key} = {value} must be positive")
        if minimum is not None and value < minimum:
            raise UserError(f"GGUF metadata {key} = {value} must be at least {minimum}")
        return value

    def string(self, name, default=None):
        key, value = self._get(name, default)
        if not isinstance(value, str):
            raise UserError(f"GGUF metadata {key} = {value!r} is not a string")
        return value
