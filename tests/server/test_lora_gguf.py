"""llama.cpp's GGUF LoRA adapters on a GGUF base: a PEFT adapter (random non-zero A and B,
every attention and MLP projection) of a tiny random-weight Llama and Qwen2 written as
convert_lora_to_gguf.py writes it (perf/lora_bench.py's write_gguf_adapter: general.type
"adapter", adapter.type "lora", adapter.lora.alpha; `blk.N.<projection>.weight.lora_a` /
`.lora_b` named by gguf's own tensor map, a Llama's q/k B rows permuted as the base's
weights), with the base model written as convert_hf_to_gguf.py writes it. Its logits in the
exact mode equal the PEFT adapter's on the same GGUF base and PEFT's own at 1e-4; F16, BF16
and Q8_0 files give what their values are; files llama.cpp would refuse, or that ringserve
does not serve, are refused naming the problem; through the whole server the GGUF adapter's
greedy tokens equal PEFT's merged model's, and a bad file's run-time load is a 400 naming
lora_path."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_gpu_model_families import PAGE, SMALL
from test_gpu_model_families_gguf import write_gguf
from test_gpu_model_families_more import make_runner
from tiny_models import LORA_TARGETS, peft_greedy, perturb_norms_and_biases, save_tiny_adapter

import gpu.models.model_files
from gpu.forward_batch import SeqInput, build_forward_batch
from gpu.lora import LoraBatch, LoraLoadError
from gpu.models.model_config import ModelConfig
from perf import lora_bench

pytestmark = pytest.mark.torch_threads(2)

SHAPE = dict(SMALL, tie_word_embeddings=True)


def tiny_base(family: str, root: Path) -> tuple[Path, Path]:
    """The model as an HF directory (for PEFT) and as a GGUF file of F32 weights (ringserve's base)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(0)
    cfg = (LlamaConfig if family == "llama" else Qwen2Config)(**SHAPE)
    model = perturb_norms_and_biases(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval())
    model.save_pretrained(root / "hf")
    write_gguf(family, model, root / f"tiny-{family}.gguf")
    return root / "hf", root / f"tiny-{family}.gguf"


def write_gguf_adapter(peft_dir: Path, path: Path, family: str = "llama", arch: str | None = None, **kw) -> Path:
    """The PEFT adapter at `peft_dir` (of the model tiny_base saved beside it) as
    convert_lora_to_gguf.py writes it for a `family` base, or an `arch` one (perf/lora_bench.py's
    writer: the benchmark gives llama.cpp the same files)."""
    cfg = ModelConfig.from_dir(peft_dir.parent / "hf")
    return lora_bench.write_gguf_adapter(peft_dir, path, cfg, arch or family, **kw)


def rounded(data: np.ndarray, type_name: str) -> np.ndarray:
    """What a reader of `data` written as `type_name` sees."""
    qtype = gguf.GGMLQuantizationType[type_name]
    return gguf.quants.dequantize(gguf.quants.quantize(data.astype(np.float32), qtype), qtype)


@pytest.fixture()
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu.models.model_files, "cache_root", lambda: tmp_path / "cache")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gguf_adapter_logits_equal_peft(family, tmp_path, gguf_cache):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf_dir, base = tiny_base(family, tmp_path)
    peft_dir = save_tiny_adapter(hf_dir, tmp_path / "peft", 8, seed=1)
    adapter = write_gguf_adapter(peft_dir, tmp_path / "lora.gguf", family)
    runner = make_runner(base, enable_lora=True, max_loras_per_batch=2)
    assert runner.loras is not None
    for lid, path in enumerate((peft_dir, adapter), 1):
        runner.loras.register(lid, runner.loras.load(path.name, str(path)))

    prompt = np.random.default_rng(0).integers(3, 256, 13).astype(np.int32)
    seqs = [SeqInput(row, prompt, 0, runner.pool.alloc(runner.pool.pages_for(len(prompt))), True) for row in range(3)]
    batch = build_forward_batch(seqs, PAGE, runner.model_config.context_length, runner.device)
    runner.attn.plan(batch.meta)
    lora = LoraBatch(runner.loras.resident, np.repeat(np.arange(3), len(prompt)), runner.device)
    with torch.inference_mode():
        every = torch.arange(batch.meta.num_tokens)
        got = runner.model.forward(batch.input_ids, batch.meta.positions, every, runner.attn, lora)
        got = got.cpu().reshape(3, len(prompt), -1)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        want = PeftModel.from_pretrained(copy.deepcopy(hf), peft_dir).eval()(
            torch.from_numpy(prompt[None].astype(np.int64))
        )
    assert (got[2] - got[0]).abs().max() > 0.1, "the adapter must change the logits"
    torch.testing.assert_close(got[2], got[1], rtol=1e-4, atol=1e-4)  # the GGUF file = the PEFT directory
    torch.testing.assert_close(got[2], want.logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("type_name", ["F16", "BF16", "Q8_0"])
def test_typed_gguf_adapters_give_their_values(type_name, tmp_path, gguf_cache):
    """Each file in `type_name` loads as the F32 file of its values (the rounding of the type)."""
    hf_dir, base = tiny_base("llama", tmp_path)
    peft_dir = save_tiny_adapter(hf_dir, tmp_path / "peft", 32, seed=2)  # rank 32: Q8_0 blocks along A's rows too
    weights = tmp_path / "peft" / "adapter_model.safetensors"
    typed = write_gguf_adapter(peft_dir, tmp_path / "typed.gguf", type_name=type_name)
    from safetensors.torch import save_file

    values = {k: torch.from_numpy(rounded(t.numpy(), type_name)) for k, t in load_file(str(weights)).items()}
    save_file(values, str(weights))
    f32 = write_gguf_adapter(peft_dir, tmp_path / "f32.gguf")
    runner = make_runner(base, enable_lora=True)
    assert runner.loras is not None
    got, want = runner.loras.load("typed", str(typed)).pairs, runner.loras.load("f32", str(f32)).pairs
    assert got.keys() == want.keys() and len(got) == 2 * 4
    for key, (a, bt) in want.items():
        torch.testing.assert_close(got[key][0], a, rtol=0, atol=0)
        torch.testing.assert_close(got[key][1], bt, rtol=1e-6, atol=1e-7)  # B's scaling folded in alike


A_Q = np.ones((4, SHAPE["hidden_size"]), np.float32)


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"general_type": "model"}, "general.type is 'model', not 'adapter'"),
        ({"arch": "qwen2"}, "architecture 'qwen2'; the model is 'llama'"),
        ({"type_name": "Q4_0"}, "is Q4_0; supported: F32, F16, BF16, Q8_0"),
        ({"extra": {"blk.0.attn_norm.weight": np.ones((1, 64), np.float32)}}, "'blk.0.attn_norm.weight' is not"),
        ({"extra": {"token_embd.weight.lora_a": A_Q}}, "'token_embd.weight.lora_a' is not a LoRA pair's"),
        ({"extra": {"blk.7.attn_q.weight.lora_a": A_Q, "blk.7.attn_q.weight.lora_b": A_Q.T.copy()}}, "layer 7"),
        ({"extra": {"blk.0.attn_qkv.weight.lora_a": A_Q}}, "'blk.0.attn_qkv.weight.lora_a' is not"),
    ],
)
def test_bad_gguf_adapters_are_refused_naming_the_problem(change, problem, tmp_path, gguf_cache):
    hf_dir, base = tiny_base("llama", tmp_path)
    peft_dir = save_tiny_adapter(hf_dir, tmp_path / "peft", 32, seed=3, targets=["q_proj", "v_proj"])  # Q4_0 rows
    bad = write_gguf_adapter(peft_dir, tmp_path / "bad.gguf", **change)
    runner = make_runner(base, enable_lora=True)
    assert runner.loras is not None
    with pytest.raises(LoraLoadError, match="LoRA adapter 'bad'") as e:
        runner.loras.load("bad", str(bad))
    assert problem in str(e.value)


