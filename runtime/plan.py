"""A plan: the kernel calls of one token, written once, run many times by the worker pool.

    plan = Plan(pool.n_threads)
    chunks = split_range(n, plan.n_threads, multiple=16)
    h = plan.add("llb_add_f32__avx2",
                 per_thread=[None if c is None else [a_ptr + 4 * c[0], b_ptr + 4 * c[0],
                                                     out_ptr + 4 * c[0], c[1] - c[0]]
                             for c in chunks])
    h2 = plan.add("llb_add_f32__avx2",       # or: chunks that any thread may claim
                  chunks=[[a_ptr + 4 * c[0], b_ptr + 4 * c[0], out_ptr + 4 * c[0], c[1] - c[0]]
                          for c in chunk_ranges(n, 64)])
    plan.run(pool)                  # every thread enters native code once
    plan.set_int_arg(h, 3, 7)       # patch an argument for the next run: no rebuild
    stamps = plan.stamp_buffer()
    plan.run(pool, stamps)          # the same, timed: per-op TSC readings in stamps

The plan is an array of op records, ``[n_ops][n_threads]``, that
``llb_run_plan__avx2`` (codegen/executor.py) walks. A static op (``per_thread``,
``int_args``): thread t calls the kernel of record ``[op][t]`` with that
record's arguments. A dynamic op (``chunks``): its chunk records sit in a
second array, and each thread claims chunks until none is left, so a thread
that another process keeps off its core delays the others only by the chunk
it holds. If the op has a barrier, every thread then waits until the op (and
every op since the last barrier) is finished. The caller splits the work so
that records write disjoint, cache-line aligned ranges (``split_range`` per
thread, ``chunk_ranges`` per chunk).

Record layout (RECORD, 128 bytes; must match codegen/executor.py):

    fn          u64      kernel address; 0: this thread has nothing to do
    float_args  f32[2]   passed in xmm0, xmm1
    barrier     u32      1: wait after this op until it is finished (same in every record of the op)
    chunks      u32      0: a static op; n: a dynamic op of n chunk records (int_args[0]: the first)
    int_args    u64[13]  integer and pointer args in System V order (6 in registers, 7 on the stack)

The plan also owns the executor's state (one line of counters per op) and
counts its runs; the pool passes both to the executor.

The plan checks what it can: argument counts against the kernel's signature,
integer ranges, finite floats. It cannot check that a pointer points at a
buffer big enough for what the kernel does with it: whoever adds an op
validates its buffers first (as the bindings in runtime/native do), and
passing numpy arrays rather than addresses keeps the buffers alive as long as
the plan refers to them.
"""
import ctypes
import functools
import itertools

import numpy as np

from . import buffers
from . import validate as v

from ..codegen.contract import (BARRIER_OFFSET, CHUNKS_OFFSET, FLOAT_ARGS_OFFSET, FN_OFFSET, INT_ARGS_OFFSET,
                                MAX_FLOAT_ARGS, MAX_INT_ARGS, RECORD_BYTES, STAMP_WORDS, STATE_LINE_BYTES,
                                CLAIMED_OFFSET, DONE_OFFSET)

RECORD = np.dtype({
    "names": ["fn", "float_args", "barrier", "chunks", "int_args"],
    "formats": [np.uint64, (np.float32, MAX_FLOAT_ARGS), np.uint32, np.uint32, (np.uint64, MAX_INT_ARGS)],
    "offsets": [FN_OFFSET, FLOAT_ARGS_OFFSET, BARRIER_OFFSET, CHUNKS_OFFSET, INT_ARGS_OFFSET],
    "itemsize": RECORD_BYTES,
})
STATE_WORDS = STATE_LINE_BYTES // 8
MAX_CHUNKS = 2**31 - 1

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


