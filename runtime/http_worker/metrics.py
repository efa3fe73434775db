"""Metrics: the engine's published stats (runtime/engine_stats.py, shared by all workers)
and each worker's Prometheus counters and histograms, merged at scrape time.

Per-worker counters and histograms use prometheus_client's multiprocess mode: each
granian worker writes its own files in the server's metrics dir (set up by
`use_multiprocess_dir` before prometheus_client is first imported), and /metrics,
whichever worker answers it, merges every worker's. Latencies observed once per
streamed delta (inter-token) are counted in a local histogram and flushed once a
second: a prometheus_client observe in multiprocess mode costs too much to pay per delta
(docs/perf-notes.md).

What SGLang also measures goes by SGLang's name (`sglang:*`, labelled `model_name`: the
served model name), so SGLang's Grafana dashboard works unchanged; what it has no name for
(ring depths, KV pages, scheduler steps, finish reasons) by ringserve's (`ringserve_*`).
"""

from __future__ import annotations

import bisect
import os
from pathlib import Path
from typing import Any

from protocol.lora import MAX_LOADED_LORAS
from runtime.engine_stats import used_kv_pages
from runtime.http_worker.process_memory import resident_bytes
from runtime.http_worker.req_state import ReqState

# SGLang's names, label (model_name) and default buckets (python/sglang/srt/metrics/collector.py,
# TokenizerMetricsCollector), so that its Grafana dashboard reads ringserve unchanged
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0, 200.0, 400.0)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
    0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0, 100.0,
    200.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0,
)  # fmt: skip
# a choice's finish (protocol.records.Finish: NONE, STOP, LENGTH, ABORT, ERROR) as SGLang and
# vLLM label it: an error, a timeout, a dead engine, a client gone all end a request "abort"
FINISH_REASONS = ("abort", "stop", "length", "abort", "abort")
# the name prometheus_client's process collector (and vLLM) gives a process's RSS, here one
# sample per process of the server, labelled with its role and pid
RESIDENT_MEMORY = "process_resident_memory_bytes"


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
    about once a second and at every scrape; and /metrics for the whole server. Every label
    set is resolved here once: counting a request is plain dict and int arithmetic."""

    def __init__(self, model_name: str) -> None:
        from prometheus_client import Counter, Histogram, values

        self.model_name = model_name
        self.multiprocess = values.ValueClass is not values.MutexValue
        model = ["model_name"]
        self._requests = Counter("ringserve_requests", "HTTP generation requests received", ["endpoint"])
        finished = Counter(
            "ringserve_requests_finished", "Choices finished, by finish reason", ["model_name", "finish_reason"]
        )
        self._finished = {r: finished.labels(model_name, r) for r in sorted(set(FINISH_REASONS))}
        self._counters = {
            name: Counter(name, doc, model).labels(model_name)
            for name, doc in (
                ("sglang:prompt_tokens", "Number of prefill tokens processed."),
                ("sglang:generation_tokens", "Number of generation tokens processed."),
                ("sglang:cached_tokens", "Number of cached prompt tokens."),
                ("sglang:num_requests", "Number of requests processed."),
                ("sglang:num_aborted_requests", "Number of requests aborted."),
            )
        }

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> LocalHistogram:
            return LocalHistogram(Histogram(name, doc, model, buckets=buckets).labels(model_name), buckets)

        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", E2E_BUCKETS
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (per streamed delta, weighted by its tokens).",
            ITL_BUCKETS,
        )
        lora = ["lora_name"]
        self._lora_counters = (
            Counter("ringserve_lora_requests", "Requests (choices) that ran with a LoRA adapter", lora),
            Counter("ringserve_lora_generation_tokens", "Tokens generated with a LoRA adapter", lora),
        )
        self.lora_names: dict[int, str] = {}  # adapter id -> its name, as requests were submitted
        self._pending_lora: dict[str, list[int]] = {}  # adapter name -> [choices, tokens] not flushed yet
        self.requests: dict[str, int] = {}  # endpoint -> requests not flushed yet
        self._pending_finished = dict.fromkeys(self._finished, 0)
        self._pending = dict.fromkeys(self._counters, 0)

    def count_request(self, endpoint: str) -> None:
        self.requests[endpoint] = self.requests.get(endpoint, 0) + 1

    def name_adapter(self, lid: int, name: str) -> None:
        """A request was submitted with adapter `lid`, named `name` then: its tokens are counted
        under that name when it ends, even if the adapter was unloaded meanwhile. The oldest
        ids are forgotten past MAX_LOADED_LORAS (a request older than that many loads is not counted)."""
        names = self.lora_names
        if names.get(lid) != name:
            names.pop(lid, None)
            names[lid] = name
            if len(names) > MAX_LOADED_LORAS:
                del names[next(iter(names))]

    def observe_request(self, arrival_ns: int, end_ns: int, choices: list[ReqState]) -> None:
        """A request that ended, however (finished, aborted, failed): its choices' (ReqState)
        counts and latencies, each choice one of SGLang's requests."""
        e2e = (end_ns - arrival_ns) * 1e-9
        self.e2e.observe(e2e, len(choices))
        pending, finished = self._pending, self._pending_finished
        aborted = 0
        for state in choices:
            if state.first_ns:
                self.ttft.observe((state.first_ns - arrival_ns) * 1e-9)
            pending["sglang:prompt_tokens"] += state.prompt_tokens
            pending["sglang:generation_tokens"] += state.completion_tokens
            pending["sglang:cached_tokens"] += state.cached_tokens
            reason = FINISH_REASONS[state.finish]
            finished[reason] += 1
            aborted += reason == "abort"
            lid = state.params.lora_id
            if lid and lid in self.lora_names:
                counts = self._pending_lora.setdefault(self.lora_names[lid], [0, 0])
                counts[0] += 1
                counts[1] += state.completion_tokens
        pending["sglang:num_requests"] += len(choices)
        pending["sglang:num_aborted_requests"] += aborted

    def observe_delta(self, state: ReqState, now_ns: int) -> None:
        """Inter-token latency of a streamed delta: its interval spread over its tokens."""
        k = state.completion_tokens - state.sent_tokens
        if k > 0:
            if state.sent_tokens:
                self.itl.observe((now_ns - state.last_ns) * 1e-9 / k, k)
            state.sent_tokens, state.last_ns = state.completion_tokens, now_ns

    def flush(self) -> None:
        for endpoint, n in self.requests.items():
            self._requests.labels(endpoint).inc(n)
        self.requests = {}
        for pending, counters in ((self._pending_finished, self._finished), (self._pending, self._counters)):
            for name, n in pending.items():
                if n:
                    counters[name].inc(n)
                    pending[name] = 0
        for name, counts in self._pending_lora.items():
            for counter, n in zip(self._lora_counters, counts):
                if n:
                    counter.labels(name).inc(n)
        self._pending_lora = {}
        for h in (self.ttft, self.e2e, self.itl):
            h.flush()

    def render(self, engine: dict | None, worker: dict[str, Any]) -> tuple[bytes, str]:
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
        registry.register(_EngineCollector(self.model_name, engine, worker))
        return generate_latest(registry), CONTENT_TYPE_LATEST


