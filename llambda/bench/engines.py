"""``llambda bench``: llambda beside llama.cpp on the same GGUF, threads and context.

Every measurement runs in a fresh child process (so load time and peak RSS
are each engine's own), engines and thread counts interleaved, repeated;
medians with min-max. "start-up" is the whole process: from the driver
starting the child to the first token of a short prompt (interpreter, imports,
load and that token), the figure a user waits for. llama.cpp comes from the optional ``llama-cpp-python``
package (``pip install -e '.[bench]'``); without it only llambda is measured.
The machine's ceilings are measured by llambda's own probe kernels and every
figure is also given as a fraction of its ceiling:
  decode  against read bandwidth / bytes of weights read per token,
  prefill against FMA-or-INT8 peak / FLOPs per token.
"""
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

PROMPT_SIZES = (128, 512)
STARTUP_PROMPT = "Hi"       # the short prompt whose first token ends the start-up figure
GEN_TOKENS = 128
ENGINES = ("llambda", "llama.cpp")


# -- one engine, one thread count, in a child process ----------------------------
def _random_prompt(vocab, n, seed=0):
    # ids from the middle of the vocabulary: ordinary tokens, no specials
    rng = np.random.default_rng(seed)
    return rng.integers(min(1000, vocab // 4), vocab - 10, n).tolist()


def _measure_llambda(model_path, threads, n_ctx, prompt_sizes, gen_tokens, spawned, kv_type=None):
    import llambda
    t = time.perf_counter()
    m = llambda.load(model_path, n_ctx=n_ctx, threads=threads, progress=False, kv_type=kv_type)
    load_s = time.perf_counter() - t
    int(np.argmax(m.evaluate(m.tokenize(STARTUP_PROMPT))))
    out = dict(load_s=load_s, startup_s=time.time() - spawned)
    vocab = m.config.vocab_size
    for n in prompt_sizes:
        ids = _random_prompt(vocab, n)
        m.logits(ids[:1])                       # empty the cache; warm
        t = time.perf_counter()
        m.evaluate(ids)
        out[f"prefill{n}_s"] = time.perf_counter() - t
    out["ttft_s"] = out[f"prefill{prompt_sizes[0]}_s"]
    # decode as `llambda run` does it: greedy through the engine thread; gen_tokens steps
    # after the token that the prompt's logits give. evaluate()'s blocks go back to the pool
    # first, so that generate()'s sequence reuses their memory (the peak RSS a run has)
    m.reset()
    c = m.submit(ids, max_tokens=gen_tokens + 1, temperature=0.0, ignore_eos=True)
    for _ in c:
        pass
    out["decode_s"] = c.t_end - c.t_first
    m.close()
    return out


def _measure_llamacpp(gguf_path, threads, n_ctx, prompt_sizes, gen_tokens, spawned):
    import llama_cpp
    t = time.perf_counter()
    # flash attention: llama.cpp's fastest CPU setting, the one llambda is compared with
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, flash_attn=True, verbose=False)
    load_s = time.perf_counter() - t
    vocab = llm.n_vocab()
    llm.eval(llm.tokenize(STARTUP_PROMPT.encode()))
    int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))))
    out = dict(load_s=load_s, startup_s=time.time() - spawned)
    for n in prompt_sizes:
        ids = _random_prompt(vocab, n)
        llm.reset()
        llm.eval(ids[:1])
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        out[f"prefill{n}_s"] = time.perf_counter() - t
    out["ttft_s"] = out[f"prefill{prompt_sizes[0]}_s"]

    def last_logits():
        return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))

    t = time.perf_counter()
    for _ in range(gen_tokens):
        nxt = int(np.argmax(last_logits()))     # greedy, like the llambda side
        llm.eval([nxt])
    out["decode_s"] = time.perf_counter() - t
    return out


def child_main(argv):
    engine, model, gguf, threads, n_ctx, prompt_sizes, gen_tokens, spawned = argv
    threads, n_ctx, gen_tokens = int(threads), int(n_ctx), int(gen_tokens)
    prompt_sizes = [int(n) for n in prompt_sizes.split(",")]
    engine, _, kv_type = engine.partition(":")          # "llambda:q8_0": llambda with that KV cache type
    if engine == "llambda":
        out = _measure_llambda(model, threads, n_ctx, prompt_sizes, gen_tokens, float(spawned), kv_type or None)
    else:
        out = _measure_llamacpp(gguf, threads, n_ctx, prompt_sizes, gen_tokens, float(spawned))
    out["peak_rss_mb"] = _peak_rss_mb()
    print(json.dumps(out))


