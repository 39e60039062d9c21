"""The worker pool running plans of dependent ops: same results as one thread, no deadlock, clean exits."""
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from llambda.runtime import buffers
from llambda.runtime.plan import Plan, chunk_ranges, split_range
from llambda.runtime.pool import WorkerPool, default_threads, physical_cores, pinning_order
from repo_paths import TESTS

# Generous: with 5 threads on a busy 2-core machine every barrier may wait for a time slice.
TIMEOUT_S = 120


def within_timeout(body, timeout=TIMEOUT_S):
    """Run ``body`` in a thread and fail (instead of hanging the suite) if it does not finish."""
    result = {}

    def target():
        try:
            result["value"] = body()
        except BaseException as error:      # handed to the test thread below
            result["error"] = error

    runner = threading.Thread(target=target, daemon=True)
    runner.start()
    runner.join(timeout)
    if runner.is_alive():
        pytest.fail(f"deadlock: the plan did not finish within {timeout} s")
    if "error" in result:
        raise result["error"]
    return result.get("value")


class RotatingChain:
    """A plan where every step reads what other threads wrote in the step before.

    Per step k: mirror z into w = [z, z] (two ops, no barrier between them),
    then z[j] = w[j + shift_k] + y_k[j] -- i.e. z = roll(z, -shift_k) + y_k --
    so each thread's chunk of the new z comes mostly from other threads' chunks.
    Every element is one IEEE add, so any thread count must match numpy exactly.

    ``chunk_sizes``: None splits every op statically (one range per thread); else
    one entry per op, in order: None for a static op, or the chunk size of a
    dynamic one (its chunks claimed by whichever thread comes first)."""

    def __init__(self, n, n_threads, ys, shifts, chunk_sizes=None):
        self.n, self.ys, self.shifts = n, ys, shifts
        self.z = buffers.zeros(n)
        self.w = buffers.zeros(2 * n)
        self.plan = Plan(n_threads)
        self._split = split_range(n, n_threads, multiple=16)
        self._sizes = iter(chunk_sizes or [None] * (3 * len(ys)))
        self.add_ops = []
        for y, shift in zip(ys, shifts):
            self._per_chunk("llb_copy_f32__avx2", lambda a, b: [self.z[a:], self.w[a:], b - a], barrier=False)
            self._per_chunk("llb_copy_f32__avx2", lambda a, b: [self.z[a:], self.w[n + a:], b - a])
            self.add_ops.append(self._per_chunk(
                "llb_add_f32__avx2", lambda a, b, y=y, s=shift: [self.w[a + s:], y[a:], self.z[a:], b - a]))

    def _per_chunk(self, kernel, args, barrier=True):
        size = next(self._sizes)
        if size is None:
            return self.plan.add(kernel, per_thread=[None if c is None else args(*c) for c in self._split],
                                 barrier=barrier)
        return self.plan.add(kernel, chunks=[args(*c) for c in chunk_ranges(self.n, size, 16)], barrier=barrier)

    def expected_after_one_run(self, z):
        for y, shift in zip(self.ys, self.shifts):
            z = np.roll(z, -shift) + y
        return z


def check_chain(n, n_threads, steps, runs, seed=0, chunk_sizes=None):
    rng = np.random.default_rng(seed)
    ys = [buffers.aligned_copy(rng.standard_normal(n).astype(np.float32)) for _ in range(steps)]
    shifts = [int(s) for s in rng.integers(0, n, steps)]
    chain = RotatingChain(n, n_threads, ys, shifts, chunk_sizes)
    chain.z[:] = rng.standard_normal(n).astype(np.float32)
    want = chain.z.copy()
    with WorkerPool(n_threads) as pool:
        for _ in range(runs):
            within_timeout(lambda: pool.run(chain.plan))
            want = chain.expected_after_one_run(want)
            np.testing.assert_array_equal(chain.z, want)     # exact: the same adds in any split
    return chain


@pytest.mark.parametrize("n_threads", [1, 2, 3, 5])
def test_dependent_ops_match_one_thread_over_thousands_of_barriers(n_threads):
    # 2 barriers per step + 1 at the end: 40 runs x 61 = 2440 barriers per thread.
    check_chain(n=1000, n_threads=n_threads, steps=30, runs=40)


@settings(max_examples=25)
@given(st.data(), st.sampled_from([1, 15, 16, 17, 33, 100, 257, 1000]), st.sampled_from([1, 2, 3, 5]),
       st.integers(1, 6))
def test_any_size_and_split_matches_numpy(data, n, n_threads, steps):
    rng_seed = data.draw(st.integers(0, 2**32 - 1))
    check_chain(n, n_threads, steps, runs=3, seed=rng_seed)


@pytest.mark.parametrize("n_threads", [1, 2, 3, 4])
def test_dynamic_chunks_match_one_thread_over_thousands_of_waits(n_threads):
    check_chain(n=1000, n_threads=n_threads, steps=30, runs=40, chunk_sizes=[64] * 90)


