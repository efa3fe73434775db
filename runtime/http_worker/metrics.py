"""Metrics: the engine's published stats (runtime/engine_stats.py, shared by all workers)
and each worker's Prometheus counters and histograms, merged at scrape time.

Per-worker counters and histograms use prometheus_client's multiprocess mode: each
granian worker writes its own files in the server's metrics dir (set up by
`use_multiprocess_dir` before prometheus_client is first imported), and /metrics,
whichever worker answers it, merges every worker's. Latencies observed once per
streamed delta (inter-token) are counted in a local histogram and flushed once a
second: a prometheus_client observe in multiprocess mode costs too much to pay per delta
(docs/perf-notes.md).
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import Any

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


def use_multiprocess_dir(path: Path) -> None:
    """Per-worker metrics go to files in `path`; call before prometheus_client is imported."""
    path.mkdir(mode=0o700, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)


class LocalHistogram:
    """Counts observations here and adds them to a prometheus Histogram on flush()."""

    def __init__(self, histogram: Any, buckets: tuple[float, ...]) -> None:
        self.histogram = histogram
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one: +Inf
        self.total = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.total += value * count

    def flush(self) -> None:
        # prometheus_client keeps one (non-cumulative) value per bucket and the sum; adding
        # to them is what observe() does, for many observations at once
        h = self.histogram
        for i, n in enumerate(self.counts):
            if n:
                h._buckets[i].inc(n)
                self.counts[i] = 0
        if self.total:
            h._sum.inc(self.total)
            self.total = 0.0


class WorkerMetrics:
    """This worker's Prometheus metrics, counted locally per request and flushed (flush())
    about once a second and at every scrape; and /metrics for the whole server."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram, values

        self.multiprocess = values.ValueClass is not values.MutexValue
        self._requests = Counter("ringserve_requests", "HTTP generation requests received", ["endpoint"])
        self._finished = Counter("ringserve_requests_finished", "Choices finished", ["finish_reason"])
        self._tokens = {
            "prompt": Counter("ringserve_prompt_tokens", "Prompt tokens of finished choices"),
            "generation": Counter("ringserve_generation_tokens", "Generated tokens of finished choices"),
            "cached": Counter("ringserve_cached_tokens", "Prompt tokens served from the prefix cache"),
        }
        self.ttft = LocalHistogram(
            Histogram("ringserve_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS),
            TTFT_BUCKETS,
        )
        self.e2e = LocalHistogram(
            Histogram("ringserve_e2e_request_latency_seconds", "End-to-end request latency", buckets=E2E_BUCKETS),
            E2E_BUCKETS,
        )
        self.itl = LocalHistogram(
            Histogram(
                "ringserve_inter_token_latency_seconds",
                "Latency between streamed tokens (per delta, weighted by its tokens)",
                buckets=ITL_BUCKETS,
            ),
            ITL_BUCKETS,
        )
        self.requests: dict[str, int] = {}  # endpoint -> requests not flushed yet
        self._pending_finished: dict[str, int] = {}
        self._pending_tokens = {"prompt": 0, "generation": 0, "cached": 0}

    def count_request(self, endpoint: str) -> None:
        self.requests[endpoint] = self.requests.get(endpoint, 0) + 1

    def observe_request(self, arrival_ns: int, end_ns: int, choices: list) -> None:
        """A finished request: its choices' (ReqState) counts and latencies."""
        self.e2e.observe((end_ns - arrival_ns) * 1e-9)
        tokens, finished = self._pending_tokens, self._pending_finished
        for state in choices:
            if state.first_ns:
                self.ttft.observe((state.first_ns - arrival_ns) * 1e-9)
            tokens["prompt"] += state.prompt_tokens
            tokens["generation"] += state.completion_tokens
            tokens["cached"] += state.cached_tokens
            reason = state.finish.name.lower()
            finished[reason] = finished.get(reason, 0) + 1

    def flush(self) -> None:
        for endpoint, n in self.requests.items():
            self._requests.labels(endpoint).inc(n)
        for reason, n in self._pending_finished.items():
            self._finished.labels(reason).inc(n)
        for name, n in self._pending_tokens.items():
            if n:
                self._tokens[name].inc(n)
                self._pending_tokens[name] = 0
        self.requests, self._pending_finished = {}, {}
        for h in (self.ttft, self.e2e, self.itl):
            h.flush()

    def render(self, engine: dict[str, int] | None, worker: dict[str, Any]) -> tuple[bytes, str]:
        """The exposition text: every worker's metrics (multiprocess mode) or this worker's,
        plus the engine's gauges and this worker's ring depths."""
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest, multiprocess

        self.flush()
        if self.multiprocess:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
        else:
            registry = CollectorRegistry()
            registry.register(_Forward(REGISTRY))
        registry.register(_EngineCollector(engine, worker))
        return generate_latest(registry), CONTENT_TYPE_LATEST


class _Forward:
    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def collect(self):
        return self.registry.collect()


class _EngineCollector:
    """Gauges read at scrape time: the engine's published stats, this worker's rings."""

    def __init__(self, engine: dict[str, int] | None, worker: dict[str, Any]) -> None:
        self.engine, self.worker = engine, worker

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        up = GaugeMetricFamily("ringserve_engine_up", "1 while every engine process runs")
        up.add_metric([], 0.0 if self.worker["dead"] else 1.0)
        yield up
        rings = GaugeMetricFamily("ringserve_ring_depth", "Records waiting in a ring", labels=["ring", "worker"])
        for ring, depth in self.worker["rings"].items():
            rings.add_metric([ring, str(self.worker["index"])], depth)
        e = self.engine
        if e is not None:
            rings.add_metric(["token_out", ""], e["token_out_depth"])
        yield rings
        if e is None:
            return
        gauges = {
            "num_running_reqs": ("Requests running in the scheduler", e["running"]),
            "num_queue_reqs": ("Requests waiting in the scheduler's queue", e["queued"]),
            "kv_pages_total": ("KV cache pages", e["kv_pages_total"]),
            "kv_pages_free": ("KV cache pages free", e["kv_pages_free"]),
            "kv_pages_cached": ("KV cache pages held only by the prefix cache (evictable)", e["kv_pages_cached"]),
            "kv_pages_used": (
                "KV cache pages held by requests",
                e["kv_pages_total"] - e["kv_pages_free"] - e["kv_pages_cached"],
            ),
            "kv_page_size": ("Tokens per KV page", e["page_size"]),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily("ringserve_" + name, doc)
            g.add_metric([], value)
            yield g
        usage = GaugeMetricFamily("ringserve_kv_usage", "Share of KV pages held by requests")
        usage.add_metric([], gauges["kv_pages_used"][1] / max(e["kv_pages_total"], 1))
        yield usage
        seen = e["cached_tokens"] + e["prefill_tokens"]
        hit = GaugeMetricFamily(
            "ringserve_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache, as a share of all prompt tokens admitted",
        )
        hit.add_metric([], e["cached_tokens"] / seen if seen else 0.0)
        yield hit
        for name, doc in (
            ("steps", "Scheduler steps"),
            ("retractions", "Requests retracted for lack of KV pages"),
            ("engine_generated_tokens", "Tokens the scheduler generated"),
        ):
            c = CounterMetricFamily("ringserve_" + name, doc)
            c.add_metric([], e["generated_tokens" if name == "engine_generated_tokens" else name])
            yield c
