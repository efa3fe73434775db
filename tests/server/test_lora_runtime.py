"""LoRA adapters loaded and unloaded at run time on a real server of two HTTP workers, with a
pool of two resident adapters: an adapter loaded through one worker serves through both with
PEFT's tokens; unloaded, it is a 404 everywhere, and its name can be loaded again with other
weights; an unload waits for the requests that use the adapter; more adapters than resident
give each request what it gets alone; loads and unloads under load fail no request that did not
name the unloaded adapter; /metrics counts requests and tokens per adapter and the pool's work;
a load from outside --lora-allowed-dirs is a 400; run-time loads outlive an engine restart."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from tiny_models import peft_greedy, save_tiny, save_tiny_adapter

pytestmark = pytest.mark.torch_threads(2)

KEY = "lora-runtime-key"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPT = [1, *range(400, 439)]  # 40 tokens: two full pages enter the prefix cache, keyed by adapter
NEW = 8
RUNTIME = {"b8": (8, 1), "c16": (16, 2), "d4": (4, 3)}  # loaded at run time: name -> (rank, seed)


@pytest.fixture(scope="module")
def runtime_server(start_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_runtime")
    base = save_tiny(root / "m", 7)
    paths = {"a4": save_tiny_adapter(base, root / "a4", 4, 0)}
    paths.update({name: save_tiny_adapter(base, root / name, r, seed) for name, (r, seed) in RUNTIME.items()})
    want = {None: peft_greedy(base, None, PROMPT, NEW)}
    want.update({name: peft_greedy(base, path, PROMPT, NEW) for name, path in paths.items()})
    assert len({tuple(v) for v in want.values()}) == len(want), "every adapter must change the greedy tokens"
    server = start_server(
        start_server.Server.granian,
        workers=2,
        model_path=str(base),
        api_key=KEY,
        enable_lora=1,
        lora_paths=f"a4={paths['a4']}",
        max_loras_per_batch=2,
        max_loaded_loras=4,
        max_lora_rank=16,
        lora_allowed_dirs=str(root),
        max_total_tokens=4096,
        max_running_requests=16,
    )
    return server, paths, want


def call(server, route: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(server.url(route), json=body, headers=AUTH, timeout=timeout)


def generate(server, lora: str | None, new: int = NEW) -> httpx.Response:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
    if lora is not None:
        body["lora_path"] = lora
    return call(server, "/generate", body)


def tokens(server, lora: str | None) -> list[int]:
    r = generate(server, lora)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def load(server, name: str, path: Path, route: str = "/load_lora_adapter") -> httpx.Response:
    r = call(server, route, {"lora_name": name, "lora_path": str(path)})
    assert r.status_code == 200, r.text
    return r


def unload(server, name: str, route: str = "/unload_lora_adapter") -> httpx.Response:
    r = call(server, route, {"lora_name": name})
    assert r.status_code == 200, r.text
    return r


def test_loaded_through_one_worker_serves_through_both(runtime_server):
    server, paths, want = runtime_server
    r = load(server, "b8", paths["b8"])
    assert r.json() == {
        "success": True,
        "error_message": None,
        "loaded_adapters": {"a4": str(paths["a4"].resolve()), "b8": str(paths["b8"].resolve())},
    }
    seen = set()
    for _ in range(40):  # granian spreads connections over its workers
        r = generate(server, "b8")
        assert r.status_code == 200 and r.json()["output_ids"] == want["b8"], r.text
        seen.add(r.headers["x-ringserve-worker"])
        if len(seen) == 2:
            break
    assert seen == {"0", "1"}
    cards = {c["id"]: c for c in httpx.get(server.url("/v1/models"), headers=AUTH).json()["data"]}
    assert cards["b8"]["parent"] == "m"
    assert httpx.get(server.url("/v1/models/b8"), headers=AUTH).json()["id"] == "b8"

    r = unload(server, "b8", "/v1/unload_lora_adapter")  # vLLM's answer: a text
    assert r.text == "Success: LoRA adapter 'b8' removed successfully."
    for _ in range(4):  # both workers
        r = generate(server, "b8")
        assert r.status_code == 404 and "`b8`" in r.json()["error"]["message"], r.text
    assert httpx.get(server.url("/v1/models/b8"), headers=AUTH).status_code == 404
    completion = {"model": "b8", "prompt": PROMPT, "max_tokens": 1}
    assert call(server, "/v1/completions", completion).status_code == 404

    # the name again, other weights: nothing of the old adapter (its cached KV) is used
    r = load(server, "b8", paths["c16"], "/v1/load_lora_adapter")
    assert r.text == "Success: LoRA adapter 'b8' added successfully."
    for _ in range(4):
        assert tokens(server, "b8") == want["c16"]
    unload(server, "b8")


def test_unload_waits_for_the_requests_using_it(runtime_server):
    server, paths, want = runtime_server
    load(server, "b8", paths["b8"])
    ended: dict[str, float] = {}

    def long_request() -> httpx.Response:
        r = generate(server, "b8", new=300)
        ended["request"] = time.monotonic()
        return r

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(long_request)
        deadline = time.monotonic() + 120
        while metric(httpx.get(server.url("/metrics")).text, "sglang:num_running_reqs") < 1:  # admitted
            assert time.monotonic() < deadline and not running.done(), "the request never ran"
            time.sleep(0.05)
        started = time.monotonic()
        r = unload(server, "b8")
        ended["unload"] = time.monotonic()
        result = running.result()
    assert result.status_code == 200, result.text
    out = result.json()
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 300
    assert out["output_ids"][:NEW] == want["b8"]
    # answered as the request ended (the two answers race back), not when it was asked, mid-request
    assert ended["unload"] - started > 0.5 * (ended["request"] - started), "the unload did not wait"
    assert r.json()["loaded_adapters"] == {"a4": str(paths["a4"].resolve())}


def test_more_adapters_than_resident_give_what_each_gets_alone(runtime_server):
    server, paths, want = runtime_server
    for name in RUNTIME:
        load(server, name, paths[name])
    try:
        names = [None, "a4", *RUNTIME]  # four adapters, two resident at a time
        for name in names:
            assert tokens(server, name) == want[name], name
        with ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda name: tokens(server, name), names * 3))
        assert got == [want[name] for name in names * 3]
        time.sleep(1.5)  # every worker's counts are flushed to the shared metrics files once a second
        metrics = httpx.get(server.url("/metrics")).text
        assert metric(metrics, "ringserve_lora_adapters_resident") == 2
        assert metric(metrics, "ringserve_lora_adapters_registered") == 4
        assert metric(metrics, "ringserve_lora_evictions_total") > 0
        assert metric(metrics, "ringserve_lora_loads_total") > 4  # reloads after evictions
        assert metric(metrics, 'ringserve_lora_requests_total{lora_name="d4"}') >= 4
        assert metric(metrics, 'ringserve_lora_generation_tokens_total{lora_name="d4"}') >= 4 * NEW
        # the table is full (--max-loaded-loras 4): a fifth is refused and changes nothing
        r = call(server, "/load_lora_adapter", {"lora_name": "e", "lora_path": str(paths["b8"])})
        assert r.status_code == 400 and "--max-loaded-loras" in r.json()["error"]["message"], r.text
    finally:
        for name in RUNTIME:
            unload(server, name)


def metric(text: str, name: str) -> float:
    """The sum of `name`'s samples (over the label sets it does not name)."""
    pattern = re.escape(name) + (r"" if "{" in name else r"(?:\{[^}]*\})?") + r" ([0-9.e+-]+)$"
    values = [float(m.group(1)) for m in re.finditer(pattern, text, re.M)]
    assert values, f"{name} is not in /metrics"
    return sum(values)