@settings(max_examples=25)
@given(st.data(), st.sampled_from([1, 16, 17, 100, 257, 1000]), st.sampled_from([1, 2, 3, 4]), st.integers(1, 6))
def test_dynamic_and_static_splits_give_identical_results(data, n, n_threads, steps):
    """Random plans mixing static ops and dynamic ones of random chunk sizes: the
    result is bit-identical to one thread's, whoever ran which chunk."""
    seed = data.draw(st.integers(0, 2**32 - 1))
    sizes = data.draw(st.lists(st.one_of(st.none(), st.sampled_from([1, 16, 32, 48, 64, 1000])),
                               min_size=3 * steps, max_size=3 * steps))
    static = check_chain(n, n_threads, steps, runs=3, seed=seed)
    dynamic = check_chain(n, n_threads, steps, runs=3, seed=seed, chunk_sizes=sizes)
    np.testing.assert_array_equal(static.z, dynamic.z)


@pytest.mark.parametrize("n_threads", [1, 2, 3, 4])
def test_every_chunk_runs_exactly_once_per_run(n_threads):
    """z[chunk] += y[chunk] in place, chunk by chunk: a chunk run twice (or never) shows
    in z; the plan's counters say each run claimed and finished every chunk once."""
    n, runs = 4096, 50
    y = buffers.full(n, 1.0)
    z = buffers.zeros(n)
    ranges = chunk_ranges(n, 16, 16)
    plan = Plan(n_threads)
    for _ in range(3):
        plan.add("llb_add_f32__avx2", chunks=[[z[a:], y[a:], z[a:], b - a] for a, b in ranges])
    with WorkerPool(n_threads) as pool:
        for run in range(1, runs + 1):
            within_timeout(lambda: pool.run(plan))
            np.testing.assert_array_equal(z, np.float32(3 * run))
    claimed, done = plan.claimed, plan.done
    np.testing.assert_array_equal(claimed, runs * len(ranges))
    np.testing.assert_array_equal(done, runs * len(ranges))
    assert plan.runs == runs


def test_patched_pointers_are_used_by_every_thread():
    n, n_threads = 200, 3
    rng = np.random.default_rng(7)
    a, b, c = (buffers.aligned_copy(rng.standard_normal(n).astype(np.float32)) for _ in range(3))
    out = buffers.full(n, np.nan)
    chunks = split_range(n, n_threads, 16)
    plan = Plan(n_threads)
    handle = plan.add("llb_add_f32__avx2", per_thread=[None if ch is None else [a[ch[0]:], b[ch[0]:], out[ch[0]:],
                                                                              ch[1] - ch[0]] for ch in chunks])
    with WorkerPool(n_threads) as pool:
        within_timeout(lambda: plan.run(pool))
        np.testing.assert_array_equal(out, a + b)
        plan.set_int_arg(handle, 1, [None if ch is None else c[ch[0]:] for ch in chunks])
        within_timeout(lambda: plan.run(pool))
        np.testing.assert_array_equal(out, a + c)


def test_a_thread_count_larger_than_the_cores_works():
    n_threads = len(os.sched_getaffinity(0)) * 2 + 1
    check_chain(n=64 * n_threads, n_threads=n_threads, steps=5, runs=5)


def test_workers_are_pinned_one_per_core_and_the_caller_is_restored():
    before = os.sched_getaffinity(0)
    order = pinning_order()
    with WorkerPool(3) as pool:
        assert pool.cpus == [order[i % len(order)] for i in range(3)]
        one_barrier = Plan(3)
        one_barrier.add("llb_copy_f32__avx2", per_thread=[None] * 3)
        # Returns once every worker has reached the barrier, so each has pinned itself.
        within_timeout(lambda: pool.run(one_barrier))
        for thread in worker_threads():
            tid = int(thread.name.rsplit("-", 1)[1])
            assert os.sched_getaffinity(thread.native_id) == {pool.cpus[tid]}
        pool.run(one_barrier)                       # pins the caller, worker 0
        assert os.sched_getaffinity(0) == {pool.cpus[0]}
    assert os.sched_getaffinity(0) == before


def worker_threads():
    return [t for t in threading.enumerate() if t.name.startswith("llambda-worker-")]


def test_close_stops_every_worker():
    assert not worker_threads()
    pool = WorkerPool(4)
    assert len(worker_threads()) == 3
    pool.run(Plan(4))
    pool.close()
    pool.close()                                    # idempotent
    assert not worker_threads()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(Plan(4))
    with WorkerPool(2) as pool:
        pass
    assert not worker_threads()
    pool = WorkerPool(3)
    del pool                                        # an unreferenced pool sends its workers home
    gc.collect()
    deadline = time.monotonic() + 10
    while worker_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker_threads()


