#!/usr/bin/env python3
"""The decode GEMV's streaming rate per weight type, as a fraction of one core's read probe.

    tools/bench_gemv.py [--kinds Q4_K,Q5_K] [--shapes 1536x576,...] [--threads 1,2]
                        [--isa avx2] [--lib A.so --lib B.so] [--rounds 5]

For each shape (n x k: output columns x reduction) and weight type, qgemm at m = 1 is
called straight through ctypes over copies of the weight that together overflow the L3
cache, as a decode step reads its weights: GB/s of weight bytes (packed, scales
included) per second. With 2 threads the row groups are split in two halves, one per
thread, each thread pinned to its own CPU (as the plan splits a GEMV). Each figure is
the best time of PASSES passes over the copies (started together on every thread, ended
when the last thread ends), less the cost of as many empty calls timed on one thread.

Each (shape, type) runs its rounds one after another, its copies made once; a round
measures the one-core read probe (codegen/probe.py ``llb_probe_read__avx2``, the current
library's for every ``--lib``), then each thread count for each library in turn, so
libraries are compared A, B, B, A, A, B ... on a machine others share (the order reversed
every other round: timed A against A, the second of a round was up to 1.25x faster). Reported: per cell the median over rounds of the ratio GB/s ÷
that round's read probe, with its range, and the median GB/s; with two libraries, the
median of the per-round ratios B ÷ A.

K-quants need k % 256 == 0: other shapes skip them. Weights are random valid blocks
(the time does not depend on the values).
"""
import argparse
import ctypes
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402

# SmolLM2-135M's decode shapes (q/o, up/gate, down, LM head) and a 1B-class model's
SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (2048, 2048), (8192, 2048), (2048, 8192)]
KINDS = ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"]
STREAM_BYTES = 96 << 20          # three times the L3 cache of the 2-core Zen 3 host
PASSES = 4                       # passes over STREAM_BYTES per timing
SUPER_BLOCK_KINDS = ("Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")


class Workers:
    """``count`` threads started once, thread i pinned to the i-th CPU this process may use;
    ``run(jobs)`` has thread i run ``jobs[i]()`` and returns the wall time from the common
    start to the last thread's end."""

    def __init__(self, count):
        self.count = count
        self.cpus = sorted(os.sched_getaffinity(0))
        self.start, self.done = threading.Barrier(count + 1), threading.Barrier(count + 1)
        self.jobs, self.stop = None, False
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(count)]
        for t in self.threads:
            t.start()

    def _loop(self, i):
        os.sched_setaffinity(0, {self.cpus[i % len(self.cpus)]})
        while True:
            self.start.wait()
            if self.stop:
                return
            self.jobs[i]()
            self.done.wait()

    def run(self, jobs):
        self.jobs = jobs
        self.start.wait()
        t = time.perf_counter()
        self.done.wait()
        return time.perf_counter() - t

    def close(self):
        self.stop = True
        self.start.wait()


def best(workers, jobs, budget, min_runs=3):
    runs, top, start = 0, float("inf"), time.perf_counter()
    while runs < min_runs or time.perf_counter() - start < budget:
        top = min(top, workers.run(jobs))
        runs += 1
    return top


def _best_call(f, args, calls=64, repeats=20):
    top = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            f(*args)
        top = min(top, (time.perf_counter() - t) / calls)
    return top