def test_loads_and_unloads_under_load_fail_only_the_unloaded(runtime_server):
    server, paths, want = runtime_server
    stop = threading.Event()
    failures: list[str] = []
    b8_outcomes: list[int] = []

    def steady(lora: str | None) -> None:
        while not stop.is_set():
            r = generate(server, lora)
            if r.status_code != 200 or r.json()["output_ids"] != want[lora]:
                failures.append(f"{lora}: {r.status_code} {r.text[:200]}")

    def churned() -> None:  # names the adapter that comes and goes
        while not stop.is_set():
            r = generate(server, "b8")
            b8_outcomes.append(r.status_code)
            if r.status_code == 200:
                if r.json()["output_ids"] != want["b8"]:
                    failures.append(f"b8: other tokens {r.json()['output_ids']}")
            elif r.status_code not in (400, 404) or "b8" not in r.text and "unloaded" not in r.text:
                failures.append(f"b8: {r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=steady, args=(lora,)) for lora in (None, "a4", None, "a4")]
    threads.append(threading.Thread(target=churned))
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            load(server, "b8", paths["b8"])
            assert tokens(server, "b8") == want["b8"]
            unload(server, "b8")
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    assert not failures, failures[:5]
    assert 200 in b8_outcomes


def test_a_path_outside_the_allowed_dirs_is_a_400(runtime_server, tmp_path):
    server, paths, _ = runtime_server
    outside = shutil.copytree(paths["b8"], tmp_path / "b8")
    for route in ("/load_lora_adapter", "/v1/load_lora_adapter"):
        r = call(server, route, {"lora_name": "b8", "lora_path": str(outside)})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "lora_path" and "--lora-allowed-dirs" in err["message"], err
    assert call(server, "/generate", {"text": "Hi", "lora_path": "b8"}).status_code == 404  # nothing loaded


def heal(server) -> None:
    """kill -9 of the engine's scheduler; back once the replaced engine answers."""
    server.refresh()
    scheduler = server.engine["scheduler"]
    os.kill(scheduler, signal.SIGKILL)

    def healed() -> bool:
        server.refresh()
        if server.engine.get("scheduler") in (None, scheduler):
            return False
        try:
            return httpx.get(server.url("/health"), timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    assert server.wait_until(healed, 120, 0.25), "the engine was not replaced"


def test_run_time_loads_outlive_an_engine_restart(runtime_server):
    server, paths, want = runtime_server
    load(server, "d4", paths["d4"])
    heal(server)
    assert tokens(server, "d4") == want["d4"]  # registered again by the new engine
    assert tokens(server, "a4") == want["a4"]  # --lora-paths' as ever
    assert "d4" in {c["id"] for c in httpx.get(server.url("/v1/models"), headers=AUTH).json()["data"]}
    assert unload(server, "d4").status_code == 200
    heal(server)
    assert generate(server, "d4").status_code == 404  # unloaded stays unloaded
    assert tokens(server, "a4") == want["a4"]