def test_a_round_whose_caller_never_ran_is_aborted_and_the_pool_recovers():
    """What a KeyboardInterrupt between waking the workers and worker 0's native
    call leaves behind: workers spinning at the first barrier, waiting for worker 0."""
    chain = check_chain(n=300, n_threads=3, steps=4, runs=1)
    with WorkerPool(3) as pool:
        crew = pool._crew
        crew.dirty = True
        with crew.lock:
            crew.job = (chain.plan, chain.plan.start_run(), None)
            crew.round += 1
            crew.start.notify_all()
        time.sleep(0.05)
        want = chain.expected_after_one_run(chain.z.copy())
        within_timeout(lambda: pool.run(chain.plan))    # settles the stuck round first
        np.testing.assert_array_equal(chain.z, want)


def test_an_aborted_round_of_dynamic_chunks_leaves_the_plan_runnable():
    """A round abandoned half way (worker 0 never ran; a static op waits for it) leaves
    claim counts behind; the recovery zeroes them, and the next run is exact."""
    steps = 4
    sizes = [16, 16, 64] * 2 + [None, 16, 16] + [32] * 3
    chain = check_chain(n=300, n_threads=3, steps=steps, runs=1, chunk_sizes=sizes)
    with WorkerPool(3) as pool:
        crew = pool._crew
        crew.dirty = True
        with crew.lock:
            crew.job = (chain.plan, chain.plan.start_run(), None)
            crew.round += 1
            crew.start.notify_all()
        time.sleep(0.05)
        chain.z[:] = 0
        want = chain.expected_after_one_run(chain.z.copy())
        within_timeout(lambda: pool.run(chain.plan))
        np.testing.assert_array_equal(chain.z, want)
        assert chain.plan.runs == 1


def run_child(script, timeout=TIMEOUT_S, interrupts=0):
    """Run ``script`` in a fresh interpreter; send it SIGINTs after it prints 'ready'."""
    # From this folder (the script imports this module) with the shared test modules on the path.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(TESTS), os.environ.get("PYTHONPATH")))))
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=os.path.dirname(__file__), env=env)
    try:
        if interrupts:
            assert child.stdout.readline().strip() == "ready"
            rng = np.random.default_rng(1)
            for _ in range(interrupts):
                time.sleep(float(rng.uniform(0.01, 0.05)))
                child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        pytest.fail("child process hung")
    assert child.returncode == 0, err
    return out


def test_exit_without_close_does_not_hang():
    run_child("""
        from llambda.runtime.plan import Plan
        from llambda.runtime.pool import WorkerPool
        pool = WorkerPool(3)
        pool.run(Plan(3))
    """, timeout=60)


def test_keyboard_interrupts_leave_the_pool_usable():
    """SIGINTs land wherever the main thread happens to be in run(); after each the
    pool must still run the plan correctly. (Signals that arrive while worker 0 is
    in native code coalesce, so the child counts at least one, not all.)"""
    out = run_child("""
        import time
        from test_pool import RotatingChain
        from llambda.runtime import buffers
        from llambda.runtime.pool import WorkerPool
        n, steps = 512, 40
        ys = [buffers.full(n, 1.0) for _ in range(steps)]
        chain = RotatingChain(n, 3, ys, [7] * steps)
        interrupted = 0
        with WorkerPool(3) as pool:
            print("ready", flush=True)
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                try:
                    while time.monotonic() < end:
                        pool.run(chain.plan)
                except KeyboardInterrupt:
                    interrupted += 1
            chain.z[:] = 0
            pool.run(chain.plan)
            assert (chain.z == steps).all(), chain.z
        print("interrupted", interrupted)
    """, interrupts=10)
    assert "interrupted" in out and "interrupted 0" not in out


def test_thread_counts_come_from_the_cores_or_the_environment(monkeypatch):
    monkeypatch.delenv("LLAMBDA_THREADS", raising=False)
    assert default_threads() == len(physical_cores()) >= 1
    assert sorted(cpu for core in physical_cores() for cpu in core) == sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("LLAMBDA_THREADS", "3")
    assert default_threads() == 3
    with WorkerPool() as pool:
        assert pool.n_threads == 3
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv("LLAMBDA_THREADS", bad)
        with pytest.raises(ValueError, match="LLAMBDA_THREADS: expected an integer >= 1"):
            default_threads()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n_threads: expected an integer >= 1"):
            WorkerPool(bad)
    assert not worker_threads()


def test_a_run_counted_but_never_published_is_reset():
    """An interrupt between the plan counting a run and the round starting: the next run
    must not look for chunks of a run that never happened."""
    chain = check_chain(n=300, n_threads=2, steps=3, runs=1, chunk_sizes=[16] * 9)
    with WorkerPool(2) as pool:
        pool.run(chain.plan)
        crew = pool._crew
        crew.dirty = True
        crew.started = chain.plan
        chain.plan.start_run()                          # ... and the interrupt lands here
        want = chain.expected_after_one_run(chain.z.copy())
        within_timeout(lambda: pool.run(chain.plan))
        np.testing.assert_array_equal(chain.z, want)
