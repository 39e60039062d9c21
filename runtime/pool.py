"""The worker pool: N pinned threads that run a plan together, entering native code once each.

    with WorkerPool(2) as pool:     # or WorkerPool() for default_threads()
        plan.run(pool)              # == pool.run(plan)

Threads are started once and each pins itself to its own core; the calling
thread is worker 0, so a one-thread pool runs plans with no handoff at all.
Per plan, the pool wakes the workers once (a condition variable) and every
thread calls ``llb_run_plan__avx2`` through ctypes, which releases the GIL;
between ops they wait for each other's work inside the generated code, not in
Python. That wait counts finished work, not arrived threads (codegen/executor.py):
run() returns when worker 0 has seen the whole plan finished, while a worker
whose core was taken by another process may still be walking the ops it
missed, finding them done. The job it holds keeps the plan's arrays alive
until it is back. A sleeping worker joins a run only after its wake-up latency
(paid once per plan), and starts on whatever
chunks are left.

A run takes the pool's first workers only, the others not woken: ``plan.n_threads``
of them (a plan may be built for fewer threads than the pool has), or fewer still with
``pool.run(plan, threads=k)`` when every op of the plan is a dynamic one (the k workers
claim all its chunks between them; what a chunk computes does not depend on who runs
it). runtime/thread_choice.py picks k per plan from measured run times.

``pool.run(plan, stamps=plan.stamp_buffer())`` runs the executor's timed
twin instead, which writes per-op time-stamp counter readings into
``stamps`` (layout in codegen/executor.py; ``read_tsc`` reads the same clock
from Python, to convert ticks to seconds). Without ``stamps`` nothing of it
runs: the profiler costs nothing when it is off.

Between plans the workers sleep in Python, never in native code. A
KeyboardInterrupt that lands in the middle of ``run`` leaves the pool usable:
the next ``run`` (or ``close``) first raises the sync block's abort flag if
worker 0 never ran its share (so nobody spins waiting for it), waits for the
workers to come back, clears the sync block and zeroes the interrupted plan's
counters.
"""
import os
import threading
import weakref

import numpy as np

from . import buffers
from . import cpu_usage
from . import validate as v

THREADS_ENV = "LLAMBDA_THREADS"
SYNC_LINE_WORDS = 8          # one 64-byte line of u64: the abort flag (see codegen/executor.py)
ABORT_WORD = 0
JOIN_TIMEOUT_S = 5.0


