"""Plans run on fewer workers than the pool has (a plan built for fewer threads, or
pool.run(plan, threads=k)), and the choice of that count per plan from measured run times
(runtime/thread_choice.py)."""
import numpy as np
import pytest

from llambda.runtime import buffers, thread_choice
from llambda.runtime.plan import Plan, chunk_ranges
from llambda.runtime.pool import WorkerPool
from llambda.runtime.thread_choice import (AT_A_GLANCE, FIRST_INTERVAL, FIRST_LOOK, HOPELESS, MAX_INTERVAL, SAMPLES,
                                           WARMUP_RUNS, ThreadChoice, counts)

from test_pool import within_timeout


# -- the pool: a plan of fewer threads runs on the first workers only -------------------
def counting_plan(n_threads, n=4096, ops=3, z=None):
    """ops x z += y over 16-element chunks: a chunk run twice or never shows in z."""
    y = buffers.full(n, 1.0)
    z = buffers.zeros(n) if z is None else z
    plan = Plan(n_threads)
    for _ in range(ops):
        plan.add("llb_add_f32__avx2", chunks=[[z[a:], y[a:], z[a:], b - a] for a, b in chunk_ranges(n, 16, 16)])
    return plan, z


@pytest.mark.parametrize("n_threads", [2, 3, 4])
def test_plans_of_any_thread_count_run_on_one_pool(n_threads):
    z = buffers.zeros(4096)
    plans = [counting_plan(k, z=z)[0] for k in range(1, n_threads + 1)]
    with WorkerPool(n_threads) as pool:
        for run in range(1, 61):
            within_timeout(lambda: pool.run(plans[run % n_threads]))     # interleaved
            np.testing.assert_array_equal(z, np.float32(3 * run))
    assert sum(p.runs for p in plans) == 60


def test_a_plan_for_one_thread_does_not_wake_the_others():
    one, z = counting_plan(1)
    two, _ = counting_plan(2, z=z)
    with WorkerPool(2) as pool:
        within_timeout(lambda: pool.run(two))
        pool._crew.wait_for_workers()
        woken = pool._crew.finished[1]
        for _ in range(20):
            within_timeout(lambda: pool.run(one))
        assert pool._crew.finished[1] == woken == pool._crew.assigned[1]
        within_timeout(lambda: pool.run(two))        # and it still joins a plan of two
        pool._crew.wait_for_workers()
        assert pool._crew.finished[1] == pool._crew.round
    np.testing.assert_array_equal(z, np.float32(3 * 22))


def test_static_ops_of_a_smaller_plan_run_on_its_workers():
    """A static op has one record per thread of its plan: a 2-thread plan's on a 3-worker
    pool, interleaved with 3-thread runs that leave worker 2 a round behind or not."""
    n = 64
    a = buffers.full(n, 1.0)
    z = buffers.zeros(n)
    small = Plan(2)
    small.add("llb_add_f32__avx2", per_thread=[[z, a, z, 32], [z[32:], a[32:], z[32:], 32]])
    full, _ = counting_plan(3, n=n, ops=1, z=z)
    with WorkerPool(3) as pool:
        for run in range(1, 41):
            within_timeout(lambda: pool.run(small if run % 3 else full))
            np.testing.assert_array_equal(z, np.float32(run))


def test_a_plan_for_more_threads_than_the_pool_is_refused():
    plan, _ = counting_plan(3)
    with WorkerPool(2) as pool:
        with pytest.raises(ValueError, match="built for 3 threads, the pool has 2"):
            pool.run(plan)


