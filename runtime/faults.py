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

The handler is x86-64 code generated with PeachPy (``_emit``), keyed by this module's
source (``handler_name``). A wheel ships its bytes beside the packaged kernel library
(codegen/wheel_hook.py writes them), so an install without PeachPy has the handler; a
checkout builds them once into the user cache. Either way a load imports no PeachPy. Where
neither the bytes nor PeachPy exist, or on another platform, ``guard`` does nothing and a
SIGBUS ends the process as before.

Table layout (u64 words), at a fixed address patched into the handler's code::

    [0] count  [1] fallback message address  [2] its length  [3] unused
    then CAPACITY entries of [start, end, message address, message length]
"""
import ctypes
import functools
import hashlib
import mmap
import os
import platform
import signal
import struct
import sys
import threading
import weakref

CAPACITY = 256                          # mapped ranges known at once
_HEADER_WORDS = 4
_ENTRY_WORDS = 4
_PLACEHOLDER = 0x1122334455667788       # the table address, patched into the code
EXIT_STATUS = 128 + int(signal.SIGBUS)
_SA_SIGINFO = 4
_SA_ONSTACK = 0x08000000

_lock = threading.Lock()
_state = None                           # _Installed, or False where no handler can be had
_messages = {}                          # slot -> bytes kept alive while the range is mapped
_pending = []                           # slots whose mappings died, to forget under the lock


def guard(mapping, path):
    """Name ``path`` in the message of a SIGBUS inside ``mapping`` (an mmap.mmap), for as
    long as the mapping lives. Best effort: never raises."""
    try:
        state = _install()
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
    except Exception:       # noqa: BLE001 - a missing guard must never stop a load
        return


def _install():
    global _state
    with _lock:
        if _state is None:
            try:
                _state = _Installed(_handler_code())
            except Exception:       # noqa: BLE001 - no PeachPy, no cache, not Linux x86-64
                _state = False
        return _state


class _Installed:
    def __init__(self, code):
        if code is None:
            raise OSError("no SIGBUS handler code")
        words = _HEADER_WORDS + _ENTRY_WORDS * CAPACITY
        self.table = (ctypes.c_uint64 * words)()
        self.free = list(range(CAPACITY))
        self.used = {}
        fallback = b"llambda: bus error (SIGBUS) outside llambda's mapped files: stopping\n"
        self.fallback = ctypes.create_string_buffer(fallback, len(fallback))
        self.table[1] = ctypes.addressof(self.fallback)
        self.table[2] = len(fallback)
        code = code.replace(struct.pack("<Q", _PLACEHOLDER), struct.pack("<Q", ctypes.addressof(self.table)))
        self.code_address = _executable(code)
        _sigaction(signal.SIGBUS, self.code_address)

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
            base = _HEADER_WORDS + _ENTRY_WORDS * i
            table[base:base + _ENTRY_WORDS] = list(entry)
        table[0] = len(entries)


# ---------------------------------------------------------------- the handler's code

def _emit():
    """The handler's machine code (PeachPy): void handler(int sig, siginfo_t *info, void *ctx)."""
    from peachpy import Argument, int32_t, ptr
    from peachpy.x86_64 import (ADD, CMP, JAE, JB, JMP, JZ, LABEL, LEA, MOV, RETURN, SUB, SYSCALL, TEST,
                                Function, Label, abi, eax, edi, qword, r8, r9, rax, rcx, rdx, rsi)
    sig = Argument(int32_t, name="sig")
    info = Argument(ptr(), name="info")
    context = Argument(ptr(), name="context")
    with Function("llb_sigbus_handler", (sig, info, context)) as function:
        scan, next_entry, not_ours, report = Label("scan"), Label("next"), Label("not_ours"), Label("report")
        MOV(r8, _PLACEHOLDER)                   # the table
        MOV(rax, qword[rsi + 16])               # info->si_addr
        MOV(rcx, qword[r8])                     # how many entries
        LEA(r9, [r8 + 8 * _HEADER_WORDS])       # the first
        LABEL(scan)
        TEST(rcx, rcx)
        JZ(not_ours)
        CMP(rax, qword[r9])                     # start <= addr < end
        JB(next_entry)
        CMP(rax, qword[r9 + 8])
        JAE(next_entry)
        MOV(rsi, qword[r9 + 16])
        MOV(rdx, qword[r9 + 24])
        JMP(report)
        LABEL(next_entry)
        ADD(r9, 8 * _ENTRY_WORDS)
        SUB(rcx, 1)
        JMP(scan)
        LABEL(not_ours)
        MOV(rsi, qword[r8 + 8])
        MOV(rdx, qword[r8 + 16])
        LABEL(report)
        MOV(eax, 1)                             # write(2, message, length)
        MOV(edi, 2)
        SYSCALL()
        MOV(eax, 231)                           # exit_group(128 + SIGBUS)
        MOV(edi, EXIT_STATUS)
        SYSCALL()
        RETURN()
    return bytes(function.finalize(abi.system_v_x86_64_abi).encode().code_section.content)


@functools.lru_cache(maxsize=None)
def handler_name():
    """The file name of this module's handler bytes: keyed by its source, so bytes built from
    another version of it are never taken."""
    with open(__file__, "rb") as f:
        key = hashlib.sha256(f.read()).hexdigest()[:16]
    return f"sigbus-handler-{key}.bin"


def _packaged_path():
    # runtime/library.py's PACKAGED_DIR, without importing it (and numpy) here
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", handler_name())


def _cache_path():
    from .paths import cache_dir
    return cache_dir() / "kernels" / handler_name()


def _read_code(path):
    try:
        with open(path, "rb") as f:
            code = f.read()
    except OSError:
        return None
    return code if struct.pack("<Q", _PLACEHOLDER) in code else None


def _handler_code():
    """The handler's bytes: packaged with a wheel, else from the cache, else generated (and
    cached); None when none of these."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    code = _read_code(_packaged_path())
    if code is not None:
        return code
    path = _cache_path()
    code = _read_code(path)
    if code is not None:
        return code
    try:
        code = _emit()
    except ImportError:
        return None
    try:
        from . import atomic
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic.create(path) as f:
            f.write(code)
    except OSError:
        pass
    return code


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