def _peak_rss_mb():
    """This process's peak resident set. VmHWM belongs to the address space made at
    exec; getrusage's ru_maxrss would also count the parent's peak before the exec."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- the driver --------------------------------------------------------------------
def _run_child(engine, model, gguf, threads, n_ctx, prompt_sizes=PROMPT_SIZES, gen_tokens=GEN_TOKENS):
    # This file as a script, not `-m llambda.bench.engines`: llama.cpp's child then imports nothing of
    # llambda (whose package import would count in its start-up); -P keeps llambda/ off sys.path.
    proc = subprocess.run([sys.executable, "-P", os.path.abspath(__file__), "--child", engine, str(model), str(gguf),
                           str(threads), str(n_ctx), ",".join(map(str, prompt_sizes)), str(gen_tokens),
                           repr(time.time())],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} benchmark failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


PAGE_CACHE_NOTE = "Both engines' weight files were read into the page cache in 2 MiB folios first."


def same_page_cache(*paths):
    """Each engine's weight file cached in 2 MiB folios before it is measured
    (runtime/page_cache.py): llambda writes its own file so, and llama.cpp's GGUF gets the
    same, so that neither engine's figures depend on how its file last came into the page
    cache (a file mapped in 4 KiB pages decodes measurably slower, in both engines)."""
    from llambda.runtime import page_cache
    for path in paths:
        page_cache.recache(path)


def _have_llamacpp():
    try:
        import llama_cpp  # noqa: F401
        return True
    except ImportError:
        return False


def _model_costs(model_path):
    """Bytes of weights read per decoded token, matrix FLOPs per prompt token (the LM head
    runs once per prompt, not per token), from the file, and whether every matrix the
    prompt's FLOPs run on is float (its GEMMs run on FMAs, not the int8 kernels)."""
    from llambda.model.convert import load_model_file
    from llambda.runtime.kinds import quantized_kinds
    from llambda.runtime.layouts import PackedWeight
    config, _, weights = load_model_file(model_path)
    read = flops = 0
    float_matrices = True
    for name, w in weights.items():
        if not isinstance(w, PackedWeight):
            read += w.nbytes
            continue
        is_lm_head = name == "output.weight" or (name == "token_embd.weight" and config.tied_embeddings)
        if name == "token_embd.weight" and not config.tied_embeddings:
            continue                       # only one embedding row is read per token
        read += w.nbytes
        if not is_lm_head:
            flops += 2 * w.n * w.k
            float_matrices = float_matrices and w.kind not in quantized_kinds()
    return config, read, flops, float_matrices