def halves(n, parts):
    """Row ranges of ``parts`` threads: whole groups of 8, as even as they go."""
    groups = -(-n // 8)
    cuts = [groups * i // parts * 8 for i in range(parts + 1)]
    cuts[-1] = n
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--shapes", help="n x k, comma-separated (default: SmolLM2-135M's and a 1B model's)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--isa", default="avx2", help="qgemm variant (default avx2)")
    ap.add_argument("--lib", action="append", help="kernel library .so to time (repeatable)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hot", action="store_true",
                    help="one copy of the weight, read from L2 when it fits: the kernel's own ceiling, not memory's")
    ap.add_argument("--budget", type=float, default=0.12, help="seconds per figure per round")
    args = ap.parse_args(argv)

    from llambda.runtime import buffers, ceilings, library
    from llambda.runtime.native import quant
    from llambda.codegen.contract import qgemm_symbol
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_kernels import _copy, _random_weight

    current = library.load("avx2")
    libs = args.lib or [str(current.directory / "libllambda.so")]
    dlls = [ctypes.CDLL(path) for path in libs]
    shapes = ([tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")] if args.shapes else SHAPES)
    thread_counts = [int(t) for t in args.threads.split(",")]
    workers = {t: Workers(t) for t in thread_counts}
    rng = np.random.default_rng(0)

    def fn(dll, symbol):
        """The symbol in ``dll``; a library from before a kind's decode kernel has only its
        main tile (the same arguments), which is timed instead."""
        try:
            f = getattr(dll, symbol)
        except AttributeError:
            kind = symbol.split("_")[2] + "_" + symbol.split("_")[3]
            f = getattr(dll, qgemm_symbol(kind, quant.qgemm_tile(kind, args.isa), args.isa))
        f.restype = None
        f.argtypes = [ctypes.c_size_t] * (11 if "q6_k" in symbol or "q3_k" in symbol or "q2_k" in symbol else 10)
        return f

    probe_fn = current.fn("llb_probe_read__avx2")
    probe_bytes = 256 << 20
    probe_buf = ceilings.stream_buffers(1, probe_bytes)[0]

    def read_probe(reps=3):
        probe_fn(probe_buf.ctypes.data, probe_bytes, 1)      # warm the TLB and the pages
        return ceilings._best_rate(lambda: probe_fn(probe_buf.ctypes.data, probe_bytes, reps),
                                   probe_bytes * reps, repeats=3) / 1e9

    cells, probes = [], []
    for n, k in shapes:
        for kind in args.kinds.split(","):
            if kind in SUPER_BLOCK_KINDS and k % 256:
                continue
            # the weight's copies live only while its cell runs (one cell: ~STREAM_BYTES)
            w = _random_weight(kind, n, k, rng)
            copies = [w] + [_copy(w) for _ in range(0 if args.hot else -(-STREAM_BYTES // w.nbytes) - 1)]
            x = buffers.aligned_copy(rng.standard_normal((1, k), dtype=np.float32))
            qs, d, s = buffers.empty((1, k), np.int8), buffers.empty((1, k // 32)), buffers.empty((1, k // 32))
            quant.quantize_q8(x, qs, d, s)
            out = buffers.empty((1, n))
            # a timing reads PASSES * STREAM_BYTES (~25 ms, far above a thread's wake-up)
            passes = PASSES * STREAM_BYTES // (w.nbytes * len(copies)) or 1
            runs = []
            for t in thread_counts:
                per_thread = [[quant.qgemm_call(qs, d, s, c, out, r, isa=args.isa) for c in copies]
                              for r in halves(n, t)]
                tiny = list(per_thread[0][0][1])
                tiny[-4:] = [1, 1, 8 if kind in SUPER_BLOCK_KINDS else 1, n]    # 8 columns, one (super-)block
                cell = dict(shape=(n, k), kind=kind, threads=t, symbol=per_thread[0][0][0],
                            arglists=[[a for _, a in calls] for calls in per_thread], tiny=tiny,
                            nbytes=w.nbytes * len(copies), gbs=[[] for _ in libs], ratio=[[] for _ in libs])
                runs.append(cell)
            for _ in range(args.rounds):
                probe = read_probe()
                probes.append(probe)
                for cell in runs:
                    pool = workers[cell["threads"]]
                    # the libraries in turn, the order reversed every other round (the one
                    # timed second after the probe measured up to 1.25x faster, A against A)
                    order = list(enumerate(dlls))
                    if len(probes) % 2 == 0:
                        order.reverse()
                    for i, dll in order:
                        f = fn(dll, cell["symbol"])

                        # the calls' own overhead, timed on this thread (ctypes, ~1 us a call)
                        empty = _best_call(f, cell["tiny"]) * len(cell["arglists"][0])

                        def job(calls, f=f):
                            def run():
                                for _ in range(passes):
                                    for a in calls:
                                        f(*a)
                            return run
                        t = best(pool, [job(calls) for calls in cell["arglists"]], args.budget) / passes - empty
                        gbs = cell["nbytes"] / t / 1e9
                        cell["gbs"][i].append(gbs)
                        cell["ratio"][i].append(gbs / probe)
            for cell in runs:
                del cell["arglists"]
                cells.append(cell)
            del copies, runs
            print(f"{kind} {n}x{k} done", file=sys.stderr, flush=True)

    cpu_name = _cpu_name()
    print(f"{cpu_name}; read probe (one core) median {statistics.median(probes):.1f} GB/s, "
          f"range {min(probes):.1f}-{max(probes):.1f}, {args.rounds} rounds; qgemm {args.isa}, m = 1")
    print()
    names = [f"lib{i}" for i in range(len(libs))]
    for i, path in enumerate(libs):
        print(f"lib{i}: {path}")
    print()
    head = "| type | n x k | threads | " + " | ".join(f"{v} GB/s | {v} ÷ probe (range)" for v in names)
    if len(libs) > 1:
        head += " | " + " | ".join(f"{v} ÷ lib0" for v in names[1:])
    print(head + " |")
    print("|---|---|---:|" + "---:|---:|" * len(libs) + "---:|" * (len(libs) - 1))
    for cell in cells:
        row = [cell["kind"], "x".join(map(str, cell["shape"])), str(cell["threads"])]
        for g, r in zip(cell["gbs"], cell["ratio"]):
            row += [f"{statistics.median(g):.1f}", f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"]
        for g in cell["gbs"][1:]:
            per_round = [b / a for a, b in zip(cell["gbs"][0], g)]
            row.append(f"{statistics.median(per_round):.2f} ({min(per_round):.2f}-{max(per_round):.2f})")
        print("| " + " | ".join(row) + " |", flush=True)
    for pool in workers.values():
        pool.close()


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
