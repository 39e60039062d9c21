"""llambda: CPU inference for LLaMA-architecture models on PeachPy-generated AVX2 kernels."""
from llambda.api import load, load_tokenizer, Model  # noqa: F401
from llambda.errors import UserError  # noqa: F401

__version__ = "0.1.0"