def run(model=None, threads=(1, 2), repeats=3, n_ctx=1024, as_json=False, out=sys.stdout, gen_tokens=GEN_TOKENS,
        busy_cpu=None, prompt_sizes=PROMPT_SIZES):
    """``busy_cpu``: measure while another process spins on that CPU (the ceilings are
    measured before it starts). ``prompt_sizes``: the prompts whose prefill is timed, in
    ascending order (the smallest's is the time to first token; the decode follows the
    largest, which is put against the prefill ceiling); the context must hold the largest and
    the decoded tokens after it."""
    if not prompt_sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in prompt_sizes):
        raise ValueError(f"prompt_sizes: expected positive token counts, got {prompt_sizes!r}")
    prompt_sizes = tuple(sorted(set(prompt_sizes)))
    if max(prompt_sizes) + gen_tokens > n_ctx:
        raise ValueError(f"n_ctx: {n_ctx} positions do not hold a prompt of {max(prompt_sizes)} tokens and "
                         f"{gen_tokens} decoded after it")
    from llambda.model import catalog
    from llambda.model import convert
    from llambda.model import default_model
    from llambda.bench.busy_core import busy_core, check_cpu
    if busy_cpu is not None:
        check_cpu(busy_cpu)
    from llambda.runtime import ceilings
    gguf = default_model.gguf_path() if model is None else catalog.resolve(model)
    model_path = convert.ensure_converted(gguf)
    if open(gguf, "rb").read(4) != b"GGUF":
        raise SystemExit("llambda bench: --model must be a GGUF (llama.cpp runs the same file)")
    engines = ENGINES if _have_llamacpp() else ENGINES[:1]
    if len(engines) == 1:
        print("llambda bench: llama-cpp-python is not installed (pip install -e '.[bench]'); "
              "measuring llambda only", file=sys.stderr)
    config, bytes_per_token, flops_per_token, float_matrices = _model_costs(model_path)
    same_page_cache(gguf, model_path)
    from llambda.runtime.native.quant import widest_qgemm_isa
    prefill_isa = widest_qgemm_isa()                  # the int8 kernels prefill runs on
    peaks = dict(fma=ceilings.fma_peak_gflops(), fma_zmm=ceilings.fma_peak_gflops("avx512"),
                 int8=ceilings.int8_peak_gops(prefill_isa), int8_isa=prefill_isa,
                 bw={t: ceilings.read_bandwidth_gbs(t) for t in threads},
                 # the same loop over a buffer of what a decode step reads: at a model's size the
                 # caches may hold part of it, which a 256 MB buffer never sees
                 bw_model={t: ceilings.read_bandwidth_gbs(t, nbytes=_probe_size(bytes_per_token)) for t in threads})

    # what prefill runs on: the int8 kernels, or for a float model the FMAs (zmm when the CPU has them)
    if float_matrices:
        peaks["prefill"] = ("FMA zmm", peaks["fma_zmm"]) if peaks["fma_zmm"] else ("FMA ymm", peaks["fma"])
    else:
        peaks["prefill"] = ("INT8", peaks["int8"])
    results = {(e, t): [] for e in engines for t in threads}
    with busy_core(busy_cpu):
        for rep in range(repeats):
            for t in threads:
                for e in engines:
                    print(f"[bench] {e} threads={t} run {rep + 1}/{repeats}", file=sys.stderr, flush=True)
                    results[(e, t)].append(_run_child(e, model_path, gguf, t, n_ctx, prompt_sizes, gen_tokens))

    rows = _summarise(results, engines, threads, bytes_per_token, flops_per_token, peaks, gen_tokens, prompt_sizes)
    report = dict(model=str(gguf), date=time.strftime("%Y-%m-%d"), machine=_machine(),
                  ceilings=dict(fma_gflops_per_core=peaks["fma"], fma_zmm_gflops_per_core=peaks["fma_zmm"],
                                int8_gops_per_core=peaks["int8"], int8_isa=peaks["int8_isa"],
                                read_gbs=peaks["bw"], read_gbs_at_model_size=peaks["bw_model"],
                                prefill=peaks["prefill"][0]),
                  bytes_per_token=bytes_per_token, flops_per_token=flops_per_token, repeats=repeats,
                  gen_tokens=gen_tokens, busy_cpu=busy_cpu, prompt_sizes=list(prompt_sizes),
                  n_ctx=n_ctx, rows=rows)
    if as_json:
        print(json.dumps(report, indent=1), file=out)
    else:
        print(_markdown(report, engines, threads), file=out)
    return report


INT8_IDIOM = {"avx2": "vpmaddubsw+vpmaddwd ymm", "avx512": "vpdpbusd zmm"}
SWEEP_CONTEXTS = (128, 512, 1024, 2048, 4096)
SWEEP_TOKENS = 32


SWEEP_KV_TYPES = ("f16", "q8_0", "f32")      # the default first


def read_per_token(config, weight_bytes, context, kv_type):
    """Bytes a decode step reads at ``context`` keys: every weight once, and the whole KV cache
    (K and V of every layer) up to the step's position."""
    from llambda.serving.kv_pool import KVPool
    from llambda.codegen.contract import KV_BLOCK
    return weight_bytes + KVPool.block_bytes(config, kv_type) / KV_BLOCK * context


def sweep_floors(config, weight_bytes, contexts, kv_types, read_gbs):
    """The memory's floor under each sweep row: the bytes a step reads at the decode window's
    middle position, and the tok/s at which ``read_gbs(nbytes)`` (a read loop over a buffer of
    that size: the working set decides how much the caches hold) delivers them."""
    rows = []
    for ctx in contexts:
        for kv in kv_types:
            nbytes = read_per_token(config, weight_bytes, ctx + SWEEP_TOKENS / 2, kv)
            gbs = read_gbs(int(nbytes))
            rows.append(dict(context=ctx, kv=kv, mb=nbytes / 1e6, gbs=gbs, floor=gbs * 1e9 / nbytes))
    return rows


