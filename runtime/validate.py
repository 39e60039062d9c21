"""Argument checks every native binding runs before it touches assembly.

Each raises ``ValueError`` naming the argument at fault, so a bad call never
reaches machine code.
"""
import numpy as np


def array(name, value, dtype, shape=None, *, align=32, writable=False, ndim=None):
    """Check that ``value`` is a C-contiguous ``dtype`` array of ``shape``, aligned.

    ``shape`` entries may be ``None`` (any size). Returns the array."""
    if not isinstance(value, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(value).__name__}")
    if value.dtype != np.dtype(dtype):
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype)}, got {value.dtype}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {value.shape}")
    if shape is not None:
        if value.ndim != len(shape) or any(s is not None and s != v for s, v in zip(shape, value.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name}: expected shape {want}, got {value.shape}")
    if value.size == 0:
        raise ValueError(f"{name}: array is empty (shape {value.shape})")
    if not value.flags.c_contiguous:
        raise ValueError(f"{name}: array must be C-contiguous (strides {value.strides})")
    if align and value.ctypes.data % align:
        raise ValueError(f"{name}: data must be {align}-byte aligned "
                         f"(address ends in {value.ctypes.data % align:#x} mod {align}); "
                         f"allocate it with llambda.runtime.buffers")
    if writable and not value.flags.writeable:
        raise ValueError(f"{name}: array is read-only but the kernel writes it")
    return value


def positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    return int(value)


def finite_float(name, value):
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number, got {value!r}") from None
    if not np.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value!r}")
    return value


def same_shape(name_a, a, name_b, b):
    if a.shape != b.shape:
        raise ValueError(f"{name_b}: expected shape {a.shape} like {name_a}, got {b.shape}")
