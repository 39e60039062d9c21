#!/usr/bin/env python3
"""Decode attention alone: one query row over a long KV cache, straight through ctypes, one thread.

    tools/bench_attention.py [--kv f16,q8_0,f32] [--keys 1024,4096] [--layers 1|30]
                             [--isa avx2|avx512] [--lib A.so --lib B.so] [--shuffle] [--rounds 3]
                             [--step N] [--threads N [--between MB]] [--rows M] [--group]

SmolLM2-135M's attention shape (9 query heads on 3 KV heads of head_dim 64), scale 1/8.
``--layers N`` makes N layers of arenas (as the KV pool lays them out) and calls them in turn, as a decode step walks
its layers: with 30 the cache comes from memory (what long-context decode sees), with 1 it
stays near the core once warm (the arithmetic's cost). Block tables are sequential, as one
sequence's blocks come from a fresh pool; ``--shuffle`` permutes them. ``--step N`` calls
each layer as a decode step's threads split it (runtime/recorder.py): N calls of the
segments s = seg0 (mod N), each writing partial records, then attention_combine, all timed
and the combined output checked.

``--threads N`` runs the layers as a decode step's plan does, on a worker pool of N pinned
threads: per layer one op of the split calls (segments s = seg0 mod step, step
WHOLE_HEAD_CHUNKS_PER_THREAD x N unless ``--step`` says), claimed as dynamic chunks, then
the combine, with the pool's barriers between ops. ``--between MB`` adds after each
layer's attention an op that streams MB of a buffer of that layer's own (the read probe's
loop from the current library, the same for every ``--lib``, split over the threads), as
the layer's weights would stream between two attentions: the row then reports attention's
time within that mix (the mix's time less the streams' alone, printed above the table). On
a host whose shared L3 holds part of a ~100 MB working set, attention alone and the weights
alone each read faster than the two together.

``--rows M`` times a prompt chunk instead: M query rows of one sequence at the last M
positions, in one whole call per layer (the AVX-512 float kernels take such rows two at a
time); ``--group`` computes only the query heads of the first KV head, as the prompt plan's
chunks split a call (runtime/recorder.py). Figures are then per (row, key, KV head).

Each figure is the best of ``--rounds`` rounds of the mean time per call, reported as ns
per (key, KV head) and as GB/s of K and V bytes read. The first call's output is checked
against runtime/ref/paged.py. ``--lib`` (repeatable) times the same symbol from several
kernel libraries, interleaved round by round, for A/B comparisons on a busy machine.
"""
import argparse
import ctypes
import time

import numpy as np

from llambda.runtime.pool import WorkerPool

N_HEAD, N_KV, HEAD_DIM, SCALE = 9, 3, 64, 0.125
BUDGET_S = 0.2


