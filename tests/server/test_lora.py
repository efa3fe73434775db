"""LoRA adapters on a real server: two PEFT adapters (ranks 4 and 8, random non-zero A and B on
every attention and MLP projection) of a tiny random-weight Llama. Each adapter's greedy tokens
through the whole server equal PEFT's merged model's; a batch mixing the base and both adapters
(same prompt, so the prefix cache would hand one's KV to another if it were not keyed by
adapter) gives each request what it gets alone; unknown adapters are 404s naming them; bad
adapters stop the start with a line naming the problem, and their run-time loads are 400s
that change nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from tiny_models import peft_greedy, save_tiny, save_tiny_adapter

pytestmark = pytest.mark.torch_threads(2)

KEY = "lora-key"
AUTH = {"authorization": f"Bearer {KEY}"}
RANKS = {"a4": 4, "a8": 8}
PROMPT = [1, *range(300, 339)]  # 40 tokens: two full pages of 16 enter the prefix cache
NEW = 8


def save_base(path: Path) -> Path:
    return save_tiny(path, 5)


def reference(base: Path, adapter: Path | None) -> list[int]:
    return peft_greedy(base, adapter, PROMPT, NEW)


@pytest.fixture(scope="module")
def lora_server(start_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_base(root / "m")
    adapters = {name: save_tiny_adapter(base, root / name, r, seed) for seed, (name, r) in enumerate(RANKS.items())}
    want = {None: reference(base, None), **{name: reference(base, path) for name, path in adapters.items()}}
    assert len({tuple(v) for v in want.values()}) == 3, "the adapters must change the greedy tokens"
    server = start_server(
        start_server.Server.granian,
        model_path=str(base),
        api_key=KEY,
        enable_lora=1,
        lora_paths=json.dumps([f"{name}={path}" for name, path in adapters.items()]),
        max_lora_rank=8,
        max_total_tokens=4096,
        max_running_requests=8,
    )
    return server, base, adapters, want


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(route), json=body, headers=AUTH, timeout=300)


def generate(server, lora: str | None) -> list[int]:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}
    if lora is not None:
        body["lora_path"] = lora
    r = post(server, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def completion(server, model: str) -> list[int]:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": NEW,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_each_adapter_equals_peft(lora_server):
    server, _, _, want = lora_server
    assert generate(server, None) == want[None]  # first: the base's pages of PROMPT are cached
    for name in RANKS:
        assert generate(server, name) == want[name], name
        assert completion(server, name) == want[name], name  # vLLM's: the adapter as `model`
        assert completion(server, f"m:{name}") == want[name], name  # SGLang's base:adapter
    assert completion(server, "m") == want[None]


def test_mixed_batch_gives_each_what_it_gets_alone(lora_server):
    server, _, _, want = lora_server
    loras = [None, "a4", "a8"] * 3
    with ThreadPoolExecutor(len(loras)) as pool:
        got = list(pool.map(lambda lora: generate(server, lora), loras))
    assert got == [want[lora] for lora in loras]


def test_unknown_adapters_and_models_list(lora_server):
    server, _, _, _ = lora_server
    for route, body, named in (
        ("/v1/completions", {"model": "nope", "prompt": "Hi", "max_tokens": 1}, "nope"),
        ("/v1/completions", {"model": "m:nope", "prompt": "Hi", "max_tokens": 1}, "m:nope"),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "Hi"}]}, "nope"),
        ("/generate", {"text": "Hi", "lora_path": "nope"}, "nope"),
    ):
        r = post(server, route, body)
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert f"`{named}`" in err["message"] and err["code"] == "model_not_found", err
    r = httpx.get(server.url("/v1/models"), headers=AUTH)
    cards = {c["id"]: c for c in r.json()["data"]}
    assert set(cards) == {"m", "a4", "a8"}
    assert cards["m"]["parent"] is None and cards["a4"]["parent"] == cards["a8"]["parent"] == "m"
    assert httpx.get(server.url("/v1/models/a8"), headers=AUTH).json()["parent"] == "m"


def serve_error(*flags: str) -> str:
    """`serve`'s one line for flags that cannot start (it exits 1 before starting granian)."""
    r = subprocess.run([sys.executable, "-m", "runtime", "serve", *flags], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    return r.stderr


def test_bad_adapters_stop_the_start(lora_server, tmp_path):
    _, base, adapters, _ = lora_server
    lora = ("--model-path", str(base), "--enable-lora", "--lora-paths")
    assert "no adapter_config.json" in serve_error(*lora, f"x={tmp_path}")
    assert "rank 8 (down_proj) is above --max-lora-rank 4" in serve_error(
        *lora, f"a8={adapters['a8']}", "--max-lora-rank", "4"
    )
    assert "target modules ['c_attn'] are not projections" in serve_error(
        *lora, f"x={lacking_adapter(adapters['a4'], tmp_path / 'lacking')}"
    )
    assert "do not fit the model" in serve_error(*lora, f"x={wide_adapter(adapters['a4'], tmp_path / 'wide')}")
    assert "not among --lora-target-modules (k_proj, o_proj, q_proj, v_proj)" in serve_error(
        *lora, f"a8={adapters['a8']}", "--lora-target-modules", "qkv_proj", "o_proj"
    )


def lacking_adapter(src: Path, path: Path) -> Path:
    """`src` whose config targets a module the model lacks."""
    shutil.copytree(src, path)
    conf = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**conf, "target_modules": ["q_proj", "c_attn"]}))
    return path


