"""SGLang's engine control on a real server (two HTTP workers, one engine): generation paused
and continued under load in each mode, weights updated from disk (an HF directory, a GGUF
file) and read back by name. Tiny random-weight Llamas keep the model's share small: the
reference for each checkpoint is the OfflineEngine on that checkpoint alone."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import torch
from safetensors import safe_open
from tiny_models import save_tiny

from protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.torch_threads(2)

KEY = "control-key"
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPTS = [[1, 504, 3458, 282], [1, 2830, 314, 253, 1050], [1, 77, 78, 79, 80, 81, 82]]
NEW = 24  # greedy tokens a request asks for, ignoring EOS
LONG = 400  # a request still running when a pause comes


def save_checkpoint(path: Path, seed: int, **changes) -> Path:
    return save_tiny(path, seed, **changes)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "a": save_checkpoint(root / "a", 0),
        "b": save_checkpoint(root / "b", 1),
        "wide": save_checkpoint(root / "wide", 2, intermediate_size=128),
    }


def greedy(model_path: Path, n: int = NEW, prompts=PROMPTS) -> list[list[int]]:
    """What the checkpoint alone gives: the OfflineEngine's greedy tokens."""
    from runtime.offline import OfflineEngine

    engine = OfflineEngine(model_path=str(model_path), max_total_tokens=4096, max_running_requests=4)
    outs = engine.generate(list(prompts), SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def dump_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dump")


@pytest.fixture(scope="module")
def server(start_server, checkpoints, dump_folder):
    return start_server(
        start_server.Server.granian,
        workers=2,
        model_path=str(checkpoints["a"]),
        api_key=KEY,
        max_total_tokens=8192,
        max_running_requests=16,
        dump_requests_folder=str(dump_folder),
    )


def client(server) -> httpx.Client:
    return httpx.Client(base_url=server.base, headers=AUTH, timeout=300)


def generate(http: httpx.Client, ids: list[int], n: int = NEW) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def output_ids(answer: dict) -> list[int]:
    return answer["output_ids"]


def in_background(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("answer", fn(*args)), daemon=True)
    thread.start()
    return thread, out


def wait_running(http: httpx.Client, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if http.get("/get_load").json()[0]["num_reqs"] >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"{n} requests never ran at once")


def health_of_both_workers(server) -> dict[str, httpx.Response]:
    """/health as each of the two workers answers it (connections land on either)."""
    seen: dict[str, httpx.Response] = {}
    deadline = time.monotonic() + 60
    while len(seen) < 2 and time.monotonic() < deadline:
        with httpx.Client(base_url=server.base, headers=AUTH, timeout=30) as fresh:  # a new connection
            r = fresh.get("/get_load")
            seen.setdefault(r.headers["x-ringserve-worker"], fresh.get("/health"))
    assert len(seen) == 2, "one worker never answered"
    return seen


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_pause_and_continue_under_load(server, checkpoints, mode):
    """Requests in flight when the pause comes, and requests that arrive while it holds: each
    ends with the checkpoint's own greedy tokens, but those in flight in abort mode, which end
    with finish_reason abort and a prefix of them. /health on both workers says paused."""
    want = greedy(checkpoints["a"], LONG, PROMPTS[:1])[0]
    with client(server) as http:
        flights = [in_background(generate, http, PROMPTS[0], LONG) for _ in range(4)]
        wait_running(http, 4)
        r = http.post("/pause_generation", json={"mode": mode})
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        assert r.json()["num_paused_requests"] >= 1
        for answer in health_of_both_workers(server).values():
            assert answer.status_code == 200 and answer.json() == {"status": "paused", "mode": mode}
        late = [in_background(generate, http, PROMPTS[0], LONG) for _ in range(2)]
        time.sleep(1.0)
        assert all(t.is_alive() for t, _ in late), "a request ran while generation was paused"
        if mode != "abort":
            assert all(t.is_alive() for t, _ in flights), "a held request ran while generation was paused"
        assert http.post("/continue_generation", json={}).status_code == 200
        for thread, _ in flights + late:
            thread.join(300)
        assert http.get("/health").content == b""
    for i, (_, out) in enumerate(flights + late):
        answer = out["answer"]
        ids, finish = output_ids(answer), answer["meta_info"]["finish_reason"]["type"]
        if mode == "abort" and i < len(flights):
            assert finish == "abort" and ids == want[: len(ids)]
        else:
            assert finish == "length" and ids == want


def test_update_weights_from_disk(server, checkpoints):
    """A checkpoint of the same shape: greedy tokens become its own, and get_weights_by_name
    reads its values; one of another shape: a 400 naming model_path, the served one kept."""
    want_a, want_b = greedy(checkpoints["a"]), greedy(checkpoints["b"])
    assert want_a != want_b
    with client(server) as http:
        assert [output_ids(generate(http, p)) for p in PROMPTS] == want_a
        t0 = time.perf_counter()
        r = http.post("/update_weights_from_disk", json={"model_path": str(checkpoints["b"])})
        took = time.perf_counter() - t0
        assert r.status_code == 200, r.text
        assert r.json() == {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        print(f"update_weights_from_disk: answered in {took * 1e3:.0f} ms")
        assert [output_ids(generate(http, p)) for p in PROMPTS] == want_b

        name = "model.layers.1.mlp.up_proj.weight"
        with safe_open(str(checkpoints["b"] / "model.safetensors"), "pt") as f:
            expected = f.get_tensor(name)[:3].numpy()
        r = http.post("/get_weights_by_name", json={"name": name, "truncate_size": 3})
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(np.array(r.json(), np.float32), expected)

        r = http.post("/update_weights_from_disk", json={"model_path": str(checkpoints["wide"])})
        assert r.status_code == 400
        body = r.json()
        assert body["success"] is False and body["error"]["param"] == "model_path"
        assert "intermediate_size" in body["message"]
        assert [output_ids(generate(http, p)) for p in PROMPTS] == want_b

        for bad, param in (
            ({"model_path": "/no/such/model"}, "model_path"),
            ({"model_path": "x" * 5000}, "model_path"),
            ({"model_path": str(checkpoints["a"]), "load_format": "gguf"}, "load_format"),
            ({"model_path": str(checkpoints["a"]), "weight_version": "v2"}, "weight_version"),
            ({}, "model_path"),
        ):
            r = http.post("/update_weights_from_disk", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        for bad, param in (
            ({"name": "model.layers.9.mlp.up_proj.weight"}, "name"),
            ({"name": name, "truncate_size": 0}, "truncate_size"),
        ):
            r = http.post("/get_weights_by_name", json=bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert httpx.post(server.url("/update_weights_from_disk"), json={}).status_code == 401

        r = http.post("/update_weights_from_disk", json={"model_path": str(checkpoints["a"])})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("abort", [False, True])
def test_update_weights_with_requests_in_flight(server, checkpoints, abort):
    """Requests running when the weights change: retracted and finished (their tokens after the
    update are the new weights', so they end with the full length), or, with
    abort_all_requests, ended with finish_reason abort."""
    with client(server) as http:
        flights = [in_background(generate, http, PROMPTS[0], LONG) for _ in range(3)]
        wait_running(http, 3)
        target = checkpoints["b"] if not abort else checkpoints["a"]
        r = http.post("/update_weights_from_disk", json={"model_path": str(target), "abort_all_requests": abort})
        assert r.status_code == 200 and r.json()["num_paused_requests"] >= 1, r.text
        for thread, _ in flights:
            thread.join(300)
        finishes = {out["answer"]["meta_info"]["finish_reason"]["type"] for _, out in flights}
        assert finishes == ({"abort"} if abort else {"length"})
        r = http.post("/update_weights_from_disk", json={"model_path": str(checkpoints["a"])})
        assert r.status_code == 200


def test_dump_and_replay_round_trip(server, dump_folder, tmp_path, monkeypatch):
    """Requests of every generation route, dumped by both workers, replayed by perf/replay.py
    to the same server: every determined choice (greedy, or seeded) comes back equal. The API
    key is nowhere in the dump."""
    from perf import replay

    mark = time.time()
    chat = {"model": "a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0}
    with client(server) as http:
        assert http.post("/v1/chat/completions", json={**chat, "stream": True}).status_code == 200
        r = http.post("/v1/completions", json={"model": "a", "prompt": "One two", "max_tokens": 10, "n": 2, "seed": 7})
        assert r.status_code == 200, r.text
        generate(http, PROMPTS[1])
        body = {"input_ids": PROMPTS[2], "sampling_params": {"max_new_tokens": 8, "temperature": 0.9}}
        assert http.post("/generate", json=body).status_code == 200  # unseeded: sent, not compared
        allowed = {**chat, "allowed_token_ids": [PROMPTS[1][0], PROMPTS[1][1]]}  # /generate cannot carry it
        assert http.post("/v1/chat/completions", json=allowed).status_code == 200
    lines = []
    for _ in range(100):  # each worker writes its line as its request ends
        lines = [
            line
            for file in sorted(dump_folder.glob("requests-w*.jsonl"))
            for line in file.read_bytes().splitlines()
            if orjson.loads(line)["time"] >= mark
        ]
        if len(lines) == 5:
            break
        time.sleep(0.1)
    assert {orjson.loads(line)["endpoint"] for line in lines} == {"chat", "completions", "generate"}
    assert all(KEY not in f.read_text() for f in dump_folder.iterdir())
    dump = tmp_path / "requests-w0.jsonl"
    dump.write_bytes(b"\n".join(lines) + b"\n")
    monkeypatch.setenv("RINGSERVE_API_KEY", KEY)
    out = tmp_path / "replay.json"
    assert replay.main(["--dump", str(dump), "--url", server.base, "--out", str(out)]) == 0
    result = orjson.loads(out.read_bytes())
    assert result["requests"] == 5 and result["compared"] == 4 and result["equal"] == 4
    assert result["not_sent"] == {"allowed_token_ids": 1}
    assert (tmp_path / "replay.md").read_text().count("| chat |") == 1


def test_update_weights_of_a_gguf(start_server, tmp_path_factory):
    """A GGUF served in place (gguf-q8): another file of the same shape takes its place."""
    from test_gpu_model_families_gguf import typed_model, write_gguf

    root = tmp_path_factory.mktemp("gguf")
    first, second = root / "first.gguf", root / "second.gguf"
    model = typed_model("llama")
    write_gguf("llama", model, first)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    write_gguf("llama", model, second)
    prompts = [[1, 104, 105], [1, 97, 98, 99]]
    want = greedy(second, 12, prompts)
    server = start_server(
        start_server.Server.granian, model_path=str(first), api_key=KEY, max_total_tokens=1024, max_running_requests=4
    )
    with client(server) as http:
        before = [output_ids(generate(http, p, 12)) for p in prompts]
        r = http.post("/update_weights_from_disk", json={"model_path": str(second), "load_format": "gguf"})
        assert r.status_code == 200, r.text
        after = [output_ids(generate(http, p, 12)) for p in prompts]
        assert after == want and before != want