def arenas(kv, keys, layers, shuffle, rng):
    """[(key arena, value arena, tables [1, blocks])] per layer, each holding ``keys`` random
    keys, laid out as llambda/serving/kv_pool.py keeps a long cache: each layer's arenas are views of
    one buffer per K and V [layer, KV head, block] (a KV head's blocks one run), written, then
    collapsed into huge pages where whole ones are filled."""
    from llambda.runtime import buffers
    from llambda.codegen.contract import KV_BLOCK
    from llambda.runtime.ref import paged as ref
    blocks = -(-keys // KV_BLOCK)
    k_all = v_all = None
    for layer in range(layers):
        rows = rng.standard_normal((blocks, N_KV, KV_BLOCK, HEAD_DIM)).astype(np.float32)
        if kv == "q8_0":
            rows = ref.quantize_kv_q8(rows)
        elif kv == "f16":
            rows = rows.astype(np.float16)
        if k_all is None:
            k_all = buffers.zeros_growing((layers, N_KV, blocks) + rows.shape[2:], rows.dtype)
            v_all = buffers.zeros_growing(k_all.shape, rows.dtype)
        k_all[layer] = ref.key_tiles(rows, HEAD_DIM).transpose(1, 0, 2, 3)
        v_all[layer] = rows.transpose(1, 0, 2, 3)
    for buffer in (k_all, v_all):
        buffers.collapse_huge_pages(buffer, 0, buffer.nbytes)
    order = rng.permutation(blocks) if shuffle else np.arange(blocks)
    tables = buffers.aligned_copy(order.astype(np.int32)[None, :])
    return [(k_all[layer].transpose(1, 0, 2, 3), v_all[layer].transpose(1, 0, 2, 3), tables)
            for layer in range(layers)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="f16,q8_0,f32")
    ap.add_argument("--keys", default="1024,4096")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--isa", help="attention variant (default: the binding's choice)")
    ap.add_argument("--lib", action="append", help="kernel library .so to time (repeatable)")
    ap.add_argument("--shuffle", action="store_true", help="blocks in a random order")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step", type=int, default=0, help="split calls: segments seg0 (mod STEP), then the combine")
    ap.add_argument("--threads", type=int, default=1, help="run the layers as a decode plan on a pool of N threads")
    ap.add_argument("--between", type=float, default=0.0, metavar="MB",
                    help="with the pool: MB of another buffer streamed after each layer's attention")
    ap.add_argument("--rows", type=int, default=1, help="M query rows at the last M positions (a prompt chunk)")
    ap.add_argument("--group", action="store_true", help="only the first KV head's query heads")
    args = ap.parse_args(argv)
    if args.rows < 1:
        ap.error("--rows: expected a positive count")
    if args.rows > 1 and (args.step or args.threads > 1):
        ap.error("--rows: a prompt chunk is one whole call per layer (no --step, --threads)")
    if args.threads < 1:
        ap.error("--threads: expected a positive count")
    if args.between < 0:
        ap.error("--between: expected MB >= 0")
    pooled = args.threads > 1 or args.between > 0
    if args.threads > 1 and not args.step:
        from llambda.runtime.recorder import WHOLE_HEAD_CHUNKS_PER_THREAD
        args.step = WHOLE_HEAD_CHUNKS_PER_THREAD * args.threads

    from llambda.runtime import buffers, ceilings, library
    from llambda.runtime.native import paged
    from llambda.runtime.ref import paged as ref

    libs = args.lib or [str(library.load("avx2").directory / "libllambda.so")]
    dlls = [ctypes.CDLL(path) for path in libs]
    rng = np.random.default_rng(0)
    threads = f"{args.threads} thread{'s' if args.threads > 1 else ''} on a worker pool" if pooled else "One thread"
    between = f", {args.between:g} MB streamed after each layer's attention" if args.between else ""
    print(f"{threads}{between}, {'random' if args.shuffle else 'sequential'} block order; lib i = {', '.join(libs)}\n")
    pool = WorkerPool(args.threads) if pooled else None
    # one buffer of MB per layer, every page written (so reading it streams memory)
    streams = ceilings.stream_buffers(args.layers, max(int(args.between * 2 ** 20), 1024)) if args.between else None
    per = "(row, key, KV head)" if args.rows > 1 else "(key, KV head)"
    print(f"| kernel | keys | layers | {' | '.join(f'lib {i}: ns per {per}, GB/s' for i in range(len(libs)))} |")
    print(f"|---|---|---|{'---|' * len(libs)}")
    for kv in args.kv.split(","):
        for keys in [int(k) for k in args.keys.split(",")]:
            sets = arenas(kv, keys, args.layers, args.shuffle, rng)
            n_rows = min(args.rows, keys)
            heads = (0, N_HEAD // N_KV) if args.group else None
            q = buffers.aligned_copy(rng.standard_normal((n_rows, N_HEAD, HEAD_DIM)).astype(np.float32))
            out = buffers.zeros(q.shape)
            scratch = paged.paged_attention_scratch(keys, HEAD_DIM)
            positions = buffers.aligned_copy(np.arange(keys - n_rows, keys, dtype=np.int32))
            row_seq = buffers.zeros(n_rows, np.int32)
            calls = [[paged.attention_paged_call(q, k, v, positions, row_seq, t, SCALE, out, scratch, heads=heads,
                                                 isa=args.isa)]
                     for k, v, t in sets]
            symbol = calls[0][0][0]
            if args.step:
                partials = paged.attention_partials(1, N_HEAD, HEAD_DIM, sets[0][2])
                # a scratch per split call: on a pool two threads run them at once
                scratches = [paged.paged_attention_scratch(keys, HEAD_DIM) for _ in range(args.step)]
                calls = [[paged.attention_paged_call(q, k, v, positions, row_seq, t, SCALE, out, scratches[seg0],
                                                     heads=heads, partials=partials, segments=(seg0, args.step),
                                                     isa=args.isa)
                          for seg0 in range(args.step)]
                         + [paged.attention_combine_call(partials, positions, t, out, heads=heads)]
                         for k, v, t in sets]
            # the reference (over q8_0 arenas it scores q's q8_0 rows, as the kernels do), and
            # for q8_0 also over the dequantized arenas: a library from before q8_0's int8
            # scores scored the unquantized q
            check = len(sets) - 1 if pooled else 0        # a plan leaves the last layer's output
            k, v, t = sets[check]
            inputs = [(k, v)]
            if kv == "q8_0":
                rows = ref.dequantize_kv_q8(ref.key_rows(k, HEAD_DIM), HEAD_DIM)
                inputs.append((buffers.aligned_copy(ref.key_tiles(rows, HEAD_DIM)),
                               buffers.aligned_copy(ref.dequantize_kv_q8(v, HEAD_DIM))))
            wants = [np.zeros(q.shape, np.float32) for _ in inputs]
            for want, (k_in, v_in) in zip(wants, inputs):
                ref.attention_paged(q, k_in, v_in, positions, row_seq, t, SCALE, want, None, heads=heads)
            fns = []
            for dll in dlls:
                symbols = {}
                for name, arguments in calls[0]:
                    symbols[name] = getattr(dll, name)
                    symbols[name].restype = None
                    symbols[name].argtypes = [ctypes.c_float if isinstance(a, float) else ctypes.c_size_t
                                              for a in arguments]
                layers = [[(symbols[name], arguments) for name, arguments in layer] for layer in calls]

                def fn(layer, layers=layers):
                    for f, arguments in layers[layer]:
                        f(*arguments)
                if pooled:
                    fn = plan_runner(pool, layers, streams, args.threads)
                fn(0)
                error = min(float(np.abs(out - want).max()) for want in wants)
                if not error <= 1e-4:
                    raise SystemExit(f"{symbol} in {dll._name}: max |out - reference| = {error:.3g}")
                fns.append(fn)
            best = [float("inf")] * len(fns)
            stream_s = [float("inf")] * len(fns)
            for _ in range(args.rounds):
                for i, fn in enumerate(fns):
                    if pooled:
                        best[i] = min(best[i], timed(fn.both) / len(calls))
                        if streams:
                            stream_s[i] = min(stream_s[i], timed(fn.streams) / len(calls))
                        continue
                    n, t0 = 0, time.perf_counter()
                    while True:
                        fn(n % len(calls))
                        n += 1
                        elapsed = time.perf_counter() - t0
                        if elapsed > BUDGET_S and n >= len(calls):
                            break
                    best[i] = min(best[i], elapsed / n)
            if streams:
                print("streams alone, ms per layer: " + ", ".join(f"lib {i}: {s * 1e3:.3f}"
                                                                  for i, s in enumerate(stream_s)))
                best = [b - s for b, s in zip(best, stream_s)]
            kv_heads = 1 if args.group else N_KV
            row_keys = n_rows * keys - n_rows * (n_rows - 1) // 2         # each row's keys, summed
            # K and V of every block, as many times as rows read them
            kv_bytes = 2 * sets[0][1][0, 0].nbytes * sets[0][1].shape[0] * kv_heads * row_keys / keys
            cells = [f"{s * 1e9 / (row_keys * kv_heads):.2f} ns, {kv_bytes / s / 1e9:.1f} GB/s" for s in best]
            print(f"| {symbol} | {keys} | {args.layers} | {' | '.join(cells)} |", flush=True)

    if pool is not None:
        pool.close()


def timed(run):
    """Seconds of one run(), the best of those that fit in BUDGET_S (at least 3)."""
    best, n, t0 = float("inf"), 0, time.perf_counter()
    while n < 3 or time.perf_counter() - t0 < BUDGET_S:
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
        n += 1
    return best


def plan_runner(pool, layers, streams, n_threads):
    """fn(layer) for the check (runs the whole plan), with fn.both and fn.streams: the plan
    of every layer's attention op (split calls as dynamic chunks, then the serial combine)
    and its stream op, and the plan of the stream ops alone."""
    from llambda.runtime import library
    from llambda.runtime.plan import Plan
    if streams:
        # the current library's probe, the same stream for every --lib (which then need hold
        # only the attention kernels)
        probe = library.load("avx2").fn("llb_probe_read__avx2")

    def build(attention, stream):
        plan = Plan(n_threads)
        for layer, ops in enumerate(layers):
            if attention:
                *split, last = ops
                if split:                               # the split calls, then the combine
                    ints = [[a for a in arguments if not isinstance(a, float)] for _, arguments in split]
                    floats = [a for a in split[0][1] if isinstance(a, float)]
                    plan.add(split[0][0], float_args=floats, chunks=ints)
                f, arguments = last
                plan.add(f, int_args=[a for a in arguments if not isinstance(a, float)],
                         float_args=[a for a in arguments if isinstance(a, float)])
            if stream and streams:
                buffer = streams[layer]
                part = buffer.nbytes // n_threads // 128 * 128
                plan.add(probe, chunks=[[buffer.ctypes.data + i * part, part, 1] for i in range(n_threads)])
        return plan
    both, alone = build(True, True), build(False, True)

    def fn(layer):
        both.run(pool)
    fn.both = lambda: both.run(pool)
    fn.streams = lambda: alone.run(pool)
    return fn


if __name__ == "__main__":
    main()
