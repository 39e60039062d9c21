"""A file changed under its mapping ends the process with one line that names the file.

llambda reads weights straight from read-only mappings. When a mapped file is truncated
or rewritten in place (``cp new.llb old.llb`` while ``llambda run`` uses it), the next
read of a page past the new end raises SIGBUS, which kills the process with no message.
Python cannot handle it: its signal handler only sets a flag and returns, the faulting
load runs again and faults again (and inside a kernel the interpreter never runs at all).

So a tiny native handler is installed with sigaction(SA_SIGINFO): it looks the fault
address (``siginfo.si_addr``) up in a table of the mapped ranges, writes that range's
message to stderr with write(2) and ends the process with exit_group(135), 128 + SIGBUS,
as if the signal had killed it. It calls no libc function and touches no Python state:
everything it needs (the messages) is prepared when a file is mapped.

The handler's code is built with the kernels into the kernel library
(codegen/sigbus.py, which also fixes the table's layout), so a wheel ships it inside its
library and nothing generates it at run time. It is copied out of the library into a page
of its own, with the table's address patched in. The table is kept from the first
``guard`` on; the handler is installed as soon as a library is there: at a ``guard`` when
one is built or packaged, else when runtime/library.py loads the one it builds (``arm``).
Without a library, or on another platform, a SIGBUS ends the process as before.
"""
import ctypes
import mmap
import os
import platform
import signal
import struct
import sys
import threading
import weakref

from ..codegen import sigbus

CAPACITY = 256                          # mapped ranges known at once
EXIT_STATUS = sigbus.EXIT_STATUS
assert EXIT_STATUS == 128 + int(signal.SIGBUS)
_SA_SIGINFO = 4
_SA_ONSTACK = 0x08000000

_lock = threading.Lock()
_state = None                           # _Table, or False where no table can be kept
_messages = {}                          # slot -> bytes kept alive while the range is mapped
_pending = []                           # slots whose mappings died, to forget under the lock


def guard(mapping, path):
    """Name ``path`` in the message of a SIGBUS inside ``mapping`` (an mmap.mmap), for as
    long as the mapping lives. Best effort: never raises."""
    try:
        state = _table()
        if not state or len(mapping) == 0:
            return
        import numpy as np
        start = np.frombuffer(mapping, np.uint8).ctypes.data
        message = (f"llambda: {os.fspath(path)} changed while in use (it was truncated or written over "
                   "while mapped; SIGBUS): stopping. Replace a model file by writing a new one and renaming "
                   "it, never in place\n").encode("utf-8", "replace")
        slot = state.add(start, start + len(mapping), message)
        if slot is not None:
            weakref.finalize(mapping, state.remove, slot)
        arm()
    except Exception:       # noqa: BLE001 - a missing guard must never stop a load
        return


def arm(kernels=None):
    """Install the handler, once, from ``kernels`` (a loaded KernelLibrary) or else from the
    library already built or packaged; True when it is installed. Never raises, never builds."""
    try:
        state = _table()
        if not state:
            return False
        with _lock:
            if state.handler is None:
                code = _handler_code(kernels)
                if code is None:
                    return False
                state.install(code)
            return True
    except Exception:       # noqa: BLE001 - no library, not Linux x86-64
        return False


def _install():
    """The table, with the handler installed when a library has it (tests call this)."""
    arm()
    return _state


def _table():
    global _state
    with _lock:
        if _state is None:
            try:
                _state = _Table() if sys.platform == "linux" else False
            except Exception:       # noqa: BLE001
                _state = False
        return _state


