"""``llambda bench --serve``: `llambda serve` beside llama.cpp's `llama-server`, over HTTP.

Both servers get the same GGUF, threads, slots (``--parallel``) and context per slot;
llama-server runs with ``-fa on`` (flash attention, its fastest CPU path). For 1, 4, 8, 16
concurrent streams the client sends that many streamed completions at once (distinct prompts,
so no prefix is shared; ``ignore_eos`` so every stream generates its full ``max_tokens``) and
reports the aggregate generated tokens per second (all streams' tokens over the wall time
from the first request to the last token) and time to first token p50/p95. Each level runs
``repeats`` times; the first request to each server is a warm-up and not counted.

``constrained="json_schema"`` sends chat requests with ``response_format`` json_schema
(SCHEMA: a record with a title, tags and a summary) to both servers instead: each stream ends
when its JSON closes, so the rate counts the tokens each reply has (its usage); ``"half"``
constrains every other stream and leaves the rest plain chat. llama-server compiles the same
schema into its GBNF grammar, llambda into an llguidance matcher.

The client is the standard library's http.client in threads: it reads the SSE lines as they
come and stamps the first one that carries text. llama-server is optional: without one
(``--llama-server PATH``, else ``llama-server`` on PATH, else the build of
tools/build_llama_server.sh) only llambda is measured.
"""
import http.client
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

STREAMS = (1, 4, 8, 16)
START_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 600


def default_build():
    """Where tools/build_llama_server.sh puts llama-server by default: the llambda cache."""
    from llambda.runtime import paths
    return paths.cache_dir() / "llama-server" / "build" / "bin" / "llama-server"


# -- the servers ------------------------------------------------------------------------------
class Launched:
    """A server child process on 127.0.0.1:port; stop() ends it with SIGTERM (SIGKILL if stuck)."""

    def __init__(self, name, cmd, env=None):
        self.name = name
        self.log = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.port = None
        self._found = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line)
            m = re.search(r"http://(?:127\.0\.0\.1|\[::1\]|localhost):(\d+)", line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self._found.set()
        self._found.set()

    def wait_ready(self, port=None):
        """Wait for the address (or use ``port``), then for GET /health to answer 200."""
        deadline = time.monotonic() + START_TIMEOUT_S
        if port is not None:
            self.port = port
        else:
            self._found.wait(START_TIMEOUT_S)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.port is not None:
                try:
                    c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                    c.request("GET", "/health")
                    if c.getresponse().status == 200:
                        return self
                except OSError:
                    pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} did not start:\n" + "".join(self.log[-30:]))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llambda(gguf, threads, parallel, n_ctx):
    cmd = [sys.executable, "-m", "llambda.cli", "serve", "--model", str(gguf), "--port", "0",
           "--threads", str(threads), "--parallel", str(parallel), "--ctx", str(n_ctx),
           "--max-waiting", "256"]
    return Launched("llambda", cmd).wait_ready()


def start_llama_server(binary, gguf, threads, parallel, n_ctx):
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(parallel), "-c", str(n_ctx * parallel), "-fa", "on", "--no-webui"]
    return Launched("llama-server", cmd).wait_ready(port)


def find_llama_server(given=None):
    if given:
        if not Path(given).is_file():
            from llambda.errors import UserError
            raise UserError(f"--llama-server {given}: no such file (build one with tools/build_llama_server.sh)")
        return Path(given)
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    built = default_build()
    return built if built.is_file() else None


# -- the client -------------------------------------------------------------------------------
def prompt_text(i, words=48):
    rng = np.random.default_rng(1000 + i)
    vocab = ("river mountain city number story light garden window music paper stone forest engine "
             "market winter summer island bridge letter school").split()
    return f"Story {i}: " + " ".join(vocab[j] for j in rng.integers(0, len(vocab), words))


SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "summary": {"type": "string"}}, "required": ["title", "tags", "summary"], "additionalProperties": False}
CONSTRAINED = ("none", "json_schema", "half")


def request_body(model, prompt, max_tokens, schema=None):
    """(path, JSON body) of one streamed request: a plain completion, or with ``schema`` a chat
    request whose reply must be JSON of that schema."""
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "seed": 1, "stream": True,
              "stream_options": {"include_usage": True}}
    if schema is None:
        return "/v1/completions", json.dumps(dict(common, prompt=prompt, ignore_eos=True))
    messages = [{"role": "user", "content": f"Describe this story as JSON with a title, tags and a summary. {prompt}"}]
    return "/v1/chat/completions", json.dumps(dict(common, messages=messages, response_format={
        "type": "json_schema", "json_schema": {"name": "story", "schema": schema, "strict": True}}))


def one_stream(port, model, prompt, max_tokens, out, schema=None):
    """POST one streamed request; fill ``out`` with t_first, t_end, tokens."""
    path, body = request_body(model, prompt, max_tokens, schema)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    t0 = time.perf_counter()
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            out["error"] = f"HTTP {r.status}: {r.read()[:200]!r}"
            return
        chunks, usage = 0, None
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if obj.get("usage"):
                usage = obj["usage"]
            for choice in obj.get("choices", ()):
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    out.setdefault("t_first", time.perf_counter() - t0)
        out["t_end"] = time.perf_counter() - t0
        out["tokens"] = usage["completion_tokens"] if usage else chunks
    except OSError as e:
        out["error"] = str(e)
    finally:
        conn.close()


def stream_schema(constrained, i):
    """The schema stream ``i`` is held to (None: unconstrained)."""
    if constrained == "json_schema" or (constrained == "half" and i % 2 == 0):
        return SCHEMA
    return None


