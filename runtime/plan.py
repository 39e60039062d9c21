"""A plan: the kernel calls of one token, written once, run many times by the worker pool.

    plan = Plan(pool.n_threads)
    chunks = split_range(n, plan.n_threads, multiple=16)
    h = plan.add("llb_add_f32__avx2",
                 per_thread=[None if c is None else [a_ptr + 4 * c[0], b_ptr + 4 * c[0],
                                                     out_ptr + 4 * c[0], c[1] - c[0]]
                             for c in chunks])
    plan.run(pool)                  # every thread enters native code once
    plan.set_int_arg(h, 3, 7)       # patch an argument for the next run: no rebuild
    stamps = plan.stamp_buffer()
    plan.run(pool, stamps)          # the same, timed: per-op TSC readings in stamps

The plan is an array of op records, ``[n_ops][n_threads]``, that
``llb_run_plan__avx2`` (codegen/executor.py) walks: thread t calls the kernel
of record ``[op][t]`` with that record's arguments, then, if the op has a
barrier, waits until every thread has finished it. The caller splits the work
(``split_range``) so that threads write disjoint, cache-line aligned ranges.

Record layout (RECORD, 128 bytes; must match codegen/executor.py):

    fn          u64      kernel address; 0: this thread has nothing to do
    float_args  f32[2]   passed in xmm0, xmm1
    barrier     u32      1: all threads wait after this op (same in every record of the op)
    int_args    u64[13]  integer and pointer args in System V order (6 in registers, 7 on the stack)

The plan checks what it can: argument counts against the kernel's signature,
integer ranges, finite floats. It cannot check that a pointer points at a
buffer big enough for what the kernel does with it: whoever adds an op
validates its buffers first (as the bindings in runtime/native do), and
passing numpy arrays rather than addresses keeps the buffers alive as long as
the plan refers to them.
"""
import ctypes
import functools

import numpy as np

from . import buffers
from . import validate as v

from ..codegen.contract import (BARRIER_OFFSET, FLOAT_ARGS_OFFSET, FN_OFFSET, INT_ARGS_OFFSET, MAX_FLOAT_ARGS,
                                MAX_INT_ARGS, RECORD_BYTES, STAMP_WORDS)

RECORD = np.dtype({
    "names": ["fn", "float_args", "barrier", "int_args"],
    "formats": [np.uint64, (np.float32, MAX_FLOAT_ARGS), np.uint32, (np.uint64, MAX_INT_ARGS)],
    "offsets": [FN_OFFSET, FLOAT_ARGS_OFFSET, BARRIER_OFFSET, INT_ARGS_OFFSET],
    "itemsize": RECORD_BYTES,
})

_FLOAT_CTYPES = (ctypes.c_float,)
_REJECTED_CTYPES = (ctypes.c_double, ctypes.c_longdouble)
_INITIAL_OPS = 64


