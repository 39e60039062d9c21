"""How many of the pool's workers run each plan: the count measured fastest, kept measured.

More threads are not always faster. A decode step reads every weight once; on some
machines one core nearly saturates the memory, and a second adds a wait at each of a
step's hundreds of barriers for little more bandwidth. On a machine shared with other
work, a worker whose core another process takes holds the others up whenever it is
descheduled with a chunk in hand, for as long as the other process's time slice. A
prefill step is the opposite: compute-bound, it gains from every core, even half of one.

So the choice is measured, per plan (one per step shape), between the pool's thread count
and half of it (down to one), by the wall time of whole runs. Fewer workers run the same
plan (runtime/pool.py: they claim all its chunks between them), whose finer chunks cost a
percent or two against a plan cut for fewer threads, and nothing has to be recorded when a
count is first tried:

- the plan runs on its current count, which keeps the times of its last RECENT runs;
- after WARMUP_RUNS runs, and then every ``interval`` runs, SAMPLES runs in a row go to
  the neighbouring count (half, or double back towards all);
- if their mean beats the mean of the current count's recent runs by MARGIN, the
  neighbour becomes the current count and the interval starts again from FIRST_INTERVAL;
  if not, the interval doubles, up to MAX_INTERVAL, so a count that keeps losing is rarely
  tried; an exploration whose first FIRST_LOOK runs are slower by more than HOPELESS stops
  there (one core for a compute-bound prefill costs twice the time: that is seen at once),
  and one whose first counted run alone is slower by more than AT_A_GLANCE stops after it
  (one core for a decode step deep into a long context takes 1.8 times as long: each run
  of such a try is a slow token of the reply).

Means of many runs, not a moving average: on a busy machine a run's time is bimodal (a step
that waited for a descheduled worker takes a time slice longer), and a short average would
often compare a lucky streak against an unlucky one.

Before trying more threads, a plan looks at the cores they would take: when other work kept
them busy for most of the time since the plan last decided (``usage``: the pool's
runtime/cpu_usage.py snapshots), the try is skipped and looked at again ``interval`` runs
later. On a machine shared with a process that never sleeps, decode then stays on the free
core instead of paying for a try every few dozen tokens.

The caller says when a plan is compute-bound (llambda/model/forward.py: a step of many rows, a
prefill chunk). Fewer threads are then tried only while other work keeps the cores they would
leave busy: on idle cores such a try is hopeless (one core for a prefill chunk takes twice
the time), and its runs, a prompt's chunks, are what a second prompt in the same process
would wait on.

A plan that is not compute-bound (a decode step) starts on fewer threads when other work
has kept the cores they would leave at least START_BUSY busy since the pool started (over at
least START_TICKS clock ticks: /proc/stat counts in hundredths of a second): every run on
a core taken by a process that never sleeps is a time slice late, and the first runs, before
any exploration, cost most (a decode step's runs then take two or three times as long).

A plan that runs only a few times (one prompt's prefill) is never explored: it runs on
every thread, as before. What a chunk computes does not depend on who runs it, so the
choice changes speed, never output. ``LLAMBDA_ADAPTIVE_THREADS=0`` turns it off: every plan
on every thread.
"""
import os
import time
import weakref
from dataclasses import dataclass, field

from . import cpu_usage

ENV = "LLAMBDA_ADAPTIVE_THREADS"
WARMUP_RUNS = 6         # runs of a plan before its first exploration
UNTIMED_RUNS = 2        # ... of which the first few are not counted (they fault pages in)
RECENT = 32             # the current count's runs its mean is taken over
SAMPLES = 8             # runs of an exploration counted (after one more: the first, a transition)
FIRST_INTERVAL = 16     # runs between explorations after a switch
MAX_INTERVAL = 1024     # ... and at most this many after losing explorations
MARGIN = 0.03           # the other count must be this much faster to take over
FIRST_LOOK = 2          # runs after which a hopeless exploration stops
HOPELESS = 0.25         # ... if their mean is this much slower than the current count's
AT_A_GLANCE = 0.5       # ... or after one, if it alone is this much slower
BUSY_ELSEWHERE = 0.5    # more threads are not tried while the cores they need were this busy
START_BUSY = 0.9        # a new plan that is not compute-bound starts on fewer threads when the
START_TICKS = 20        # ... cores they leave were this busy over this many ticks since the start