def _parse_cpu_list(text):
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def physical_cores():
    """The CPUs this process may run on, grouped by physical core: ``[[cpu, sibling...], ...]``.

    Hyperthread siblings come from sysfs; where it is unreadable every CPU counts as a core."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = {}
    for cpu in allowed:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                siblings = tuple(c for c in _parse_cpu_list(f.read()) if c in allowed) or (cpu,)
        except (OSError, ValueError):
            siblings = (cpu,)
        cores.setdefault(siblings, sorted(siblings))
    return sorted(cores.values())


def pinning_order():
    """CPUs to pin workers 0, 1, 2, ... to: one per physical core first, then their siblings."""
    cores = physical_cores()
    depth = max(len(c) for c in cores)
    return [core[level] for level in range(depth) for core in cores if level < len(core)]


def default_threads():
    """``$LLAMBDA_THREADS`` if set, else the number of physical cores this process may use."""
    text = os.environ.get(THREADS_ENV)
    if text is None or not text.strip():
        return len(physical_cores())
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or n < 1:
        raise ValueError(f"{THREADS_ENV}: expected an integer >= 1, got {text!r}")
    return n


class _Crew:
    """What the worker threads share with the pool.

    Kept apart from WorkerPool so that the threads do not keep the pool alive:
    an unreferenced pool is collected and its finalizer sends the crew home."""

    def __init__(self, n_threads, run_plan, run_plan_timed):
        self.n_threads = n_threads
        self.run_plan = run_plan
        self.run_plan_timed = run_plan_timed
        self.sync = buffers.zeros(SYNC_LINE_WORDS, np.uint64)
        self.sync_at = self.sync.ctypes.data
        self.lock = threading.Lock()
        self.start = threading.Condition(self.lock)     # workers wait here for a round
        self.done = threading.Condition(self.lock)      # settle() waits here for the others
        self.round = 0                  # rounds requested so far
        self.assigned = [0] * n_threads     # last round each worker was asked to run
        self.finished = [0] * n_threads     # last round each worker finished (index 0: worker 0)
        self.thread_ids = [None] * n_threads    # each worker's native thread id, once started
        self.job = None                 # (plan, plan.start_run(), stamps or None, workers) of the current round
        self.aborting = False           # workers woken during a recovery skip the plan
        self.closing = False
        self.dirty = False              # worker 0 may not have run its share of the last round
        self.started = None             # the plan of the last round begun

    def work(self, tid, cpu):
        """A worker thread's life: sleep until a round, run its share, report, repeat."""
        _pin(cpu)
        self.thread_ids[tid] = threading.get_native_id()
        while True:
            with self.lock:
                while self.finished[tid] == self.assigned[tid] and not self.closing:
                    self.start.wait()
                if self.closing:
                    return
                # A later round that did not wake this worker may have replaced the job it was
                # woken for: then it skips that one (its own round's plan is finished, since a
                # later round began, and that one is not its to run).
                round_, job, aborting = self.assigned[tid], self.job, self.aborting
                if job is not None and tid >= job[3]:
                    job = None
            try:
                if not aborting and job is not None:
                    self.run_share(tid, *job[:3])
            finally:
                with self.lock:
                    self.finished[tid] = round_
                    self.done.notify()

    def run_share(self, tid, plan, arrays, stamps=None):
        _, n_ops, _, _, run, (records_at, chunks_at, state_at) = arrays
        args = (records_at, n_ops, tid, plan.n_threads, self.sync_at, chunks_at, state_at, run)
        if stamps is not None:
            self.run_plan_timed(*args, stamps.ctypes.data)
        else:
            self.run_plan(*args)

    def run(self, plan, stamps=None, workers=None):
        """One round: wake the round's workers (the first ``workers``, default the plan's
        n_threads) and run worker 0's share here (timed into ``stamps``).

        No wait for the others afterwards: a plan ends with a wait for all its
        work, so when worker 0 returns every op is finished (an empty plan has
        nothing to finish). The workers catch up while the caller goes on; the
        next round finds them waiting or about to. A timed round waits for
        them: every thread's stamps are written when it returns."""
        self.settle()
        self.dirty = True
        self.started = plan             # counted a run from here on: settle() resets it if cut short
        workers = workers or plan.n_threads
        job = (plan, plan.start_run(), stamps, workers)
        with self.lock:
            self.job = job
            self.round += 1
            for tid in range(workers):
                self.assigned[tid] = self.round
            if workers > 1:
                self.start.notify_all()
        self.run_share(0, *job[:3])
        self.finished[0] = self.round
        self.dirty = False
        if stamps is not None:
            self.wait_for_workers()

    def wait_for_workers(self):
        with self.lock:
            while self.finished != self.assigned:
                self.done.wait()

    def settle(self):
        """After an interrupted round: free any spinner, wait for everyone, clear the sync block."""
        if not self.dirty:
            return
        with self.lock:
            if self.finished[0] != self.assigned[0]:
                # Worker 0 may not have run its share, and the others would wait for
                # it forever. (If it did, they are all past their last barrier and
                # never look at the flag: raising it is harmless.)
                self.aborting = True
                self.sync[ABORT_WORD] = 1
                self.finished[0] = self.assigned[0]
            self.start.notify_all()     # in case the interrupt cut the wake-up short
        self.wait_for_workers()
        self.sync[:] = 0
        for plan in {id(p): p for p in (self.started, self.job and self.job[0]) if p is not None}.values():
            plan.reset_state()
        self.aborting = False
        self.dirty = False

    def shut_down(self, threads):
        try:
            self.settle()
        finally:
            with self.lock:
                self.closing = True
                self.start.notify_all()
            for thread in threads:
                thread.join(JOIN_TIMEOUT_S)


def read_tsc():
    """The time-stamp counter now, in ticks: the clock of the timed executor's stamps."""
    from .native._lib import kernel
    out = np.zeros(1, np.uint64)
    kernel("llb_read_tsc__avx2")(out.ctypes.data)
    return int(out[0])


