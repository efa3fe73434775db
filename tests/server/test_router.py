"""Scale-out behind sglang-router: two ringserve servers (null model) and the router in front
(`python -m sglang_router.launch_router --policy round_robin`), on loopback only.

round_robin, not the cache_aware that docs/architecture.md recommends: which server
cache_aware picks is the router's own approximation (its prefix tree, its tie-breaking, when it
enters a newly registered server in the tree), and in one CI run it sent all 20 requests to one
server. What this test asks of ringserve, that each server serves what the router sends it,
needs both servers to get requests, which round_robin makes certain.

The router registers both servers from what they answer (/health, /server_info, /model_info:
the served model's name and path), reads their loads (/get_load), routes chat, completions
(streamed and not, through the openai client) and /generate to both, keeps them healthy
through its periodic /health probe, and everything stops without leftovers (processes,
shared-memory segments)."""

from __future__ import annotations

import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import alive, descendants, wait_until
from router_process import healthy, running_router

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install -e '.[dev]')")

MODEL = "SmolLM2-135M-Instruct"  # the default model's served name
TOPICS = ["apples", "bridges", "comets", "dunes", "engines", "forests", "glaciers", "harbors"]


@pytest.fixture(scope="module")
def servers(start_server):
    start = lambda _: start_server(start_server.Server.granian, workers=1, null_model=True, log_level="warning")
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(start, range(2)))


@pytest.fixture(scope="module")
def router(servers):
    # a /health answered late on a loaded machine must not take a server out of the rotation
    # for the rest of the test (the default: 3 failures in a row)
    with running_router([s.base for s in servers], "--health-failure-threshold", "30") as r:
        yield r.proc, r.base


def registered(base: str) -> set[str]:
    """The URLs of the router's healthy workers that serve our model."""
    return healthy(base, MODEL)


def served(server) -> int:
    """Generation requests the server received, every endpoint together (its /metrics)."""
    text = httpx.get(server.url("/metrics"), timeout=10).text
    return int(sum(float(n) for n in re.findall(r'^ringserve_requests_total\{endpoint="[^"]*"\} (\S+)$', text, re.M)))


def test_router_serves_through_both_servers(servers, router):
    proc, base = router
    t0 = time.monotonic()

    for s in servers:  # SGLang's newer names of the info routes, which the router asks first
        model_info = httpx.get(s.url("/model_info"), timeout=10).json()
        server_info = httpx.get(s.url("/server_info"), timeout=10).json()
        assert model_info == httpx.get(s.url("/get_model_info"), timeout=10).json()
        assert server_info["served_model_name"] == model_info["served_model_name"] == MODEL
        assert server_info["model_path"] == model_info["model_path"]

    workers = httpx.get(base + "/workers", timeout=10).json()["workers"]
    assert {w["url"] for w in workers} == {s.base for s in servers}
    for w in workers:  # what /server_info and /model_info told the router
        assert w["model_id"] == w["metadata"]["served_model_name"] == MODEL
        assert w["metadata"]["model_path"] == model_info["model_path"]
        assert w["metadata"]["architectures"] == '["LlamaForCausalLM"]'
        assert w["connection_mode"] == "HTTP"
    assert [m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]] == [MODEL]

    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    kw = dict(model=MODEL, max_tokens=8, temperature=0)

    def chat(topic: str, stream: bool) -> str:
        messages = [{"role": "user", "content": f"Tell me about {topic}."}]
        if not stream:
            out = client.chat.completions.create(messages=messages, **kw)
            assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
            return out.choices[0].message.content
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **kw))
        assert chunks[-1].choices[0].finish_reason == "length"
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    def complete(topic: str, stream: bool) -> str:
        prompt = f"{topic.capitalize()} are"
        if not stream:
            out = client.completions.create(prompt=prompt, **kw)
            assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 8
            return out.choices[0].text
        chunks = list(client.completions.create(prompt=prompt, stream=True, **kw))
        assert chunks[-1].choices[0].finish_reason == "length"
        return "".join(c.choices[0].text for c in chunks)

    def generate(topic: str) -> str:
        body = {"text": f"A note on {topic}:", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        r = httpx.post(base + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["completion_tokens"] == 8
        return r.json()["text"]

    calls = [lambda t=t, s=s: chat(t, s) for t in TOPICS[:4] for s in (False, True)]
    calls += [lambda t=t, s=s: complete(t, s) for t in TOPICS[4:] for s in (False, True)]
    calls += [lambda t=t: generate(t) for t in TOPICS[::2]]
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda call: call(), calls))
    assert all(texts), texts

    counts = [served(s) for s in servers]
    assert sum(counts) == len(calls), counts
    assert min(counts) >= len(calls) // 2 - 1, f"round_robin split {len(calls)} requests as {counts}"

    # SGLang's native routes through the router
    info = httpx.get(base + "/get_model_info", timeout=10).json()
    assert info["served_model_name"] == MODEL and info["is_generation"] is True
    assert httpx.post(base + "/flush_cache", timeout=10).status_code == 200
    for s in servers:  # SGLang's /get_load, which the router polls for its loads (power_of_two)
        (load,) = httpx.get(s.url("/get_load"), timeout=10).json()
        assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    loads = httpx.get(base + "/get_loads", timeout=10).json()["workers"]
    assert {w["worker"]: w["load"] for w in loads} == {s.base: 0 for s in servers}

    # The router's periodic /health probe (every second) keeps both servers healthy.
    time.sleep(2.5)
    assert registered(base) == {s.base for s in servers}
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    assert time.monotonic() - t0 < 30


def test_everything_stops_without_leftovers(servers, router):
    proc, _ = router
    router_tree = [proc.pid, *descendants(proc.pid)]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) is not None
    assert wait_until(lambda: not any(alive(p) for p in router_tree), 10)
    for server in servers:
        server.stop()
        running, segments = server.leftovers()
        assert running == [] and segments == []
