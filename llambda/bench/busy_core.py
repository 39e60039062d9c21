"""Another process keeping one CPU busy: the "machine shared with other work" scenario.

    with busy_core(1):          # a child process spins on CPU 1 until the block ends
        ... measure ...

``llambda bench --busy-core CPU`` measures under it, so the scenario (one of the
cores taken by a process that never sleeps) is one command to reproduce. The
spinner is a plain Python loop pinned to the CPU, the same load as
``taskset -c CPU python3 -c 'while 1: pass'``.
"""
import contextlib
import os
import subprocess
import sys

from llambda.errors import UserError

_SPINNER = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def check_cpu(cpu):
    """``cpu`` as an int, if this process may run on it (a UserError naming --busy-core if not)."""
    allowed = sorted(os.sched_getaffinity(0))
    if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu not in allowed:
        raise UserError(f"--busy-core: expected one of the CPUs this process may use {allowed}, got {cpu!r}")
    return cpu


@contextlib.contextmanager
def busy_core(cpu):
    """Run a spinning child process pinned to ``cpu`` (None: do nothing) for the block."""
    if cpu is None:
        yield None
        return
    child = subprocess.Popen([sys.executable, "-c", _SPINNER, str(check_cpu(cpu))],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        yield child
    finally:
        child.kill()
        child.wait()