def _floor_table(floors, rows, threads):
    """Markdown: each (context, KV type)'s floor, its fraction of the same type's floor at the
    shortest context, and llambda's speed as a fraction of it."""
    speed = {(r["context"], e.split(":")[1]): r[e] for r in rows for e in r if e.startswith("llambda:")}
    first = {f["kv"]: f["floor"] for f in floors if f["context"] == floors[0]["context"]}
    lines = [f"The memory's floor: bytes read per token (weights and the KV cache at the decode window's "
             f"middle), over what `llb_probe_read__avx2` reads from a buffer of that size on {threads} "
             "thread(s) (the working set decides how much of it the caches hold); (x) = the fraction of the "
             f"same cache type's floor at {floors[0]['context']}: the fraction above for an engine that "
             "reads at the probe's rate at every context.", "",
             "| context | KV | MB per token | read rate (GB/s) | floor (tok/s) | llambda / floor |",
             "|---|---|---|---|---|---|"]
    for f in floors:
        done = speed.get((f["context"], f["kv"]))
        share = "-" if done is None else f"{done / f['floor']:.2f}"
        lines.append(f"| {f['context']} | {f['kv']} | {f['mb']:.1f} | {f['gbs']:.1f} | "
                     f"{f['floor']:.1f} ({f['floor'] / first[f['kv']]:.2f}) | {share} |")
    return "\n".join(lines)


def run_sweep(model=None, threads=1, repeats=1, out=sys.stdout):
    """Decode speed as the context grows (attention reads the whole KV cache per token), for
    each KV cache type, beside llama.cpp (its default f16 cache, flash attention on)."""
    from llambda.model import catalog
    from llambda.model import convert
    from llambda.model import default_model
    gguf = default_model.gguf_path() if model is None else catalog.resolve(model)
    model_path = convert.ensure_converted(gguf)
    engines = [f"llambda:{t}" for t in SWEEP_KV_TYPES] + (["llama.cpp"] if _have_llamacpp() else [])
    same_page_cache(gguf, model_path)
    # every context in each round, so each row's median and the fractions of the shortest
    # context's speed mix the same minutes of a shared host
    speeds = {(ctx, e): [] for ctx in SWEEP_CONTEXTS for e in engines}
    for rep in range(repeats):
        for ctx in SWEEP_CONTEXTS:
            for e in engines:
                run = _run_child(e, model_path, gguf, threads, ctx + SWEEP_TOKENS + 8, (ctx,), SWEEP_TOKENS)
                speeds[(ctx, e)].append(SWEEP_TOKENS / run["decode_s"])
            print(f"[bench] round {rep + 1}/{repeats}: context {ctx} done", file=sys.stderr, flush=True)
    rows = [dict(context=ctx, **{e: statistics.median(speeds[(ctx, e)]) for e in engines}) for ctx in SWEEP_CONTEXTS]
    short = rows[0]
    names = [e.replace("llambda:", "llambda ") for e in engines]
    lines = [f"Decode tok/s after a prompt of N tokens ({SWEEP_TOKENS} tokens decoded), {threads} thread(s), "
             f"median of {repeats} rounds of every context; (x) = the fraction of the same engine's speed after "
             f"{short['context']}. "
             + PAGE_CACHE_NOTE, "",
             "| context | " + " | ".join(names) + (" | f16 / llama.cpp |" if "llama.cpp" in engines else " |"),
             "|" + "---|" * (1 + len(engines) + ("llama.cpp" in engines))]
    for r in rows:
        line = f"| {r['context']} | " + " | ".join(f"{r[e]:.1f} ({r[e] / short[e]:.2f})" for e in engines)
        if "llama.cpp" in engines:
            line += f" | {r['llambda:f16'] / r['llama.cpp']:.2f}x"
        lines.append(line + " |")
    print("\n".join(lines), file=out)
    from llambda.runtime import ceilings
    config, weight_bytes = _model_costs(model_path)[:2]
    rates = {}

    def read_gbs(nbytes):
        size = _probe_size(nbytes)
        if size not in rates:
            rates[size] = ceilings.read_bandwidth_gbs(threads, nbytes=size)
        return rates[size]
    floors = sweep_floors(config, weight_bytes, SWEEP_CONTEXTS, SWEEP_KV_TYPES, read_gbs)
    print("\n" + _floor_table(floors, rows, threads), file=out)
    return rows


PROBE_MAX = 1 << 30          # past this no cache holds a useful share: the rate is the memory's


