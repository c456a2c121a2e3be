"""Prometheus metrics of ``rose-serve`` (``/metrics``, the ``prometheus_client`` library).

Engine state is read at scrape time (running, waiting, KV usage, prefix-cache
hits, preemptions, and with a KV tier the hit rate per tier and the bytes
offloaded to and loaded from it, labelled ``tier``); latencies are observed by
the server as tokens stream: TTFT from ``add_request`` to the first token's
step end, ITL between a request's consecutive token step ends, E2EL to the
last (seconds, on the engine clock). Names follow vLLM's metrics
(``vllm:num_requests_running``, ...) with the ``roseinfer_`` prefix; bucket
edges are those vLLM uses for the same histograms (vllm/v1/metrics/loggers.py),
cut to the range a CPU run spans.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from roseinfer.executor.streaming import StreamingEngine
from roseinfer.kv_tiers import kv_tier_summary

TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS_S = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
E2EL_BUCKETS_S = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
)


class _EngineCollector(Collector):
    """Gauges and counters read from the scheduler at scrape time."""

    def __init__(self, engine: StreamingEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        sched = self.engine.engine.scheduler
        bm = sched.block_manager
        yield _gauge("num_requests_running", "Requests in the running set.", len(sched.running))
        yield _gauge(
            "num_requests_waiting", "Requests waiting for admission.", self.engine.num_waiting()
        )
        yield _gauge(
            "kv_cache_usage_perc",
            "Share of KV blocks in use (0..1).",
            bm.num_used_blocks / bm.num_blocks,
        )
        yield _gauge("num_kv_blocks_used", "KV blocks in use.", bm.num_used_blocks)
        queried, hits = bm.num_queried_tokens, bm.num_hit_tokens
        yield _gauge(
            "prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up (0 before any).",
            hits / queried if queried else 0.0,
        )
        yield _counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queried
        )
        yield _counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", hits)
        yield _counter("num_preemptions", "Preemptions (by recompute).", sched.num_preemptions)
        yield from _kv_tier_metrics(bm.kv_tier_counters())


def _kv_tier_metrics(counters: dict) -> Iterator[Metric]:
    """Hit rate per KV tier (device and each tier below it) and bytes moved per tier
    (``roseinfer.kv_tiers.kv_tier_summary``); nothing without tiers."""
    if not counters:
        return
    summary = kv_tier_summary([counters])
    rate = GaugeMetricFamily(
        "roseinfer_kv_tier_hit_rate",
        "Prompt tokens served from this tier (device: its prefix cache; a lower tier: "
        "loaded from it) / prompt tokens looked up.",
        labels=["tier"],
    )
    offloaded = CounterMetricFamily(
        "roseinfer_kv_offloaded_bytes",
        "Bytes of KV blocks written into this tier (offloads from the device, demotions).",
        labels=["tier"],
    )
    loaded = CounterMetricFamily(
        "roseinfer_kv_loaded_bytes", "Bytes of KV blocks loaded from this tier.", labels=["tier"]
    )
    rate.add_metric(["device"], summary["kv_hit_rate_device"])
    for name in counters["tiers"]:
        rate.add_metric([name], summary[f"kv_hit_rate_{name}"])
        offloaded.add_metric([name], summary[f"kv_offloaded_bytes_{name}"])
        loaded.add_metric([name], summary[f"kv_loaded_bytes_{name}"])
    yield from (rate, offloaded, loaded)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"roseinfer_{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"roseinfer_{name}", doc, value=value)


class ServerMetrics:
    """The server's registry: engine state plus latency histograms and request outcomes.

    Args:
        engine: the streaming engine served.
    """

    def __init__(self, engine: StreamingEngine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram(
            "roseinfer_time_to_first_token_seconds",
            "Time to first token (s): add_request to the first token's step end.",
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.itl = Histogram(
            "roseinfer_inter_token_latency_seconds",
            "Time between a request's consecutive tokens (s).",
            buckets=ITL_BUCKETS_S,
            registry=self.registry,
        )
        self.e2el = Histogram(
            "roseinfer_e2e_request_latency_seconds",
            "add_request to the last token (s), requests that finished.",
            buckets=E2EL_BUCKETS_S,
            registry=self.registry,
        )
        self.requests = Counter(
            "roseinfer_requests",
            "Completion requests by outcome, each counted once. Reached the engine: length, "
            "stop, aborted (the client left, also mid-body), failed (rejected by the "
            "scheduler, sampling failed, the engine stopped). Answered before: refused_<status> "
            "(400 a bad field, 404 another model, 408 a slow body, 413 a large body, 503 the "
            "waiting queue full, the engine stopped, or over --limit-concurrency: any route) "
            "and error_500 (a server fault).",
            ["outcome"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
