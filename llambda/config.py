"""A model's hyper-parameters: what the forward pass needs to know besides the weights."""
from dataclasses import asdict, dataclass, fields

from .errors import UserError

SUPPORTED_ARCHITECTURES = ("llama",)     # SmolLM, Llama 2/3, Mistral: GGUF calls them all "llama"


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int
    dim: int                 # width of the residual stream (embedding length)
    n_head: int
    n_kv_head: int           # < n_head: grouped-query attention
    head_dim: int
    ffn_dim: int
    vocab_size: int
    n_ctx_train: int         # context length the model was trained for
    rms_eps: float
    rope_base: float
    rope_style: str          # "pairs": rotate (x[2i], x[2i+1]); GGUF's llama Q/K are permuted for it
    rope_dim: int            # leading dimensions of each head that are rotated (head_dim: all)
    tied_embeddings: bool    # the LM head is token_embd.weight (no output.weight)

    @classmethod
    def from_gguf_metadata(cls, metadata, tied_embeddings=False):
        """Build from GGUF key/values (``{"llama.block_count": 30, ...}``)."""
        arch = metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UserError(f"model architecture {arch!r} is not supported "
                            f"(llambda runs: {', '.join(SUPPORTED_ARCHITECTURES)})")
        key = _Reader(metadata, arch)
        dim = key.integer("embedding_length")
        n_head = key.integer("attention.head_count")
        n_kv_head = key.integer("attention.head_count_kv", default=n_head)
        head_dim = key.integer("attention.key_length", default=dim // n_head)
        config = cls(
            arch=arch,
            n_layer=key.integer("block_count"),
            dim=dim,
            n_head=n_head,
            n_kv_head=n_kv_head,
            head_dim=head_dim,
            ffn_dim=key.integer("feed_forward_length"),
            vocab_size=key.integer("vocab_size", default=_token_count(metadata)),
            n_ctx_train=key.integer("context_length"),
            rms_eps=key.number("attention.layer_norm_rms_epsilon"),
            rope_base=key.number("rope.freq_base", default=10000.0),
            rope_style="pairs",
            rope_dim=key.integer("rope.dimension_count", default=head_dim),
            tied_embeddings=bool(tied_embeddings),
        )
        config.check()
        return config

    def check(self):
        """Raise UserError if the numbers cannot describe a working model."""
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
        if not self.rms_eps > 0:
            raise UserError(f"model config: rms_eps = {self.rms_eps} must be positive")

    def to_dict(self):
        return asdict(self)

    @classmethod
    def from_dict(cls, values):
        names = {f.name for f in fields(cls)}
        missing = names - set(values)
        if missing:
            raise UserError(f"model config lacks {', '.join(sorted(missing))}: convert the model again")
        return cls(**{name: values[name] for name in names})


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

    def integer(self, name, default=None):
        key, value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"GGUF metadata {key} = {value!r} is not an integer")
        return value

    def number(self, name, default=None):
        key, value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"GGUF metadata {key} = {value!r} is not a number")
        return float(value)