def run_level(port, model, streams, max_tokens, round_index, constrained="none"):
    outs = [{} for _ in range(streams)]
    threads = [threading.Thread(target=one_stream, args=(port, model, prompt_text(round_index * 100 + i),
                                                         max_tokens, outs[i], stream_schema(constrained, i)))
               for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S)
    wall = time.perf_counter() - t0
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        raise RuntimeError(f"{len(errors)} of {streams} requests failed: {errors[0]}")
    return wall, outs


ENGINE_TOTALS = {"llambda_engine_steps_total": "steps", "llambda_engine_step_seconds_total": "step_s",
                 "llambda_constraint_seconds_total": "constraint_s"}


def engine_totals(port):
    """llambda serve's step count, time in steps and time spent on grammars (its /metrics)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    totals = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ENGINE_TOTALS:
            totals[ENGINE_TOTALS[name]] = float(value)
    return totals


def measure(server, model, streams_list, max_tokens, repeats, constrained="none"):
    one_stream(server.port, model, prompt_text(-1), 8, {}, stream_schema(constrained, 0))     # warm-up
    rows = []
    for streams in streams_list:
        rates, ttfts = [], []
        before = engine_totals(server.port) if server.name == "llambda" else None
        for r in range(repeats):
            wall, outs = run_level(server.port, model, streams, max_tokens, r * 1000 + streams, constrained)
            rates.append(sum(o["tokens"] for o in outs) / wall)
            ttfts += [o["t_first"] for o in outs if "t_first" in o]
        rows.append(dict(engine=server.name, streams=streams, tok_s=statistics.median(rates),
                         tok_s_min=min(rates), tok_s_max=max(rates),
                         ttft_p50_s=float(np.percentile(ttfts, 50)), ttft_p95_s=float(np.percentile(ttfts, 95)),
                         requests=len(ttfts), constrained=constrained))
        if before is not None:       # what a step cost, and the grammars' share of it
            after = engine_totals(server.port)
            steps = max(after["steps"] - before["steps"], 1)
            step_s = after["step_s"] - before["step_s"]
            rows[-1].update(step_ms=step_s / steps * 1000,
                            constraint_ms=(after["constraint_s"] - before["constraint_s"]) / steps * 1000)
        print(f"[bench --serve] {server.name:12} {streams:2} streams: {rows[-1]['tok_s']:7.1f} tok/s, "
              f"TTFT p50 {rows[-1]['ttft_p50_s'] * 1000:.0f} ms", file=sys.stderr, flush=True)
    return rows


def markdown(rows, threads, parallel, max_tokens, constrained="none"):
    from llambda.bench.engines import PAGE_CACHE_NOTE
    what = {"none": f"{max_tokens} tokens per stream",
            "json_schema": f"every stream a json_schema chat reply of up to {max_tokens} tokens",
            "half": f"every other stream a json_schema chat reply, up to {max_tokens} tokens"}[constrained]
    out = [f"threads {threads}, {parallel} slots, {what}, greedy, distinct prompts. "
           + PAGE_CACHE_NOTE, "",
           "| engine | streams | aggregate tok/s | per stream tok/s | TTFT p50 | TTFT p95 | step | grammars in a step |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        step = f"{r['step_ms']:.2f} ms" if "step_ms" in r else "—"
        grammar = f"{r['constraint_ms']:.3f} ms ({r['constraint_ms'] / r['step_ms']:.1%})" if r.get("step_ms") else "—"
        out.append(f"| {r['engine']} | {r['streams']} | {r['tok_s']:.1f} ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f})"
                   f" | {r['tok_s'] / r['streams']:.1f} | {r['ttft_p50_s'] * 1000:.0f} ms"
                   f" | {r['ttft_p95_s'] * 1000:.0f} ms | {step} | {grammar} |")
    return "\n".join(out)


def run(model=None, *, threads=2, parallel=None, streams=STREAMS, max_tokens=128, n_ctx=512, repeats=2,
        llama_server=None, engines=("llambda", "llama.cpp"), as_json=False, constrained="none"):
    if constrained not in CONSTRAINED:
        from llambda.errors import UserError
        raise UserError(f"--constrained: expected one of {', '.join(CONSTRAINED)}, got {constrained!r}")
    from llambda.model import catalog
    from llambda.model import default_model
    gguf = default_model.gguf_path() if model is None else Path(catalog.resolve(model))
    from llambda.bench.engines import same_page_cache
    from llambda.model.convert import ensure_converted
    same_page_cache(gguf, ensure_converted(gguf))
    parallel = parallel or max(streams)
    rows = []
    binary = find_llama_server(llama_server) if "llama.cpp" in engines else None
    if "llama.cpp" in engines and binary is None:
        print("[bench --serve] no llama-server (--llama-server PATH, or build one with "
              "tools/build_llama_server.sh): measuring llambda only", file=sys.stderr)
    starters = []
    if "llambda" in engines:
        starters.append(lambda: start_llambda(gguf, threads, parallel, n_ctx))
    if binary is not None:
        starters.append(lambda: start_llama_server(binary, gguf, threads, parallel, n_ctx))
    for start in starters:
        server = start()
        try:
            model_name = "llambda" if server.name == "llama-server" else _served_id(server.port)
            rows += measure(server, model_name, streams, max_tokens, repeats, constrained)
        finally:
            server.stop()
    report = dict(gguf=str(gguf), threads=threads, parallel=parallel, max_tokens=max_tokens, n_ctx=n_ctx,
                  repeats=repeats, constrained=constrained, rows=rows)
    print(json.dumps(report, indent=2) if as_json else markdown(rows, threads, parallel, max_tokens, constrained))
    return report


def _served_id(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/v1/models")
    return json.loads(c.getresponse().read())["data"][0]["id"]