def test_gguf_adapter_shapes_and_pairs_are_checked(tmp_path, gguf_cache):
    hf_dir, base = tiny_base("llama", tmp_path)
    runner = make_runner(base, enable_lora=True)
    assert runner.loras is not None
    # an A without its B; a B of the wrong shape
    other = save_tiny_adapter(hf_dir, tmp_path / "peft", 4, seed=4, targets=["q_proj"])
    path = write_gguf_adapter(other, tmp_path / "lone.gguf", extra={"blk.1.attn_k.weight.lora_a": A_Q})
    with pytest.raises(LoraLoadError, match="layer 1 k_proj has lora_A without its pair"):
        runner.loras.load("lone", str(path))
    path = write_gguf_adapter(
        other, tmp_path / "wide.gguf", extra={"blk.1.attn_k.weight.lora_a": A_Q, "blk.1.attn_k.weight.lora_b": A_Q}
    )
    with pytest.raises(LoraLoadError, match=r"k_proj: A \(4, 64\) and B \(4, 64\) do not fit"):
        runner.loras.load("wide", str(path))
    hf_runner = make_runner(hf_dir, enable_lora=True)  # a GGUF adapter needs a GGUF base
    assert hf_runner.loras is not None
    with pytest.raises(LoraLoadError, match="needs a GGUF base model"):
        hf_runner.loras.load("x", str(write_gguf_adapter(other, tmp_path / "x.gguf")))


KEY = "gguf-lora-key"
PROMPT = [1, *range(40, 70)]
NEW = 8


def test_gguf_adapter_through_the_server(start_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-lora")
    hf_dir, base = tiny_base("llama", root)
    peft_dir = save_tiny_adapter(hf_dir, root / "peft", 8, seed=5, targets=LORA_TARGETS)
    adapter = write_gguf_adapter(peft_dir, root / "sql.gguf", type_name="F32")
    want, want_base = peft_greedy(hf_dir, peft_dir, PROMPT, NEW), peft_greedy(hf_dir, None, PROMPT, NEW)
    assert want != want_base, "the adapter must change the greedy tokens"
    server = start_server(
        start_server.Server.granian,
        model_path=str(base),
        api_key=KEY,
        enable_lora=1,
        lora_paths=json.dumps([f"sql={adapter}"]),
        max_total_tokens=1024,
        max_running_requests=4,
    )
    auth = {"authorization": f"Bearer {KEY}"}

    def generate(lora: str | None) -> list[int]:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}
        r = httpx.post(server.url("/generate"), json={**body, "lora_path": lora}, headers=auth, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    assert generate("sql") == want
    assert generate(None) == want_base
    # at run time: the same file under another name serves alike; a bad file is a 400 naming lora_path
    r = httpx.post(
        server.url("/v1/load_lora_adapter"), json={"lora_name": "sql2", "lora_path": str(adapter)}, headers=auth
    )
    assert r.status_code == 200, r.text
    assert generate("sql2") == want
    bad = write_gguf_adapter(peft_dir, root / "bad.gguf", arch="qwen2")
    r = httpx.post(server.url("/v1/load_lora_adapter"), json={"lora_name": "bad", "lora_path": str(bad)}, headers=auth)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_path" and "architecture 'qwen2'" in err["message"], err
    r = httpx.post(
        server.url("/v1/load_lora_adapter"), json={"lora_name": "bad", "lora_path": str(root / "no.gguf")}, headers=auth
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