@pytest.mark.parametrize("n_threads", [2, 3, 4])
def test_a_dynamic_plan_runs_on_any_number_of_its_workers(n_threads):
    plan, z = counting_plan(n_threads)
    with WorkerPool(n_threads) as pool:
        for run in range(1, 61):
            threads = 1 + run % n_threads          # every count, interleaved with full runs
            within_timeout(lambda: pool.run(plan, threads=threads))
            np.testing.assert_array_equal(z, np.float32(3 * run))
        one, _ = counting_plan(n_threads, z=z)
        pool._crew.wait_for_workers()
        woken = pool._crew.finished[1:]
        for _ in range(10):
            within_timeout(lambda: pool.run(one, threads=1))
        assert pool._crew.finished[1:] == woken            # nobody else was woken
    np.testing.assert_array_equal(z, np.float32(3 * 70))
    np.testing.assert_array_equal(plan.done, 60 * (4096 // 16))


def test_fewer_workers_are_refused_where_they_cannot_run_the_plan():
    static = Plan(2)
    a = buffers.zeros(32)
    static.add("llb_add_f32__avx2", per_thread=[[a, a, a, 16], [a[16:], a[16:], a[16:], 16]])
    dynamic, _ = counting_plan(2)
    assert not static.all_dynamic and dynamic.all_dynamic
    with WorkerPool(3) as pool:
        with pytest.raises(ValueError, match="static ops needs all 2 of its threads"):
            pool.run(static, threads=1)
        for bad in (0, 3, -1, 1.5, True):
            with pytest.raises(ValueError, match="threads"):
                pool.run(dynamic, threads=bad)
        with pytest.raises(ValueError, match="a timed run takes all 2"):
            pool.run(dynamic, stamps=dynamic.stamp_buffer(), threads=1)
        within_timeout(lambda: pool.run(static, threads=2))       # all of them: as before


# -- the choice ----------------------------------------------------------------------
class FakePlan:
    def __init__(self, n_threads=2, all_dynamic=True):
        self.n_threads, self.all_dynamic = n_threads, all_dynamic


class FakePool:
    """Runs nothing; the clock advances by what ``cost(threads, run)`` says the run took."""

    def __init__(self, cost):
        self.cost, self.now, self.runs, self.log = cost, 0.0, 0, []

    def run(self, plan, threads=None):
        threads = threads or plan.n_threads
        self.runs += 1
        self.log.append(threads)
        self.now += self.cost(threads, self.runs)

    def clock(self):
        return self.now


def drive(cost, runs, n_threads=2, plan=None, choice=None, pool=None):
    pool = pool or FakePool(cost)
    choice = choice or ThreadChoice(n_threads, clock=pool.clock, adaptive=True)
    plan = plan or FakePlan(n_threads)
    for _ in range(runs):
        choice.run(pool, plan)
    return choice, plan, pool


def explorations(log, to):
    """Where runs on ``to`` threads start after runs on others."""
    return [i for i in range(1, len(log)) if log[i] == to and log[i - 1] != to]


def test_counts_halve_down_to_one():
    assert counts(1) == [1]
    assert counts(2) == [2, 1]
    assert counts(6) == [6, 3, 1]
    assert counts(8) == [8, 4, 2, 1]


def test_a_shape_faster_on_fewer_threads_moves_there_and_stays():
    choice, plan, pool = drive(lambda k, run: {2: 4.8e-3, 1: 4e-3}[k], 500)
    assert choice.current(plan) == 1
    explore = 1 + SAMPLES                 # the first run of an exploration is not counted
    assert pool.log[:WARMUP_RUNS + explore] == [2] * WARMUP_RUNS + [1] * explore
    # then explorations back to two after F, 2F, 4F, ... more runs (F = FIRST_INTERVAL)
    at, want = WARMUP_RUNS + explore, []
    for i in range(8):
        at += FIRST_INTERVAL << i
        if at >= 500:
            break
        want.append(at)
        at += explore
    assert explorations(pool.log, 2) == want
    assert pool.log.count(2) == WARMUP_RUNS + len(want) * explore


def test_a_shape_faster_on_all_threads_stays_there_and_explores_ever_more_rarely():
    choice, plan, pool = drive(lambda k, run: {2: 3e-3, 1: 6e-3}[k], 4000)
    assert choice.current(plan) == 2
    starts = explorations(pool.log, 1)
    gaps = np.diff(starts)
    assert starts[0] == WARMUP_RUNS and gaps[0] > FIRST_INTERVAL
    assert all(np.diff(gaps[:4]) > 0) and max(gaps) <= MAX_INTERVAL + 1 + SAMPLES   # doubling, capped
    # an exploration whose first counted run is twice as slow stops there (after the transition)
    assert pool.log.count(1) == 2 * len(starts)


@pytest.mark.parametrize("slower, counted", [(1.3, FIRST_LOOK), (1.45, FIRST_LOOK), (1.6, 1), (1.2, SAMPLES)])
def test_a_hopeless_exploration_stops_after_as_few_runs_as_show_it(slower, counted):
    """Slower by more than AT_A_GLANCE: one counted run; by more than HOPELESS: FIRST_LOOK;
    less: all SAMPLES (and it loses: the margin goes the other way)."""
    assert 1 + HOPELESS < 1.3 and 1.45 < 1 + AT_A_GLANCE < 1.6
    choice, plan, pool = drive(lambda k, run: {2: 4e-3, 1: 4e-3 * slower}[k], WARMUP_RUNS + 1 + SAMPLES + 4)
    assert choice.current(plan) == 2
    assert pool.log[:WARMUP_RUNS + 1 + counted + 1] == [2] * WARMUP_RUNS + [1] * (1 + counted) + [2]


def test_a_change_of_conditions_is_followed_both_ways():
    # fast on two threads, then (another process takes a core) fast on one, then fast on two again
    def cost(k, run):
        busy = 300 < run <= 2000
        return {(2, False): 3e-3, (1, False): 4e-3, (2, True): 6e-3, (1, True): 4e-3}[k, busy]
    choice, plan, pool = drive(cost, 300)
    assert choice.current(plan) == 2
    drive(cost, 1700, plan=plan, choice=choice, pool=pool)
    assert choice.current(plan) == 1
    assert pool.log[-200:].count(1) > 190
    drive(cost, MAX_INTERVAL + 3 * SAMPLES, plan=plan, choice=choice, pool=pool)
    assert choice.current(plan) == 2


def test_noise_within_the_margin_does_not_flip_the_choice():
    rng = np.random.default_rng(0)
    choice, plan, pool = drive(lambda k, run: 5e-3 * (1 + 0.01 * rng.standard_normal()) * (1.01 if k == 1 else 1),
                              3000)
    assert choice.current(plan) == 2
    assert choice._plans[plan].switches == 0


def test_a_busy_core_s_bimodal_times_are_judged_by_their_mean():
    """Two threads: 60% of runs quick, 40% a time slice longer (a worker descheduled with a
    chunk in hand); one thread: steady and faster on average. Medians would pick two."""
    rng = np.random.default_rng(2)
    cost = lambda k, run: 4.5e-3 if k == 1 else (4.2e-3 if rng.random() < 0.6 else 7.8e-3)   # noqa: E731
    choice, plan, pool = drive(cost, 400)
    assert choice.current(plan) == 1
    assert pool.log[100:].count(1) > 0.85 * len(pool.log[100:])


def test_each_plan_has_its_own_choice():
    pool = FakePool(None)
    choice = ThreadChoice(2, clock=pool.clock, adaptive=True)
    decode, prefill = FakePlan(), FakePlan()
    costs = {id(decode): {2: 5e-3, 1: 4e-3}, id(prefill): {2: 50e-3, 1: 95e-3}}
    for _ in range(300):
        for plan in (decode, prefill):
            pool.cost = lambda k, run, plan=plan: costs[id(plan)][k]
            choice.run(pool, plan)
    assert (choice.current(decode), choice.current(prefill)) == (1, 2)
    assert choice.summary() == {1: 1, 2: 1}


def test_nothing_is_explored_when_off_on_one_thread_or_for_a_static_plan(monkeypatch):
    monkeypatch.setenv(thread_choice.ENV, "0")
    assert not ThreadChoice(2).adaptive
    monkeypatch.setenv(thread_choice.ENV, "1")
    assert ThreadChoice(2).adaptive and not ThreadChoice(1).adaptive
    fast_on_one = lambda k, run: {2: 5e-3, 1: 1e-3}[k]      # noqa: E731
    choice, plan, pool = drive(fast_on_one, 200, n_threads=1)
    assert set(pool.log) == {1}
    choice, plan, pool = drive(fast_on_one, 200, plan=FakePlan(all_dynamic=False))
    assert set(pool.log) == {2}
    pool = FakePool(fast_on_one)
    drive(fast_on_one, 200, choice=ThreadChoice(2, clock=pool.clock, adaptive=False), pool=pool)
    assert set(pool.log) == {2}


def test_a_model_gives_the_same_logits_whatever_the_choice(tmp_path, monkeypatch):
    """Decode steps on a 2-thread pool, forced onto one worker or two per run in a random
    pattern: the same logits as always on two (batch invariance covers the thread count)."""
    import llambda
    from synth import write_random_llama
    path = tmp_path / "tiny.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300,
                       tensor_type="Q4_1", n_ctx=256, seed=3)
    ids = np.random.default_rng(0).integers(0, 300, 40).tolist()

    def logits(pattern):
        forced = iter(pattern)
        monkeypatch.setattr(ThreadChoice, "threads_for", lambda self, plan: next(forced, 2))
        with llambda.load(path, n_ctx=256, threads=2, progress=False) as m:
            return np.stack([m.evaluate(ids[:n]).copy() for n in range(1, len(ids) + 1)])

    want = logits([2] * 100)
    rng = np.random.default_rng(1)
    for _ in range(2):
        np.testing.assert_array_equal(logits(rng.integers(1, 3, 100).tolist()), want)


def test_more_threads_are_not_tried_while_their_cores_are_busy_elsewhere():
    """Settled on one thread; the core a second would take is busy with other work (90% of
    its ticks), then free: no try of two while busy, and back to two once it is free."""
    pool = FakePool(lambda k, run: {2: 3e-3, 1: 4e-3}[k] if run > 1000 else {2: 6e-3, 1: 4e-3}[k])
    ticks = {"busy": 0, "total": 0, "share": 0.9}

    def usage(workers):
        assert list(workers) == [1]
        return {1: (ticks["busy"], ticks["total"])}

    choice = ThreadChoice(2, clock=pool.clock, adaptive=True, usage=usage)
    plan = FakePlan()
    for run in range(2000):
        if run == 1000:
            ticks["share"] = 0.1
        ticks["total"] += 10
        ticks["busy"] += 10 * ticks["share"]
        choice.run(pool, plan)
        if run == 999:
            assert choice.current(plan) == 1
            assert pool.log[100:].count(2) == 0           # never tried again while busy
    assert choice.current(plan) == 2


def test_cpu_usage_snapshots_read_this_machine():
    from llambda.runtime import cpu_usage
    ticks = cpu_usage.cpu_ticks()
    assert ticks and all(0 <= busy <= total for busy, total in ticks.values())
    with WorkerPool(2) as pool:
        plan, _ = counting_plan(2)
        within_timeout(lambda: pool.run(plan))
        pool._crew.wait_for_workers()
        before = pool.cpu_usage([1])
        assert before is not None and set(before) == {1}
        after = pool.cpu_usage([1])
        share = cpu_usage.others_share(before, after)
        assert share is None or 0 <= share <= 1
    assert cpu_usage.snapshot([None, 1], [None, 5], [1]) is None          # no such thread
    assert cpu_usage.others_share(None, {1: (0, 1)}) is None
    assert cpu_usage.thread_ticks(0) is None


def test_a_bad_adaptive_threads_value_is_one_error_naming_the_variable(monkeypatch):
    import llambda
    from llambda.errors import UserError
    for text, want in (("", True), ("1", True), (" On ", True), ("yes", True), ("0", False), ("off", False),
                       ("FALSE", False), ("no", False)):
        monkeypatch.setenv(thread_choice.ENV, text)
        assert thread_choice.enabled() is want
    monkeypatch.setenv(thread_choice.ENV, "maybe")
    with pytest.raises(ValueError, match="LLAMBDA_ADAPTIVE_THREADS: expected 1 or 0 .* got 'maybe'"):
        ThreadChoice(2)
    with pytest.raises(UserError, match="LLAMBDA_ADAPTIVE_THREADS: expected 1 or 0 .* got 'maybe'"):
        llambda.load("no-such-model.gguf", progress=False)        # before any file is read


def busy_usage(ticks):
    """A usage(workers) over ``ticks`` (advanced by the caller): worker 1's core, busy with
    other work for ticks["share"] of the time."""
    def usage(workers):
        assert list(workers) == [1]
        return {1: (ticks["busy"], ticks["total"])}
    return usage


def test_a_compute_bound_plan_tries_fewer_threads_only_while_their_cores_are_busy():
    """A prefill chunk: on idle cores never tried on one thread (hopeless, and a second
    prompt would wait on it); once the other core is busy, tried, and moved to one thread if
    that is faster there; a plan not called compute-bound still explores on idle cores."""
    ticks = {"busy": 0, "total": 0, "share": 0.0}
    busy = lambda run: run > 1000                                     # noqa: E731
    pool = FakePool(lambda k, run: {2: 9e-3, 1: 8e-3}[k] if busy(run) else {2: 3e-3, 1: 6e-3}[k])
    choice = ThreadChoice(2, clock=pool.clock, adaptive=True, usage=busy_usage(ticks))
    plan = FakePlan()
    for run in range(1, 2001):
        ticks["share"] = 0.9 if busy(run) else 0.0
        ticks["total"] += 10
        ticks["busy"] += 10 * ticks["share"]
        choice.run(pool, plan, compute_bound=True)
        if run == 1000:
            assert pool.log.count(1) == 0                 # never tried while the cores were idle
    assert choice.current(plan) == 1
    assert pool.log[-100:].count(1) > 90
    # the same costs, not called compute-bound: explored on idle cores as before
    pool = FakePool(lambda k, run: {2: 3e-3, 1: 6e-3}[k])
    drive(None, 200, choice=ThreadChoice(2, clock=pool.clock, adaptive=True, usage=busy_usage(ticks)), pool=pool)
    assert pool.log.count(1) > 0


def test_a_compute_bound_plan_is_not_tried_on_fewer_threads_where_usage_cannot_be_read():
    """No /proc to read: nothing shows the cores busy, so fewer threads are never tried."""
    pool = FakePool(lambda k, run: {2: 3e-3, 1: 6e-3}[k])
    choice = ThreadChoice(2, clock=pool.clock, adaptive=True)
    plan = FakePlan()
    for _ in range(500):
        choice.run(pool, plan, compute_bound=True)
    assert set(pool.log) == {2}


@pytest.mark.parametrize("share, compute_bound, starts_on", [(0.95, False, 1), (0.95, True, 2), (0.5, False, 2)])
def test_a_new_plan_starts_on_fewer_threads_when_their_cores_were_taken_since_the_start(share, compute_bound,
                                                                                      starts_on):
    """A decode step's first run on a core a process that never sleeps has taken costs a time
    slice: with the other core busy since the pool started (share of START_TICKS and more), a
    plan that is not compute-bound runs on one thread from its second run, and goes back to two
    once that core is free."""
    from llambda.runtime.thread_choice import START_TICKS
    ticks = {"busy": 0, "total": 0}
    pool = FakePool(lambda k, run: {2: 3e-3, 1: 4e-3}[k])
    choice = ThreadChoice(2, clock=pool.clock, adaptive=True, usage=busy_usage(ticks))
    ticks["total"] += START_TICKS
    ticks["busy"] += START_TICKS * share
    plan = FakePlan()
    for _ in range(4):
        choice.run(pool, plan, compute_bound=compute_bound)
    assert pool.log == [2] + [starts_on] * 3
    for _ in range(MAX_INTERVAL):                     # the core is free from now on
        ticks["total"] += 10
        choice.run(pool, plan, compute_bound=compute_bound)
    assert choice.current(plan) == 2


def test_too_short_a_look_since_the_start_decides_nothing():
    from llambda.runtime.thread_choice import START_TICKS
    ticks = {"busy": 0, "total": 0}
    pool = FakePool(lambda k, run: {2: 3e-3, 1: 4e-3}[k])
    choice = ThreadChoice(2, clock=pool.clock, adaptive=True, usage=busy_usage(ticks))
    ticks["total"] = ticks["busy"] = START_TICKS - 1
    plan = FakePlan()
    for _ in range(WARMUP_RUNS):
        choice.run(pool, plan)
    assert set(pool.log) == {2}