ENV_VALUES = {"1": True, "on": True, "true": True, "yes": True, "0": False, "off": False, "false": False, "no": False}


def enabled():
    """``$LLAMBDA_ADAPTIVE_THREADS``: on unless 0/off/false/no (unset or empty: on); any other
    value is a ValueError naming the variable."""
    text = os.environ.get(ENV, "").strip().lower()
    if not text:
        return True
    if text not in ENV_VALUES:
        raise ValueError(f"{ENV}: expected 1 or 0 (on/off, true/false, yes/no), got {os.environ[ENV]!r}")
    return ENV_VALUES[text]


def counts(n_threads):
    """The counts a plan may run on: n_threads, then halved down to 1."""
    out, k = [], n_threads
    while True:
        out.append(k)
        if k == 1:
            return out
        k //= 2


@dataclass
class PlanTimes:
    """One plan's measurements: its current count and the times of its last runs on it,
    and the exploration under way (count, run times so far), if any."""
    current: int
    recent: list = field(default_factory=list)     # the current count's last RECENT run times
    runs: int = 0                       # runs on the current count
    interval: int = FIRST_INTERVAL
    next_explore: int = WARMUP_RUNS     # on the current count's run number
    explore_down: bool = True           # which neighbour the next exploration tries
    exploring: int = None
    samples: list = field(default_factory=list)
    skipped: bool = False               # the exploration's first run, not counted
    fresh: bool = True                  # no run recorded yet
    switches: int = 0
    usage: dict = None                  # usage(the workers more threads would add) at the last decision
    usage_down: dict = None             # usage(the workers fewer threads would leave) at the last decision