def chunk_ranges(n, size, multiple=1):
    """Split ``[0, n)`` into chunks of ``size`` (rounded up to a multiple of ``multiple``),
    the last one shorter: the ``(start, stop)`` of each, every start a multiple of ``multiple``.

    With ``multiple=16`` float32 outputs no two chunks write the same 64-byte line of a
    64-byte aligned buffer, whichever threads run them."""
    n = v.positive_int("n", n)
    multiple = v.positive_int("multiple", multiple)
    size = -(-v.positive_int("size", size) // multiple) * multiple
    return [(start, min(start + size, n)) for start in range(0, n, size)]


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
        self._chunks = buffers.zeros(_INITIAL_OPS, RECORD)     # the chunk records of dynamic ops
        self._n_chunks = 0
        self._state = buffers.zeros((_INITIAL_OPS, STATE_WORDS), np.uint64)
        self._runs = 0                # runs started since the state was last zeroed
        self._n_ops = 0
        self._arity = []              # per op: (int args, float args)
        self._first_chunk = []        # per op: index of its first chunk record, None for a static op
        self._kept_alive = {}         # (op, thread or ("chunk", c), index) -> array whose address is in a record
        self._slots_cache = {}        # (handles, index) -> where set_int_arg_of_ops writes
        self._symbols = []            # per op: its kernel's library symbol, None for a ctypes function
        self._all_dynamic = (0, True)  # (n_ops when last counted, every op dynamic)
        self._address_cache = None     # ((records, chunks, state), their addresses)

    @property
    def n_ops(self):
        return self._n_ops

    @property
    def records(self):
        """The live records, ``[n_ops][n_threads]`` of RECORD (a view: read it, don't keep it)."""
        return self._records[:self._n_ops]

    def chunk_records(self, handle):
        """The chunk records of dynamic op ``handle`` (a view), or None for a static op."""
        first = self._first_chunk[self._check_handle(handle)]
        if first is None:
            return None
        return self._chunks[first:first + int(self._records["chunks"][handle, 0])]

    @property
    def state(self):
        """The executor's counters, u64 ``[n_ops][STATE_WORDS]`` (a view: read it, don't keep it)."""
        return self._state[:self._n_ops]

    @property
    def claimed(self):
        """Per op, the chunks claimed over every run since the state was zeroed (a copy)."""
        return self.state[:, CLAIMED_OFFSET // 8].copy()

    @property
    def done(self):
        """Per op, the records finished (chunks, or one per thread for a static op), likewise."""
        return self.state[:, DONE_OFFSET // 8].copy()

    @property
    def runs(self):
        return self._runs

    @property
    def all_dynamic(self):
        """True when every op is a dynamic one: then any number of threads from one up to
        ``n_threads`` can run the plan (each claims chunks until none is left)."""
        if self._all_dynamic[0] != self._n_ops:         # ops are only ever appended
            self._all_dynamic = (self._n_ops, bool(np.all(self._records["chunks"][:self._n_ops, 0] > 0)))
        return self._all_dynamic[1]

    def start_run(self):
        """What the pool hands the executor for the next run: the arrays (kept alive by
        the caller while any thread may still read them), the run's number, from 1, and
        the arrays' addresses (records, chunks, state)."""
        self._runs += 1
        return self._records, self._n_ops, self._chunks, self._state, self._runs, self._addresses()

    def _addresses(self):
        """The addresses of the records, chunks and state, kept while those arrays are the
        plan's (they are replaced only as it grows): numpy's ``.ctypes.data`` builds an
        object each call, and a decode step's Python runs with cold caches."""
        arrays = (self._records, self._chunks, self._state)
        if self._address_cache is None or any(a is not b for a, b in zip(arrays, self._address_cache[0])):
            self._address_cache = (arrays, tuple(a.ctypes.data for a in arrays))
        return self._address_cache[1]

    def reset_state(self):
        """Zero the counters after an aborted run (no thread may be running the plan)."""
        self._state[:] = 0
        self._runs = 0

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

    def add(self, kernel, int_args=(), float_args=(), per_thread=None, barrier=True, chunks=None):
        """Append one op; returns its handle (the op's index) for ``set_int_arg``.

        ``kernel``: a symbol of the kernel library or a ctypes function with argtypes.
        ``int_args``: integers or numpy arrays (passed by address) for a serial
        op, run by thread 0 alone. ``per_thread``: instead of ``int_args``, one
        argument list per thread, ``None`` for a thread with nothing to do.
        ``chunks``: instead of either, one argument list per chunk of a dynamic
        op: each chunk runs once, on whichever thread claims it first.
        ``float_args``: up to two floats, the same for every thread and chunk.
        ``barrier``: every thread waits after this op until it is finished;
        pass False only when the next op does not read what this one writes."""
        if chunks is not None:
            return self._add_dynamic(kernel, int_args, float_args, per_thread, barrier, chunks)
        float_args = [v.finite_float("float_args", x) for x in float_args]
        address, n_int, n_float = self._check_kernel(kernel, float_args)
        name = "int_args" if per_thread is None else "per_thread"
        thread_words = [None if args is None else [_encode_int(arg, name) for arg in args]
                        for args in self._thread_args(int_args, per_thread, n_int)]
        op = self._append_row()
        self._first_chunk.append(None)
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
        self._symbols.append(kernel if isinstance(kernel, str) else None)
        return op

    def _add_dynamic(self, kernel, int_args, float_args, per_thread, barrier, chunks):
        if len(int_args) or per_thread is not None:
            raise ValueError("chunks: give one of int_args, per_thread or chunks")
        float_args = [v.finite_float("float_args", x) for x in float_args]
        address, n_int, n_float = self._check_kernel(kernel, float_args)
        chunks = list(chunks)
        if not 0 < len(chunks) <= MAX_CHUNKS:
            raise ValueError(f"chunks: expected 1..{MAX_CHUNKS} argument lists, got {len(chunks)}")
        for c, args in enumerate(chunks):
            if args is None:
                raise ValueError(f"chunks[{c}]: every chunk needs its arguments (None is for per_thread)")
            self._check_arg_count(f"chunks[{c}]", list(args), n_int)
        words = _plain_words(chunks)        # the common case: all plain integers, in one array
        chunk_words = None if words is not None else [[_encode_int(arg, "chunks") for arg in args]
                                                      for args in chunks]
        first = self._append_chunks(len(chunks))
        rows = self._chunks[first:first + len(chunks)]
        rows["fn"] = address
        rows["float_args"][:, :n_float] = float_args
        if words is not None:
            if n_int:
                rows["int_args"][:, :n_int] = words
        else:
            for c, encoded in enumerate(chunk_words):
                for i, word in enumerate(encoded):
                    self._write_chunk_int(first + c, i, word)
        op = self._append_row()
        self._first_chunk.append(first)
        self._records["barrier"][op] = 1 if barrier else 0
        self._records["chunks"][op] = len(chunks)
        self._records["int_args"][op, :, 0] = first
        self._arity.append((n_int, n_float))
        self._symbols.append(kernel if isinstance(kernel, str) else None)
        return op

    def _check_kernel(self, kernel, float_args):
        address, n_int, n_float = kernel_address(kernel)
        if n_int > MAX_INT_ARGS or n_float > MAX_FLOAT_ARGS:
            raise ValueError(f"kernel: takes {n_int} integer and {n_float} float arguments; an op record "
                             f"holds at most {MAX_INT_ARGS} and {MAX_FLOAT_ARGS}")
        if len(float_args) != n_float:
            raise ValueError(f"float_args: the kernel takes {n_float} float arguments, got {len(float_args)}")
        return address, n_int, n_float

    def set_int_arg(self, handle, index, value):
        """Patch integer argument ``index`` of op ``handle`` before the next run.

        ``value``: one integer or array for every thread (every chunk of a dynamic
        op), or a sequence with one per thread (per chunk); ``None`` in it leaves
        that thread's argument as it is."""
        handle = self._check_handle(handle)
        n_int, _ = self._arity[handle]
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < n_int:
            raise ValueError(f"index: op {handle} has integer arguments 0..{n_int - 1}, got {index!r}")
        first = self._first_chunk[handle]
        count = self.n_threads if first is None else int(self._records["chunks"][handle, 0])
        what = "thread" if first is None else "chunk"
        if isinstance(value, (list, tuple)):
            if len(value) != count:
                raise ValueError(f"value: expected one value per {what} ({count}), got {len(value)}")
            words = [None if x is None else _encode_int(x, "value") for x in value]
        else:
            words = [_encode_int(value, "value")] * count
        for t, word in enumerate(words):
            if word is None:
                continue
            if first is None:
                self._write_int(handle, t, index, word)
            else:
                self._write_chunk_int(first + t, index, word)

    def set_int_arg_of_ops(self, handles, index, value):
        """Patch integer argument ``index`` of every op in ``handles`` (and each of its
        chunks) to the integer ``value``: one numpy write, for per-token patches."""
        key = (tuple(handles), index)
        slots = self._slots_cache.get(key)
        if slots is None:
            for handle in handles:
                n_int, _ = self._arity[self._check_handle(handle)]
                if not 0 <= index < n_int:
                    raise ValueError(f"index: op {handle} has integer arguments 0..{n_int - 1}, got {index!r}")
            static = np.array([h for h in handles if self._first_chunk[h] is None], dtype=np.intp)
            chunk_rows = [np.arange(self._first_chunk[h], self._first_chunk[h] + int(self._records["chunks"][h, 0]))
                          for h in handles if self._first_chunk[h] is not None]
            slots = (static, np.concatenate(chunk_rows) if chunk_rows else np.zeros(0, np.intp))
            self._slots_cache[key] = slots
        word = _encode_int(value, "value")[0]
        static, chunk_rows = slots
        if static.size:
            self._records["int_args"][static, :, index] = word
        if chunk_rows.size:
            self._chunks["int_args"][chunk_rows, index] = word

    def set_barrier(self, handle, barrier=True):
        """Make every thread wait after op ``handle`` (or not)."""
        self._records["barrier"][self._check_handle(handle)] = 1 if barrier else 0

    def set_float_arg(self, handle, index, value):
        """Patch float argument ``index`` of op ``handle`` (the same for every thread)."""
        _, n_float = self._arity[self._check_handle(handle)]
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < n_float:
            raise ValueError(f"index: op {handle} has {n_float} float arguments, got index {index!r}")
        handle = int(handle)
        value = v.finite_float("value", value)
        self._records["float_args"][handle, :, index] = value
        rows = self.chunk_records(handle)
        if rows is not None:
            rows["float_args"][:, index] = value

    def run(self, pool, stamps=None):
        """Run every op once on ``pool`` (a runtime.pool.WorkerPool with as many threads);
        timed into ``stamps`` (from ``stamp_buffer``) when given."""
        pool.run(self, stamps)

    # -- kept on disk (runtime/plan_cache.py) ------------------------------------------
    def parts(self):
        """What runtime/plan_cache.py stores: ``(records, chunk records, per-op (int, float)
        arity, per-op first chunk or None, per-op kernel symbol or None)``; views, not copies."""
        return (self._records[:self._n_ops], self._chunks[:self._n_chunks], list(self._arity),
                list(self._first_chunk), list(self._symbols))

    @classmethod
    def from_parts(cls, n_threads, records, chunks, arity, first_chunk, symbols):
        """A plan made of records that another plan's ``parts()`` gave, their addresses
        already moved to this process's buffers (plan_cache checks them first)."""
        plan = cls(n_threads)
        n_ops, n_chunks = len(records), len(chunks)
        if records.shape[1:] != (plan.n_threads,) or not len(arity) == len(first_chunk) == len(symbols) == n_ops:
            raise ValueError("from_parts: the parts do not belong to one plan of this many threads")
        plan._records = buffers.zeros((max(n_ops, _INITIAL_OPS), plan.n_threads), RECORD)
        plan._records[:n_ops] = records
        plan._chunks = buffers.zeros(max(n_chunks, _INITIAL_OPS), RECORD)
        plan._chunks[:n_chunks] = chunks
        plan._state = buffers.zeros((len(plan._records), STATE_WORDS), np.uint64)
        plan._n_ops, plan._n_chunks = n_ops, n_chunks
        plan._arity = [tuple(a) for a in arity]
        plan._first_chunk = list(first_chunk)
        plan._symbols = list(symbols)
        return plan

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

    def _write_chunk_int(self, row, index, encoded):
        word, array = encoded
        key = (("chunk", row), index)
        if array is None:
            self._kept_alive.pop(key, None)
        else:
            self._kept_alive[key] = array
        self._chunks["int_args"][row, index] = word

    def _append_chunks(self, count):
        """Room for ``count`` more chunk records; the index of the first."""
        if self._n_chunks + count > len(self._chunks):
            grown = buffers.zeros(max(2 * len(self._chunks), self._n_chunks + count), RECORD)
            grown[:self._n_chunks] = self._chunks[:self._n_chunks]
            self._chunks = grown
        self._n_chunks += count
        return self._n_chunks - count

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
        if self._runs or self._n_ops == len(self._state):
            # New arrays, not writes into the old ones: a thread still walking an
            # earlier run reads those, and a new op needs counters of run 0.
            self._state = buffers.zeros((len(self._records), STATE_WORDS), np.uint64)
            self._runs = 0
        self._n_ops += 1
        return self._n_ops - 1


def _plain_words(arg_lists):
    """``arg_lists`` as a u64 array when every argument is a plain int in [0, 2**64), else None."""
    if set(map(type, itertools.chain.from_iterable(arg_lists))) - {int}:
        return None
    try:
        return np.array(arg_lists, dtype=np.uint64)
    except (OverflowError, ValueError):
        return None                 # a negative or too large value: the slow path explains it


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
