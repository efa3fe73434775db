"""/metrics by SGLang's names, so that SGLang's Grafana dashboard reads ringserve unchanged.

A real server (granian, one worker, the null model) scraped before and after chat and
completion requests, streamed and not, a stream whose client leaves and an /abort_request:
each SGLang metric is there, labelled with the served model name, of SGLang's type; the
counters move by what was sent; the aborted requests are counted, with finish_reason "abort";
the exposition parses; every (name, labels) SGLang's dashboard queries is served."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

SERVED = "ringserve-metrics-test"

# (family, type) SGLang serves (python/sglang/srt/metrics/collector.py: TokenizerMetricsCollector,
# SchedulerMetricsCollector), each labelled model_name
SGLANG = {
    "sglang:prompt_tokens": "counter",
    "sglang:generation_tokens": "counter",
    "sglang:cached_tokens": "counter",
    "sglang:num_requests": "counter",
    "sglang:num_aborted_requests": "counter",
    "sglang:time_to_first_token_seconds": "histogram",
    "sglang:inter_token_latency_seconds": "histogram",
    "sglang:e2e_request_latency_seconds": "histogram",
    "sglang:num_running_reqs": "gauge",
    "sglang:num_queue_reqs": "gauge",
    "sglang:num_used_tokens": "gauge",
    "sglang:token_usage": "gauge",
    "sglang:max_total_num_tokens": "gauge",
    "sglang:gen_throughput": "gauge",
    "sglang:cache_hit_rate": "gauge",
}

# What SGLang's Grafana dashboard queries: (sample name, the labels its expressions name), from
# every panel's `expr` of sgl-project/sglang examples/monitoring/grafana/dashboards/json/
# sglang-dashboard.json (commit bac2cc6711e0342e25d27bbcdef773555ad402eb), plus its template
# variable `model_name` (label_values(model_name)), which every heatmap filters by.
DASHBOARD = [
    ("sglang:e2e_request_latency_seconds_bucket", ("le", "model_name")),
    ("sglang:e2e_request_latency_seconds_sum", ()),
    ("sglang:e2e_request_latency_seconds_count", ()),
    ("sglang:time_to_first_token_seconds_bucket", ("le", "model_name")),
    ("sglang:time_to_first_token_seconds_sum", ()),
    ("sglang:time_to_first_token_seconds_count", ()),
    ("sglang:num_running_reqs", ()),
    ("sglang:gen_throughput", ()),
    ("sglang:cache_hit_rate", ()),
    ("sglang:num_queue_reqs", ()),
]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.granian,
        workers=1,
        null_model=True,
        served_model_name=SERVED,
        log_level="warning",
        max_total_tokens=65536,
        max_running_requests=16,
        request_timeout=4,
    )


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


class Scrape:
    """One /metrics: its families, and its samples' values by (name, labels)."""

    def __init__(self, server) -> None:
        self.text = httpx.get(server.url("/metrics"), timeout=30).text
        self.families = {f.name: f for f in text_string_to_metric_families(self.text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def get(self, name: str, **labels: str) -> float:
        """The sum of the samples `name` whose labels include `labels` (0 if none)."""
        return sum(
            s.value for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )


def delta(after: Scrape, before: Scrape, name: str, **labels: str) -> float:
    return after.get(name, **labels) - before.get(name, **labels)


def settled(server, before: Scrape, requests: int) -> Scrape:
    """The scrape once `requests` more requests are counted (workers flush every second)."""
    deadline = time.monotonic() + 10
    while True:
        now = Scrape(server)
        if delta(now, before, "sglang:num_requests_total") >= requests or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def running(server) -> float:
    return Scrape(server).get("sglang:num_running_reqs")


def test_sglang_names_types_and_model_name(server, client):
    client.completions.create(model=SERVED, prompt="Hello", max_tokens=2)
    m = Scrape(server)
    for family, kind in SGLANG.items():
        assert family in m.families, family
        f = m.families[family]
        assert f.type == kind, (family, f.type)
        assert f.samples and all(s.labels.get("model_name") == SERVED for s in f.samples), family
    buckets = {s.labels["le"] for s in m.families["sglang:time_to_first_token_seconds"].samples if "le" in s.labels}
    assert {"0.1", "400.0", "+Inf"} <= buckets  # SGLang's default buckets
    assert m.get("sglang:max_total_num_tokens") == 65536
    assert 0 <= m.get("sglang:token_usage") <= 1 and 0 <= m.get("sglang:cache_hit_rate") <= 1


def test_every_dashboard_query_is_served(server, client):
    client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    m = Scrape(server)
    for name, labels in DASHBOARD:
        samples = [s for s in m.samples if s.name == name]
        assert samples, name
        assert all(set(labels) <= set(s.labels) for s in samples), (name, labels)
    assert {s.labels.get("model_name") for s in m.samples if s.name.startswith("sglang:")} == {SERVED}


def test_counters_move_by_what_was_sent(server, client):
    before = Scrape(server)
    chat = dict(model=SERVED, messages=[{"role": "user", "content": "What is the capital of France?"}])
    usages, finishes = [], []
    r = client.chat.completions.create(max_tokens=5, **chat)
    usages.append(r.usage)
    finishes += [c.finish_reason for c in r.choices]
    r = client.completions.create(model=SERVED, prompt=["The capital of France is", "def f(n):"], max_tokens=4)
    usages.append(r.usage)
    finishes += [c.finish_reason for c in r.choices]
    chunks = list(
        client.chat.completions.create(max_tokens=6, stream=True, stream_options={"include_usage": True}, **chat)
    )
    usages.append(chunks[-1].usage)
    finishes += [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    chunks = list(
        client.completions.create(
            model=SERVED, prompt="Once upon a time", max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    usages.append(chunks[-1].usage)
    finishes += [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert len(finishes) == 5

    after = settled(server, before, 5)
    assert delta(after, before, "sglang:num_requests_total") == 5
    assert delta(after, before, "sglang:num_aborted_requests_total") == 0
    assert delta(after, before, "sglang:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta(after, before, "sglang:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages if u.prompt_tokens_details)
    assert delta(after, before, "sglang:cached_tokens_total") == cached
    for reason in ("stop", "length", "abort"):
        want = finishes.count(reason)
        assert delta(after, before, "ringserve_requests_finished_total", finish_reason=reason) == want, reason
    assert delta(after, before, "sglang:time_to_first_token_seconds_count") == 5
    assert delta(after, before, "sglang:e2e_request_latency_seconds_count") == 5
    # (inter-token latency: the null model's short streams come in one delta; tests/server/test_server.py)
    assert delta(after, before, "ringserve_requests_total", endpoint="chat") == 2
    assert delta(after, before, "ringserve_requests_total", endpoint="completions") == 2


def test_gen_throughput_is_a_recent_rate(server):
    """Tokens a second over the engine's last window: above 0 while a request runs, 0 soon after."""
    done = threading.Event()

    def generate():
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}}
        httpx.post(server.url("/generate"), timeout=60, json=body)
        done.set()

    thread = threading.Thread(target=generate)
    thread.start()
    rates = []
    while not done.is_set() or len(rates) < 30:  # a second past the end: the last window's rate
        rates.append(Scrape(server).get("sglang:gen_throughput"))
        time.sleep(0.05)
    thread.join()
    assert max(rates) > 100
    assert server.wait_until(lambda: Scrape(server).get("sglang:gen_throughput") == 0, 5)


@contextlib.contextmanager
def engine_stopped(server):
    """The scheduler stopped (SIGSTOP): requests stay running, whatever the null model's speed."""
    os.kill(server.engine["scheduler"], signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.engine["scheduler"], signal.SIGCONT)


def test_aborted_requests_are_counted(server):
    """A stream whose client leaves, an /abort_request, a stream and a request past the request
    timeout: each is a finished request, "abort"."""
    assert server.wait_until(lambda: running(server) == 0, 30)
    before = Scrape(server)
    with httpx.Client(timeout=60) as http:
        body = {"model": SERVED, "prompt": "Hi", "stream": True, "max_tokens": 8000, "ignore_eos": True}
        with http.stream("POST", server.url("/v1/completions"), json=body) as resp:
            lines = resp.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            os.kill(server.engine["scheduler"], signal.SIGSTOP)
    try:  # the client left: the worker notices within DisconnectWatches.WATCH_AFTER_S and aborts
        left = settled(server, before, 1)
    finally:
        os.kill(server.engine["scheduler"], signal.SIGCONT)
    assert delta(left, before, "ringserve_requests_finished_total", finish_reason="abort") == 1

    answer = {}

    def generate():
        body = {"text": "Hi", "rid": "metrics-abort", "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}}
        answer["body"] = httpx.post(server.url("/generate"), timeout=60, json=body).json()

    thread = threading.Thread(target=generate)
    thread.start()
    assert server.wait_until(lambda: running(server) == 1, 30)
    with engine_stopped(server):
        assert httpx.post(server.url("/abort_request"), json={"rid": "metrics-abort"}).json() == {"aborted": 1}
        thread.join(30)
    assert answer["body"]["meta_info"]["finish_reason"] == {"type": "abort"}

    timed_out = {}

    def late(stream: bool):
        body = {"model": SERVED, "prompt": "Hi", "max_tokens": 4, "stream": stream}
        timed_out[stream] = httpx.post(server.url("/v1/completions"), json=body, timeout=60).text

    threads = [threading.Thread(target=late, args=(stream,)) for stream in (True, False)]
    with engine_stopped(server):
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert all('"timeout"' in text for text in timed_out.values()), timed_out

    after = settled(server, before, 4)
    assert delta(after, before, "sglang:num_requests_total") == 4
    assert delta(after, before, "sglang:num_aborted_requests_total") == 4
    assert delta(after, before, "ringserve_requests_finished_total", finish_reason="abort") == 4
    assert delta(after, before, "ringserve_requests_finished_total", finish_reason="length") == 0
    assert delta(after, before, "sglang:e2e_request_latency_seconds_count") == 4
    assert delta(after, before, "sglang:generation_tokens_total") >= answer["body"]["meta_info"]["completion_tokens"]
    assert delta(after, before, "sglang:prompt_tokens_total") >= answer["body"]["meta_info"]["prompt_tokens"]
    assert server.wait_until(lambda: running(server) == 0, 30)  # each was aborted in the scheduler too