class _Forward:
    """This worker's registry, less the default process collector's resident memory: the
    server's, per process, is _EngineCollector's."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def collect(self):
        return (family for family in self.registry.collect() if family.name != RESIDENT_MEMORY)


class _EngineCollector:
    """Gauges read at scrape time: the engine's published stats, this worker's rings, the
    engine's LoRA adapter pool, each process's resident memory."""

    def __init__(self, model_name: str, engine: dict | None, worker: dict[str, Any]) -> None:
        self.model_name, self.engine, self.worker = model_name, engine, worker

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
        lora = self.worker.get("lora")  # the engine's adapter pool (--enable-lora)
        if lora is not None:
            for name, doc, value in (
                ("lora_adapters_registered", "LoRA adapters requests may name", lora["count"]),
                ("lora_adapters_resident", "LoRA adapters whose weights are in memory", lora["resident"]),
            ):
                g = GaugeMetricFamily("ringserve_" + name, doc)
                g.add_metric([], value)
                yield g
            for name, doc, value in (
                ("lora_loads", "LoRA adapters read into memory (loads, and reads after an eviction)", lora["loads"]),
                ("lora_evictions", "LoRA adapters evicted from memory for another", lora["evictions"]),
            ):
                c = CounterMetricFamily("ringserve_" + name, doc)
                c.add_metric([], value)
                yield c
        memory = GaugeMetricFamily(RESIDENT_MEMORY, "Resident memory size in bytes.", labels=["role", "pid"])
        for role, pid in self.worker["processes"]:
            rss = resident_bytes(pid)
            if rss is not None:
                memory.add_metric([role, str(pid)], rss)
        yield memory
        if e is None:
            return
        used_pages = used_kv_pages(e)
        used_tokens = used_pages * e["page_size"]
        total_tokens = e["kv_pages_total"] * e["page_size"]
        verifies, drafted, accepted = e["spec_verifies"], e["spec_draft_tokens"], e["spec_accepted_tokens"]
        spec_length = (verifies + accepted) / verifies if verifies else 0.0
        spec_rate = accepted / drafted if drafted else 0.0
        for name, doc, value in (  # SGLang's (SchedulerMetricsCollector)
            ("num_running_reqs", "The number of running requests.", e["running"]),
            ("num_queue_reqs", "The number of requests in the waiting queue.", e["queued"]),
            ("num_used_tokens", "The number of used tokens.", used_tokens),
            ("token_usage", "The token usage.", used_tokens / max(total_tokens, 1)),
            ("max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.", total_tokens),
            ("gen_throughput", "The generation throughput (token/s).", e["gen_throughput"]),
            ("cache_hit_rate", "The prefix cache hit rate.", e["cache_hit_rate"]),
            # speculative decoding, since the engine started: tokens a verified draft yields
            # (its accepted tokens and the model's next one), and drafted tokens accepted
            ("spec_accept_length", "The average acceptance length of speculative decoding.", spec_length),
            ("spec_accept_rate", "The acceptance rate of speculative decoding's drafted tokens.", spec_rate),
        ):
            g = GaugeMetricFamily("sglang:" + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        for name, doc, value in (
            ("kv_pages_total", "KV cache pages", e["kv_pages_total"]),
            ("kv_pages_free", "KV cache pages free", e["kv_pages_free"]),
            ("kv_pages_cached", "KV cache pages held only by the prefix cache (evictable)", e["kv_pages_cached"]),
            ("kv_pages_used", "KV cache pages held by requests", used_pages),
            ("kv_page_size", "Tokens per KV page", e["page_size"]),
        ):
            g = GaugeMetricFamily("ringserve_" + name, doc)
            g.add_metric([], value)
            yield g
        for name, doc, value in (
            ("steps", "Scheduler steps", e["steps"]),
            ("retractions", "Requests retracted for lack of KV pages", e["retractions"]),
            ("engine_generated_tokens", "Tokens the scheduler generated", e["generated_tokens"]),
            ("engine_cached_tokens", "Prompt tokens the scheduler took from the prefix cache", e["cached_tokens"]),
            ("engine_prefill_tokens", "Prompt tokens the scheduler computed", e["prefill_tokens"]),
            ("spec_verifies", "Speculative decoding: drafts verified (a request's in one step)", verifies),
            ("spec_draft_tokens", "Speculative decoding: tokens drafted", drafted),
            ("spec_accepted_tokens", "Speculative decoding: drafted tokens the model chose too", accepted),
        ):
            c = CounterMetricFamily("ringserve_" + name, doc)
            c.add_metric([], value)
            yield c
