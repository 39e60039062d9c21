"""Argument checks every native binding runs before it touches assembly.

Each raises ``ValueError`` naming the argument at fault, so a bad call never
reaches machine code.
"""
import ctypes

import numpy as np


def array(name, value, dtype, shape=None, *, align=32, writable=False, ndim=None, contiguous=True):
    """Check that ``value`` is a C-contiguous ``dtype`` array of ``shape``, aligned.

    ``shape`` entries may be ``None`` (any size). ``contiguous=False``: any strides (the
    caller checks the ones its kernel can follow). Returns the array.

    Recording a model's plans runs this thousands of times at load, so the checks
    avoid numpy's slow accessors (a dtype built per call, ``ctypes.data``)."""
    if not isinstance(value, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(value).__name__}")
    if value.dtype != dtype and value.dtype != np.dtype(dtype):
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype)}, got {value.dtype}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {value.shape}")
    if shape is not None:
        if value.ndim != len(shape) or any(s is not None and s != v for s, v in zip(shape, value.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name}: expected shape {want}, got {value.shape}")
    if value.size == 0:
        raise ValueError(f"{name}: array is empty (shape {value.shape})")
    flags = value.flags
    if contiguous and not flags.c_contiguous:
        raise ValueError(f"{name}: array must be C-contiguous (strides {value.strides})")
    if align:
        at = address(value)
        if at % align:
            raise ValueError(f"{name}: data must be {align}-byte aligned "
                             f"(address ends in {at % align:#x} mod {align}); "
                             f"allocate it with llambda.runtime.buffers")
    if writable and not flags.writeable:
        raise ValueError(f"{name}: array is read-only but the kernel writes it")
    return value


def address(array):
    """The address of ``array``'s first element, as an int.

    ``array.ctypes.data`` builds a helper object and a ctypes pointer (numpy's
    ``__array_interface__`` builds a dict and is no cheaper); viewing a writable,
    contiguous, non-empty buffer as a ctypes char costs a third of that. Anything
    else (read-only weights, strided views, empty arrays) takes the general path."""
    flags = array.flags
    if flags.writeable and flags.c_contiguous and array.size:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    return array.ctypes.data


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
