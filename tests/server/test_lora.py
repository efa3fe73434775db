"""LoRA adapters on a real server: two PEFT adapters (ranks 4 and 8, random non-zero A and B on
every attention and MLP projection) of a tiny random-weight Llama. Each adapter's greedy tokens
through the whole server equal PEFT's merged model's; a batch mixing the base and both adapters
(same prompt, so the prefix cache would hand one's KV to another if it were not keyed by
adapter) gives each request what it gets alone; unknown adapters are 404s naming them; bad
adapters stop the start with a line naming the problem."""

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
from tiny_models import save_tiny

pytestmark = pytest.mark.torch_threads(2)

KEY = "lora-key"
AUTH = {"authorization": f"Bearer {KEY}"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANKS = {"a4": 4, "a8": 8}
PROMPT = [1, *range(300, 339)]  # 40 tokens: two full pages of 16 enter the prefix cache
NEW = 8


def save_base(path: Path) -> Path:
    return save_tiny(path, 5)


def save_adapter(base: Path, path: Path, rank: int, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # PEFT starts B at zero: random A and B make every delta count
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    peft.save_pretrained(path)
    return path


def greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, EOS or not (the server runs with ignore_eos)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def reference(base: Path, adapter: Path | None) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    return greedy(model, PROMPT, NEW)


@pytest.fixture(scope="module")
def lora_server(start_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_base(root / "m")
    adapters = {name: save_adapter(base, root / name, r, seed) for seed, (name, r) in enumerate(RANKS.items())}
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
    lacking = tmp_path / "lacking"
    shutil.copytree(adapters["a4"], lacking)
    conf = json.loads((lacking / "adapter_config.json").read_text())
    (lacking / "adapter_config.json").write_text(json.dumps({**conf, "target_modules": ["q_proj", "c_attn"]}))
    assert "target modules ['c_attn'] are not projections" in serve_error(*lora, f"x={lacking}")
    # an adapter of another model's shapes
    wide = tmp_path / "wide"
    wide.mkdir()
    shutil.copy(adapters["a4"] / "adapter_config.json", wide)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapters["a4"] / "adapter_model.safetensors"))
    save_file(
        {k: torch.cat([v, v], 1) if "lora_A" in k else v for k, v in tensors.items()},
        str(wide / "adapter_model.safetensors"),
    )
    assert "do not fit the model" in serve_error(*lora, f"x={wide}")