class _Table:
    def __init__(self):
        words = sigbus.HEADER_WORDS + sigbus.ENTRY_WORDS * CAPACITY
        self.table = (ctypes.c_uint64 * words)()
        self.free = list(range(CAPACITY))
        self.used = {}
        self.handler = None             # the address of the installed handler's copy
        fallback = b"llambda: bus error (SIGBUS) outside llambda's mapped files: stopping\n"
        self.fallback = ctypes.create_string_buffer(fallback, len(fallback))
        self.table[1] = ctypes.addressof(self.fallback)
        self.table[2] = len(fallback)

    def install(self, code):
        """Copy the handler's ``code`` with this table's address patched in, and install it."""
        code = code.replace(struct.pack("<Q", sigbus.TABLE_PLACEHOLDER),
                            struct.pack("<Q", ctypes.addressof(self.table)))
        address = _executable(code)
        _sigaction(signal.SIGBUS, address)
        self.handler = address

    def add(self, start, end, message):
        with _lock:
            self._drain()
            if not self.free:
                return None
            slot = self.free.pop()
            buffer = ctypes.create_string_buffer(message, len(message))
            _messages[slot] = buffer
            self.used[slot] = (start, end, ctypes.addressof(buffer), len(message))
            self._rewrite()
            return slot

    def remove(self, slot):
        # Called from the finalizer of a dead mapping, which the garbage collector may run in
        # the middle of add() on this thread (its allocations can trigger a collection): never
        # wait for the lock, leave the slot for whoever holds it (add and remove drain it).
        _pending.append(slot)
        if not _lock.acquire(blocking=False):
            return
        try:
            self._drain()
        finally:
            _lock.release()

    def _drain(self):
        """Forget the slots whose mappings died (the lock is held)."""
        changed = False
        while _pending:
            slot = _pending.pop()
            if self.used.pop(slot, None) is not None:
                _messages.pop(slot, None)
                self.free.append(slot)
                changed = True
        if changed:
            self._rewrite()

    def _rewrite(self):
        # Live entries packed at the front; the count is written last (and lowered first),
        # so a handler running meanwhile only ever reads complete entries.
        table = self.table
        table[0] = 0
        entries = list(self.used.values())
        for i, entry in enumerate(entries):
            base = sigbus.HEADER_WORDS + sigbus.ENTRY_WORDS * i
            table[base:base + sigbus.ENTRY_WORDS] = list(entry)
        table[0] = len(entries)


# ---------------------------------------------------------------- the handler's code

def _handler_code(kernels=None):
    """The handler's bytes, copied from the kernel library (``kernels``, a loaded
    runtime.library.KernelLibrary, else the library already built or packaged, found
    without building); None where there is none yet, or not on Linux x86-64."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if kernels is None:
        from . import library
        where = library.locate()
        if where.origin == "unbuilt":
            return None
        kernels = library.KernelLibrary(where.directory)
    entry = kernels.manifest.get(sigbus.SYMBOL)
    if entry is None:
        return None
    address = ctypes.cast(getattr(kernels.cdll, sigbus.SYMBOL), ctypes.c_void_p).value
    code = ctypes.string_at(address, entry["code_bytes"])
    return code if code.count(struct.pack("<Q", sigbus.TABLE_PLACEHOLDER)) == 1 else None


# ---------------------------------------------------------------- libc

def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


def _executable(code):
    """Copy ``code`` into a fresh page, then make it read+execute (never writable and
    executable at once)."""
    libc = _libc()
    size = -(-len(code) // mmap.PAGESIZE) * mmap.PAGESIZE
    address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap for the SIGBUS handler failed")
    ctypes.memmove(address, code, len(code))
    if libc.mprotect(address, size, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
        raise OSError(ctypes.get_errno(), "mprotect for the SIGBUS handler failed")
    return address


class _SigAction(ctypes.Structure):
    # glibc's struct sigaction on x86-64
    _fields_ = [("sa_sigaction", ctypes.c_void_p), ("sa_mask", ctypes.c_uint64 * 16),
                ("sa_flags", ctypes.c_int), ("sa_restorer", ctypes.c_void_p)]


def _sigaction(signum, handler_address):
    libc = _libc()
    action = _SigAction()
    action.sa_sigaction = handler_address
    action.sa_flags = _SA_SIGINFO | _SA_ONSTACK
    if libc.sigaction(int(signum), ctypes.byref(action), None) != 0:
        raise OSError(ctypes.get_errno(), "sigaction(SIGBUS) failed")