def _probe_size(nbytes):
    """A read probe's buffer for ``nbytes``: rounded up to 4 MiB, so nearby sizes share a probe,
    and at most PROBE_MAX, so a large model's bench does not allocate its size again."""
    return min(-(-int(nbytes) // (4 << 20)) * (4 << 20), PROBE_MAX)


def _machine():
    try:
        import cpuinfo
        brand = cpuinfo.get_cpu_info().get("brand_raw", "")
    except Exception:
        brand = ""
    return f"{brand}, {os.cpu_count()} logical CPUs"


def _stat(values):
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def _summarise(results, engines, threads, bytes_per_token, flops_per_token, peaks, gen_tokens,
               prompt_sizes=PROMPT_SIZES):
    rows = []
    for t in threads:
        for e in engines:
            runs = results[(e, t)]
            row = dict(engine=e, threads=t)
            for n in prompt_sizes:
                row[f"prefill{n}_tok_s"] = _stat([n / r[f"prefill{n}_s"] for r in runs])
            row["decode_tok_s"] = _stat([gen_tokens / r["decode_s"] for r in runs])
            row["ttft_ms"] = _stat([1000 * r["ttft_s"] for r in runs])
            row["load_ms"] = _stat([1000 * r["load_s"] for r in runs])
            row["startup_ms"] = _stat([1000 * r["startup_s"] for r in runs])
            row["peak_rss_mb"] = _stat([r["peak_rss_mb"] for r in runs])
            decode_ceiling = peaks["bw"][t] * 1e9 / bytes_per_token
            prefill_ceiling = peaks["prefill"][1] * 1e9 * t / flops_per_token
            row["decode_pct_ceiling"] = row["decode_tok_s"]["median"] / decode_ceiling
            row["decode_pct_model_read"] = (row["decode_tok_s"]["median"] * bytes_per_token
                                            / (peaks["bw_model"][t] * 1e9))
            longest = max(prompt_sizes)
            row["prefill_pct_ceiling"] = dict(prompt=longest,
                                              pct=row[f"prefill{longest}_tok_s"]["median"] / prefill_ceiling)
            rows.append(row)
    return rows


def _markdown(report, engines, threads):
    c = report["ceilings"]
    lines = [f"Model: {report['model']}  ", f"Machine: {report['machine']}; {report['date']}; "
             f"median of {report['repeats']} runs (min-max)  ",
             f"Ceilings (measured): FMA {c['fma_gflops_per_core']:.0f} GFLOP/s/core with ymm"
             + (f" ({c['fma_zmm_gflops_per_core']:.0f} with zmm)" if c.get("fma_zmm_gflops_per_core") else "")
             + f", INT8 "
             f"{c['int8_gops_per_core']:.0f} GOP/s/core ({INT8_IDIOM[c['int8_isa']]}, what a quantized model's prefill runs on), read "
             + ", ".join(f"{v:.1f} GB/s ({t} thr)" for t, v in c["read_gbs"].items()) + " over 256 MB, "
             + ", ".join(f"{v:.1f} ({t} thr)" for t, v in c["read_gbs_at_model_size"].items())
             + " over the model's size"
             + f"; {report['bytes_per_token'] / 1e6:.1f} MB read and "
             f"{report['flops_per_token'] / 1e9:.2f} GFLOP per token"]
    lines[-1] += "  "
    lines.append(PAGE_CACHE_NOTE)
    if report.get("busy_cpu") is not None:
        lines.append(f"Measured with CPU {report['busy_cpu']} kept busy by another process (--busy-core)  ")
    lines.append("")
    metrics = [(f"prefill{n}_tok_s", f"prefill {n} (tok/s)", True) for n in report.get("prompt_sizes", PROMPT_SIZES)]
    metrics += [("decode_tok_s", f"decode {report['gen_tokens']} (tok/s)", True), ("ttft_ms", "time to first token (ms)", False),
               ("load_ms", "load (ms)", False),
               ("startup_ms", f"start-up to first token of {STARTUP_PROMPT!r} (ms)", False),
               ("peak_rss_mb", "peak RSS (MB)", False)]
    header = "| metric | threads | " + " | ".join(engines) + (" | llambda / llama.cpp |" if len(engines) > 1 else " |")
    lines += [header, "|" + "---|" * (len(engines) + 2 + (len(engines) > 1))]
    by = {(r["engine"], r["threads"]): r for r in report["rows"]}
    for key, label, higher_better in metrics:
        for t in threads:
            cells = []
            for e in engines:
                s = by[(e, t)][key]
                cells.append(f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})")
            line = f"| {label} | {t} | " + " | ".join(cells)
            if len(engines) > 1:
                a, b = by[("llambda", t)][key]["median"], by[("llama.cpp", t)][key]["median"]
                line += f" | {a / b:.2f}x"
            lines.append(line + " |")
    lines.append("")
    for t in threads:
        for e in engines:
            r = by[(e, t)]
            lines.append(f"- {e}, {t} thread(s): decode at {r['decode_pct_ceiling']:.0%} of the bandwidth ceiling "
                         f"({r['decode_pct_model_read']:.0%} of the read rate over the model's size), "
                         f"prefill {r['prefill_pct_ceiling']['prompt']} at {r['prefill_pct_ceiling']['pct']:.0%} of the "
                         f"{c.get('prefill', 'INT8')} ceiling")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
    else:
        run()