def wide_adapter(src: Path, path: Path) -> Path:
    """`src` with A twice as wide: an adapter of another model's shapes."""
    from safetensors.torch import load_file, save_file

    path.mkdir()
    shutil.copy(src / "adapter_config.json", path)
    tensors = load_file(str(src / "adapter_model.safetensors"))
    save_file(
        {k: torch.cat([v, v], 1) if "lora_A" in k else v for k, v in tensors.items()},
        str(path / "adapter_model.safetensors"),
    )
    return path


def load(server, body: dict, route: str = "/load_lora_adapter", headers: dict = AUTH) -> httpx.Response:
    return httpx.post(server.url(route), json=body, headers=headers, timeout=300)


def test_bad_loads_are_400s_that_change_nothing(lora_server, tmp_path):
    server, base, adapters, want = lora_server
    models = httpx.get(server.url("/v1/models"), headers=AUTH).json()
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    r16 = save_tiny_adapter(base, tmp_path / "r16", 16, seed=9)
    cases = [  # (body, the parameter named, words of the message)
        ({"lora_path": str(adapters["a4"])}, "lora_name", "lora_name is required"),
        ({"lora_name": "x"}, "lora_path", "Both 'lora_name' and 'lora_path' must be provided."),
        ({"lora_name": "../x", "lora_path": str(adapters["a4"])}, "lora_name", "letters, digits"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "nope")}, "lora_path", "no such directory"),
        ({"lora_name": "x", "lora_path": str(a_file)}, "lora_path", "neither a directory"),
        ({"lora_name": "x", "lora_path": "/" + "a" * 5000}, "lora_path", "characters"),
        ({"lora_name": "x", "lora_path": str(empty)}, "lora_path", "no adapter_config.json"),
        ({"lora_name": "x", "lora_path": str(r16)}, "lora_path", "is above --max-lora-rank 8"),
        (
            {"lora_name": "x", "lora_path": str(lacking_adapter(adapters["a4"], tmp_path / "lacking"))},
            "lora_path",
            "are not projections",
        ),
        (
            {"lora_name": "x", "lora_path": str(wide_adapter(adapters["a4"], tmp_path / "wide"))},
            "lora_path",
            "do not fit the model",
        ),
        ({"lora_name": "a4", "lora_path": str(adapters["a8"])}, "lora_name", "has already been loaded"),
        ({"lora_name": "m", "lora_path": str(adapters["a8"])}, "lora_name", "the served model's name"),
        ({"lora_name": "x", "lora_path": str(adapters["a8"]), "pinned": "yes"}, "pinned", "pinned"),
    ]
    for body, param, words in cases:
        for route in ("/load_lora_adapter", "/v1/load_lora_adapter"):
            r = load(server, body, route)
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], (body, err)
            if route == "/load_lora_adapter":  # SGLang's fields beside the error
                assert r.json()["success"] is False and words in r.json()["error_message"]
    for route in ("/unload_lora_adapter", "/v1/unload_lora_adapter"):
        r = load(server, {"lora_name": "nope"}, route)
        assert r.status_code == 404 and "The lora adapter 'nope' cannot be found." in r.text, r.text
        assert load(server, {"lora_name": "a4", "lora_id": "1"}, route).status_code == 400
    body = {"lora_name": "x", "lora_path": str(adapters["a8"])}
    assert load(server, body, headers={}).status_code == 401
    assert load(server, body, "/v1/unload_lora_adapter", headers={}).status_code == 401
    assert httpx.get(server.url("/v1/models"), headers=AUTH).json() == models
    assert generate(server, "a4") == want["a4"]


def test_a_pinned_load_serves(lora_server):
    server, _, adapters, want = lora_server
    r = load(server, {"lora_name": "p8", "lora_path": str(adapters["a8"]), "pinned": True})
    assert r.status_code == 200 and r.json()["success"], r.text
    try:
        assert generate(server, "p8") == want["a8"]
    finally:
        assert load(server, {"lora_name": "p8"}, "/unload_lora_adapter").status_code == 200