class ThreadChoice:
    """Runs plans on a pool, each on the count of workers measured fastest for it.

        choice = ThreadChoice(pool.n_threads, usage=pool.cpu_usage)
        choice.run(pool, plan)          # instead of pool.run(plan)
    """

    def __init__(self, n_threads, clock=time.perf_counter, adaptive=None, usage=None):
        """``usage(workers)``: a runtime/cpu_usage.py snapshot of those workers' CPUs, or None."""
        self.n_threads = n_threads
        self.counts = counts(n_threads)
        self.adaptive = (enabled() if adaptive is None else adaptive) and n_threads > 1
        self.clock = clock
        self.usage = usage or (lambda workers: None)
        self._plans = weakref.WeakKeyDictionary()
        # the cores fewer threads would leave, as the pool starts: a new plan's first look
        self._start = self.usage(range(self.counts[1], n_threads)) if len(self.counts) > 1 else None

    def threads_for(self, plan):
        """The count the next run of ``plan`` takes."""
        times = self._times(plan)
        if times is None:
            return self.n_threads
        return times.exploring if times.exploring is not None else times.current

    def run(self, pool, plan, compute_bound=False):
        """Run ``plan`` on its chosen count. ``compute_bound``: fewer threads are tried only
        while other work keeps busy the cores they would leave."""
        threads = self.threads_for(plan)
        start = self.clock()
        if threads == plan.n_threads:
            pool.run(plan)                  # (a stand-in like llambda.bench.profile's PlanTimer takes no count)
        else:
            pool.run(plan, threads=threads)
        self.record(plan, threads, self.clock() - start, compute_bound)

    def record(self, plan, threads, seconds, compute_bound=False):
        """Account one run of ``plan`` on ``threads`` workers that took ``seconds``."""
        times = self._times(plan)
        if times is None:
            return
        if times.fresh:
            times.fresh = False
            if not compute_bound and self._busy_since_start():
                times.current = self.counts[1]
                self._settle(times)
                return
        if times.exploring is not None and threads == times.exploring:
            if not times.skipped:
                times.skipped = True
                return
            times.samples.append(seconds)
            if len(times.samples) == SAMPLES or self._hopeless(times):
                self._decide(times)
            return
        if threads != times.current:
            return
        times.runs += 1
        if times.runs > UNTIMED_RUNS or times.switches:
            times.recent = times.recent[1 - RECENT:] + [seconds]
        if times.runs >= times.next_explore and times.recent:
            times.exploring = self._neighbour(times)
            times.samples, times.skipped = [], False
            if times.exploring > times.current:
                if self._taken(times.usage, times.current, times.exploring):
                    self._settle(times)         # not tried, and no backing off: looking is cheap
            elif compute_bound and not self._taken(times.usage_down, times.exploring, times.current):
                self._settle(times)             # the cores are there to use: no try, no backing off

    def current(self, plan):
        """The count ``plan`` runs on when not exploring (all workers before its first run)."""
        times = self._times(plan, create=False)
        return self.n_threads if times is None else times.current

    def summary(self):
        """``{count: how many plans run on it}``."""
        out = {}
        for times in self._plans.values():
            out[times.current] = out.get(times.current, 0) + 1
        return out

    # -- the policy ---------------------------------------------------------------
    def _times(self, plan, create=True):
        if not self.adaptive or plan.n_threads != self.n_threads or not plan.all_dynamic:
            return None
        times = self._plans.get(plan)
        if times is None and create:
            times = self._plans[plan] = PlanTimes(current=self.n_threads)
        return times

    def _neighbour(self, times):
        i = self.counts.index(times.current)
        down = i + 1 < len(self.counts)
        up = i > 0
        if down and up:
            down = times.explore_down
            times.explore_down = not times.explore_down
        return self.counts[i + 1] if down else self.counts[i - 1]

    def _taken(self, snapshot, low, high):
        """Whether other work kept the CPUs of workers low..high-1 busy for at least
        BUSY_ELSEWHERE of the time since ``snapshot`` (taken when the plan last decided)."""
        share = cpu_usage.others_share(snapshot, self.usage(range(low, high)))
        return share is not None and share >= BUSY_ELSEWHERE

    def _busy_since_start(self):
        """Whether other work kept the cores fewer threads would leave START_BUSY busy since
        the pool started, over at least START_TICKS ticks."""
        if self._start is None:
            return False
        now = self.usage(range(self.counts[1], self.n_threads))
        share = cpu_usage.others_share(self._start, now)
        ticks = sum(now[w][1] - self._start[w][1] for w in now) if share is not None else 0
        return ticks >= START_TICKS and share >= START_BUSY

    @staticmethod
    def _hopeless(times):
        """Whether the exploration's runs so far already show it slower, clearly enough to stop."""
        slower = _mean(times.samples) / _mean(times.recent) - 1
        return ((len(times.samples) == 1 and slower > AT_A_GLANCE)
                or (len(times.samples) == FIRST_LOOK and slower > HOPELESS))

    def _decide(self, times):
        if len(times.samples) == SAMPLES and _mean(times.samples) < (1 - MARGIN) * _mean(times.recent):
            times.current, times.recent = times.exploring, times.samples
            times.interval = FIRST_INTERVAL
            times.switches += 1
        else:
            times.interval = min(2 * times.interval, MAX_INTERVAL)
        self._settle(times)

    def _settle(self, times):
        """Back to the current count for ``interval`` runs, with a new snapshot of the cores."""
        times.runs, times.next_explore = 0, times.interval
        times.exploring, times.samples = None, []
        i = self.counts.index(times.current)
        times.usage = self.usage(range(times.current, self.counts[i - 1])) if i > 0 else None
        below = i + 1 < len(self.counts)
        times.usage_down = self.usage(range(self.counts[i + 1], times.current)) if below else None


def _mean(values):
    return sum(values) / len(values)