def _pin(cpu):
    """Pin the calling thread to ``cpu`` (None: leave it alone). A refused pin is not fatal."""
    if cpu is None:
        return
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        pass


class WorkerPool:
    """``n_threads`` pinned workers (default: ``default_threads()``), the caller being worker 0."""

    def __init__(self, n_threads=None, *, pin=True):
        if n_threads is None:
            n_threads = default_threads()
        self.n_threads = v.positive_int("n_threads", n_threads)
        order = pinning_order()
        self.cpus = [order[i % len(order)] for i in range(self.n_threads)] if pin else [None] * self.n_threads
        from .native._lib import kernel
        self._crew = _Crew(self.n_threads, kernel("llb_run_plan__avx2"), kernel("llb_run_plan_timed__avx2"))
        self._threads = [threading.Thread(target=self._crew.work, args=(tid, self.cpus[tid]),
                                          name=f"llambda-worker-{tid}", daemon=True)
                         for tid in range(1, self.n_threads)]
        for thread in self._threads:
            thread.start()
        # (thread ident, native id, affinity before pinning) of worker 0, in a box
        # the finalizer shares, so that closing restores the caller's affinity.
        self._caller_box = [None]
        self._closed = False
        self._finalizer = weakref.finalize(self, _shut_down, self._crew, self._threads, self._caller_box)

    def run(self, plan, stamps=None, threads=None):
        """Run every op of ``plan`` once on the pool's first workers, ``plan.n_threads`` of
        them or ``threads``; returns when all have finished.

        ``threads``: fewer workers than the plan was built for, which needs a plan of dynamic
        ops only (``plan.all_dynamic``); a timed run takes all of them.
        ``stamps``: a ``plan.stamp_buffer()`` to run the timed executor, which
        fills it with time-stamp counter readings (see the module docstring)."""
        if self._closed:
            raise RuntimeError("WorkerPool.run: the pool is closed")
        if plan.n_threads > self.n_threads:
            raise ValueError(f"plan: built for {plan.n_threads} threads, the pool has {self.n_threads}")
        if threads is not None and threads != plan.n_threads:
            threads = v.positive_int("threads", threads)
            if threads > plan.n_threads:
                raise ValueError(f"threads: expected 1..{plan.n_threads} (the plan's threads), got {threads}")
            if stamps is not None:
                raise ValueError(f"threads: a timed run takes all {plan.n_threads} of the plan's threads, "
                                 f"got threads={threads}")
            if not plan.all_dynamic:
                raise ValueError(f"threads: a plan with static ops needs all {plan.n_threads} of its threads, "
                                 f"got threads={threads}")
        if stamps is not None:
            v.array("stamps", stamps, np.uint64, plan.stamp_shape, align=8, writable=True)
        self._pin_caller()
        self._crew.run(plan, stamps, threads)

    def cpu_usage(self, workers):
        """runtime/cpu_usage.py's snapshot of how busy other work keeps those workers' CPUs."""
        ids = list(self._crew.thread_ids)
        ids[0] = self._caller_box[0][1] if self._caller_box[0] is not None else None
        return cpu_usage.snapshot(self.cpus, ids, workers)

    def close(self):
        """Stop the workers and unpin the caller. Idempotent; also runs at exit."""
        self._closed = True
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def sync(self):
        """The executor's sync block (one u64 line; its first word is the abort flag)."""
        return self._crew.sync

    def _pin_caller(self):
        """Pin whichever thread calls run() (worker 0) to the first CPU, remembering its old mask."""
        ident = threading.get_ident()
        previous = self._caller_box[0]
        if self.cpus[0] is None or (previous is not None and previous[0] == ident):
            return
        _restore_affinity(previous)
        self._caller_box[0] = (ident, threading.get_native_id(), os.sched_getaffinity(0))
        _pin(self.cpus[0])


def _restore_affinity(caller):
    if caller is None:
        return
    _, native_id, mask = caller
    try:
        os.sched_setaffinity(native_id, mask)
    except OSError:
        pass        # that thread is gone: nothing to restore


def _shut_down(crew, threads, caller_box):
    try:
        crew.shut_down(threads)
    finally:
        _restore_affinity(caller_box[0])