def split_range(n, n_threads, multiple=1):
    """Split ``[0, n)`` into ``n_threads`` contiguous chunks whose starts are multiples of ``multiple``.

    Returns a list with one ``(start, stop)`` per thread, or ``None`` for a thread
    left without work (when ``n`` has fewer than ``n_threads`` multiples). Chunk
    sizes differ by at most ``multiple``. With ``multiple=16`` float32 outputs,
    no two threads write the same 64-byte line of a 64-byte aligned buffer."""
    n = v.positive_int("n", n)
    n_threads = v.positive_int("n_threads", n_threads)
    multiple = v.positive_int("multiple", multiple)
    units = -(-n // multiple)
    chunks = []
    for t in range(n_threads):
        start = min(units * t // n_threads * multiple, n)
        stop = min(units * (t + 1) // n_threads * multiple, n)
        chunks.append((start, stop) if stop > start else None)
    return chunks


def kernel_address(kernel):
    """``(address, int arg count, float arg count)`` of a kernel symbol or typed ctypes function."""
    if isinstance(kernel, str):
        return _symbol_address(kernel)
    if not isinstance(kernel, ctypes._CFuncPtr):
        raise ValueError(f"kernel: expected a kernel symbol or a ctypes function, got {type(kernel).__name__}")
    if kernel.argtypes is None:
        raise ValueError(f"kernel: {getattr(kernel, '__name__', 'the function')} has no argtypes; "
                         "set them so the plan can check the arguments")
    if any(t in _REJECTED_CTYPES for t in kernel.argtypes):
        raise ValueError("kernel: double arguments are not supported (the executor passes float32 in xmm0/xmm1)")
    n_float = sum(t in _FLOAT_CTYPES for t in kernel.argtypes)
    return ctypes.cast(kernel, ctypes.c_void_p).value, len(kernel.argtypes) - n_float, n_float


@functools.lru_cache(maxsize=None)
def _symbol_address(symbol):
    """kernel_address of a library symbol, looked up once (a plan adds the same few
    kernels hundreds of times, and the library's functions never change)."""
    from .library import KernelLibraryError
    from .native._lib import kernel as lookup
    try:
        return kernel_address(lookup(symbol))
    except KernelLibraryError as error:
        raise ValueError(f"kernel: {error}") from None


class Plan:
    """The op records of one plan for ``n_threads`` threads; see the module docstring."""

    def __init__(self, n_threads):
        self.n_threads = v.positive_int("n_threads", n_threads)
        self._records = buffers.zeros((_INITIAL_OPS, self.n_threads), RECORD)
        self._n_ops = 0
        self._arity = []              # per op: (int args, float args)
        self._kept_alive = {}         # (op, thread, index) -> array whose address is in the record

    @property
    def n_ops(self):
        return self._n_ops

    @property
    def records(self):
        """The live records, ``[n_ops][n_threads]`` of RECORD (a view: read it, don't keep it)."""
        return self._records[:self._n_ops]

    @property
    def address(self):
        return self._records.ctypes.data

    @property
    def stamp_shape(self):
        """``(n_threads, n_ops + 1, STAMP_WORDS)``: entry, then per op [kernel returned, released]."""
        return (self.n_threads, self._n_ops + 1, STAMP_WORDS)

    def stamp_buffer(self):
        """A buffer for the timed executor's stamps of one run of this plan (see codegen/executor.py)."""
        return buffers.zeros(self.stamp_shape, np.uint64)

    def add(self, kernel, int_args=(), float_args=(), per_thread=None, barrier=True):
        """Append one op; returns its handle (the op's index) for ``set_int_arg``.

        ``kernel``: a symbol of the kernel library or a ctypes function with argtypes.
        ``int_args``: integers or numpy arrays (passed by address) for a serial
        op, run by thread 0 alone. ``per_thread``: instead of ``int_args``, one
        argument list per thread, ``None`` for a thread with nothing to do.
        ``float_args``: up to two floats, the same for every thread.
        ``barrier``: every thread waits after this op until all have finished it;
        pass False only when the next op does not read what this one writes."""
        address, n_int, n_float = kernel_address(kernel)
        if n_int > MAX_INT_ARGS or n_float > MAX_FLOAT_ARGS:
            raise ValueError(f"kernel: takes {n_int} integer and {n_float} float arguments; an op record "
                             f"holds at most {MAX_INT_ARGS} and {MAX_FLOAT_ARGS}")
        float_args = [v.finite_float("float_args", x) for x in float_args]
        if len(float_args) != n_float:
            raise ValueError(f"float_args: the kernel takes {n_float} float arguments, got {len(float_args)}")
        name = "int_args" if per_thread is None else "per_thread"
        thread_words = [None if args is None else [_encode_int(arg, name) for arg in args]
                        for args in self._thread_args(int_args, per_thread, n_int)]
        op = self._append_row()
        record = self._records[op]             # one row per thread; a new op has no arguments kept alive
        record["barrier"] = 1 if barrier else 0
        if n_float:
            record["float_args"][:, :n_float] = float_args
        for t, words in enumerate(thread_words):
            if words is None:
                continue
            record["fn"][t] = address
            if words:
                record["int_args"][t, :len(words)] = [word for word, _ in words]
            for i, (_, array) in enumerate(words):
                if array is not None:
                    self._kept_alive[(op, t, i)] = array
        self._arity.append((n_int, n_float))
        return op

    def set_int_arg(self, handle, index, value):
        """Patch integer argument ``index`` of op ``handle`` before the next run.

        ``value``: one integer or array for every thread, or a sequence with one
        per thread (``None`` leaves that thread's argument as it is)."""
        n_int, _ = self._arity[self._check_handle(handle)]
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < n_int:
            raise ValueError(f"index: op {handle} has integer arguments 0..{n_int - 1}, got {index!r}")
        if isinstance(value, (list, tuple)):
            if len(value) != self.n_threads:
                raise ValueError(f"value: expected one value per thread ({self.n_threads}), got {len(value)}")
            words = [None if x is None else _encode_int(x, "value") for x in value]
        else:
            words = [_encode_int(value, "value")] * self.n_threads
        for t, word in enumerate(words):
            if word is not None:
                self._write_int(handle, t, index, word)

    def set_barrier(self, handle, barrier=True):
        """Make every thread wait after op ``handle`` (or not)."""
        self._records["barrier"][self._check_handle(handle)] = 1 if barrier else 0

    def set_float_arg(self, handle, index, value):
        """Patch float argument ``index`` of op ``handle`` (the same for every thread)."""
        _, n_float = self._arity[self._check_handle(handle)]
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < n_float:
            raise ValueError(f"index: op {handle} has {n_float} float arguments, got index {index!r}")
        self._records["float_args"][handle, :, index] = v.finite_float("value", value)

    def run(self, pool, stamps=None):
        """Run every op once on ``pool`` (a runtime.pool.WorkerPool with as many threads);
        timed into ``stamps`` (from ``stamp_buffer``) when given."""
        pool.run(self, stamps)

    def _thread_args(self, int_args, per_thread, n_int):
        if per_thread is None:
            int_args = list(int_args)
            self._check_arg_count("int_args", int_args, n_int)
            return [int_args] + [None] * (self.n_threads - 1)
        if len(int_args):
            raise ValueError("int_args: give either int_args (a serial op) or per_thread, not both")
        per_thread = list(per_thread)
        if len(per_thread) != self.n_threads:
            raise ValueError(f"per_thread: expected one entry per thread ({self.n_threads}), got {len(per_thread)}")
        for t, args in enumerate(per_thread):
            if args is not None:
                self._check_arg_count(f"per_thread[{t}]", list(args), n_int)
        return [None if args is None else list(args) for args in per_thread]

    @staticmethod
    def _check_arg_count(name, args, n_int):
        if len(args) > MAX_INT_ARGS:
            raise ValueError(f"{name}: an op record holds at most {MAX_INT_ARGS} integer arguments, got {len(args)}")
        if len(args) != n_int:
            raise ValueError(f"{name}: the kernel takes {n_int} integer arguments, got {len(args)}")

    def _check_handle(self, handle):
        if isinstance(handle, bool) or not isinstance(handle, (int, np.integer)) or not 0 <= handle < self._n_ops:
            raise ValueError(f"handle: expected an op handle from add() (0..{self._n_ops - 1}), got {handle!r}")
        return int(handle)

    def _write_int(self, op, thread, index, encoded):
        word, array = encoded
        key = (op, thread, index)
        if array is None:
            self._kept_alive.pop(key, None)
        else:
            self._kept_alive[key] = array
        self._records["int_args"][op, thread, index] = word

    def _append_row(self):
        if self._n_ops == len(self._records):
            grown = buffers.zeros((2 * len(self._records), self.n_threads), RECORD)
            grown[:self._n_ops] = self._records
            self._records = grown
        self._n_ops += 1
        return self._n_ops - 1


def _encode_int(value, name):
    """An integer argument as ``(u64 word, array to keep alive or None)``."""
    if type(value) is int and 0 <= value < 2**64:     # most arguments: addresses and sizes
        return value, None
    if isinstance(value, np.ndarray):
        if value.size == 0:
            raise ValueError(f"{name}: empty array has no data to point at")
        return value.ctypes.data, value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = int(value)
        if not -2**63 <= value < 2**64:
            raise ValueError(f"{name}: {value} does not fit in 64 bits")
        return value % 2**64, None          # two's complement for negative values
    raise ValueError(f"{name}: expected an integer or a numpy array, got {type(value).__name__}")
