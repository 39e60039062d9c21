"""GET /metrics: the engine's gauges and counters in Prometheus' text format.

The engine keeps its own totals (Model.stats()); a collector reads them at scrape time, so
nothing is counted twice and the numbers are the engine's. What only the server sees (time to
first token, whole-request latency, answers refused) is kept here with prometheus_client's
own types. Each app has a registry of its own, so several servers in one process (tests) do
not share metrics.
"""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# (name in Model.stats(), metric name, help)
GAUGES = (
    ("requests_running", "llambda_requests_running", "Sequences in the engine's batch now"),
    ("requests_waiting", "llambda_requests_waiting", "Requests queued for a slot"),
    ("kv_blocks_in_use", "llambda_kv_blocks_in_use", "KV-cache blocks held by running sequences"),
    ("kv_blocks_total", "llambda_kv_blocks_total", "KV-cache blocks in the pool"),
)
COUNTERS = (      # prometheus_client appends _total
    ("requests", "llambda_requests", "Requests the engine accepted"),
    ("prompt_tokens", "llambda_prompt_tokens", "Prompt tokens of admitted requests"),
    ("generated_tokens", "llambda_generated_tokens", "Tokens generated"),
    ("cached_tokens", "llambda_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
    ("steps", "llambda_engine_steps", "Engine steps (batched plan runs)"),
    ("step_seconds", "llambda_engine_step_seconds", "Time in engine steps: plan runs, sampling, detokenizing"),
    ("constraint_seconds", "llambda_constraint_seconds",
     "Time in steps spent on grammars: token masks, applying them, advancing matchers"),
)


class _EngineCollector:
    def __init__(self, model):
        self.model = model

    def collect(self):
        stats = self.model.stats()
        for key, name, doc in GAUGES:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], stats[key])
            yield g
        for key, name, doc in COUNTERS:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], stats[key])
            yield c
        # vLLM's names for the same gauges, which routers and dashboards made for vLLM read
        used = stats["kv_blocks_in_use"] / stats["kv_blocks_total"] if stats["kv_blocks_total"] else 0.0
        for name, value, doc in (
                ("vllm:num_requests_running", stats["requests_running"], "Requests running (llambda_requests_running)"),
                ("vllm:num_requests_waiting", stats["requests_waiting"], "Requests waiting (llambda_requests_waiting)"),
                ("vllm:kv_cache_usage_perc", used, "KV-cache usage, 1 is full (llambda_kv_blocks_in_use / _total)")):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g


class Metrics:
    def __init__(self, model):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(model))
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("llambda_time_to_first_token_seconds", "From submission to the first token",
                              buckets=buckets, registry=self.registry)
        self.latency = Histogram("llambda_request_duration_seconds", "From submission to the last token",
                                 buckets=buckets + (120, 300), registry=self.registry)
        self.errors = Counter("llambda_http_errors", "Requests answered with an error, by status",
                              ["status"], registry=self.registry)
        self.disconnects = Counter("llambda_client_disconnects", "Requests cancelled because the client left",
                                   registry=self.registry)

    def finished(self, completion):
        c = completion
        if c.t_first is not None:
            self.ttft.observe(c.t_first - c.t_submit)
        if c.t_end is not None:
            self.latency.observe(c.t_end - c.t_submit)

    def error(self, status):
        self.errors.labels(status=str(status)).inc()

    def render(self):
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
