"""The ModelRunner on CUDA end to end (skipped without CUDA), on a randomly initialised model of
SmolLM2's attention shape (hidden 576, 9 q / 3 kv heads of 64, vocab 49152, tied embeddings,
rope theta 1e5) with 4 layers instead of 30:

- fp32, torch backend: greedy tokens equal transformers' generate on the same GPU, one request
  at a time and all as one mixed batch with chunked prefills;
- bf16: the triton and flashinfer backends' logits equal the torch backend's within bf16
  tolerance over prefill chunks, decodes and a prefix served from another request's pages.

Run by scripts/gpu_check.sh with the other CUDA tests.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from runner_greedy import NEW_TOKENS, PAGE, generate

from gpu.forward_batch import SeqInput, build_forward_batch
from gpu.model_runner import ModelRunner, ModelRunnerConfig

SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters=dict(rope_type="default", rope_theta=100000.0),
)
CUDA = torch.device("cuda")
PROMPT_LENS = [3, 17, 40, 64, 131]
# bf16 logits (std ~19 here) of the same inputs through two backends: their attention outputs round
# differently and the 4 layers carry that to the logits. On the H200 triton and flashinfer were off
# the torch backend by at most 0.81 and 0.12 on average (bf16 against fp32 on a CPU: ~1.1, ~0.16);
# a wrong mask or page is off by units on average
BF16_MAX_DIFF, BF16_MEAN_DIFF = 2.0, 0.3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random model (transformers' init) whose final norm weight is 40: its tied logits spread
    over tens of units, so greedy choices are decided by margins far above rounding."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2_SHAPE), dtype=torch.float32)
    torch.nn.init.constant_(model.model.norm.weight, 40.0)
    path = tmp_path_factory.mktemp("smollm2_shape")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, SMOLLM2_SHAPE["vocab_size"], n).astype(np.int32) for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def expected(model_dir, prompts):
    """transformers' greedy generate on the GPU, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(CUDA).eval()
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = model.generate(
                torch.from_numpy(ids.astype(np.int64))[None].to(CUDA),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                pad_token_id=SMOLLM2_SHAPE["eos_token_id"],
            )
            out.append(gen[0, len(ids) :].tolist())
    del model
    torch.cuda.empty_cache()
    return out


@pytest.fixture(scope="module")
def fp32_runner(model_dir):
    # no max_total_tokens: the KV pool is sized from the device's free memory
    return ModelRunner(
        ModelRunnerConfig(
            model_path=str(model_dir),
            device="cuda",
            dtype="float32",
            attention_backend="torch",
            page_size=PAGE,
            max_running_requests=8,
        )
    )


def test_fp32_one_by_one_equals_transformers(fp32_runner, prompts, expected):
    assert fp32_runner.device.type == "cuda" and fp32_runner.dtype == torch.float32
    for ids, want in zip(prompts, expected):
        assert generate(fp32_runner, [ids], [0], [None]) == [want]


def test_fp32_mixed_batch_with_chunked_prefill_equals_transformers(fp32_runner, prompts, expected):
    got = generate(fp32_runner, prompts, arrive=[0, 0, 1, 2, 3], chunk=[None, 5, 16, 7, 32])
    assert got == expected


def bf16_runner(model_dir, backend: str) -> ModelRunner:
    return ModelRunner(
        ModelRunnerConfig(
            model_path=str(model_dir),
            device="cuda",
            dtype="bfloat16",
            attention_backend=backend,
            page_size=PAGE,
            max_total_tokens=4096,
            max_running_requests=8,
        )
    )


def step_logits(runner: ModelRunner, seqs: list[SeqInput]) -> torch.Tensor:
    """float32 [S, V], the logits step() would sample from."""
    batch = build_forward_batch(seqs, PAGE, runner.model_config.context_length, runner.device)
    runner.attn.plan(batch.meta)
    with torch.inference_mode():
        return runner.model.forward(batch.input_ids, batch.meta.positions, batch.logits_index, runner.attn)


def mixed_schedule(runner: ModelRunner) -> list[list[SeqInput]]:
    """Fixed inputs (no sampling in between, so every backend sees the same tokens): a 600-token
    prompt in two chunks beside a whole 37-token prompt and its decodes, then a request whose
    first two pages are the long prompt's (cached) with 21 tokens of its own, then decode-only
    steps of all three (the long one past 512 tokens, so triton's decode splits the kv)."""
    rng = np.random.default_rng(1)
    tokens = lambda n: rng.integers(3, SMOLLM2_SHAPE["vocab_size"], n).astype(np.int32)
    long, short, own = tokens(600), tokens(37), tokens(21)
    decodes = 5
    p_long = runner.pool.alloc(runner.pool.pages_for(600 + decodes + 2))
    p_short = runner.pool.alloc(runner.pool.pages_for(37 + decodes + 2))
    p_shared = np.concatenate([p_long[:2], runner.pool.alloc(runner.pool.pages_for(2 * PAGE + 21 + decodes) - 2)])
    steps = [
        [SeqInput(0, long[:300], 0, p_long, False), SeqInput(1, short, 0, p_short, True)],
        [SeqInput(1, tokens(1), 37, p_short, True), SeqInput(0, long[300:], 300, p_long, True)],
        [
            SeqInput(0, tokens(1), 600, p_long, True),
            SeqInput(2, own, 2 * PAGE, p_shared, True),
            SeqInput(1, tokens(1), 38, p_short, True),
        ],
    ]
    lens = {0: 601, 1: 39, 2: 2 * PAGE + 21}
    pages = {0: p_long, 1: p_short, 2: p_shared}
    for _ in range(decodes):
        steps.append([SeqInput(r, tokens(1), lens[r], pages[r], True) for r in (2, 0, 1)])
        lens = {r: n + 1 for r, n in lens.items()}
    return steps


@pytest.fixture(scope="module")
def bf16_reference(model_dir):
    runner = bf16_runner(model_dir, "torch")
    return [step_logits(runner, seqs) for seqs in mixed_schedule(runner)]


def check_backend_matches_torch(model_dir, backend: str, reference: list[torch.Tensor]) -> None:
    runner = bf16_runner(model_dir, backend)
    assert runner.attention_backend == backend and runner.dtype == torch.bfloat16
    for i, (seqs, want) in enumerate(zip(mixed_schedule(runner), reference)):
        diff = (step_logits(runner, seqs) - want).abs()
        print(f"{backend} step {i}: |logits - torch's| max {diff.max():.3f} mean {diff.mean():.4f}")
        # within the max, the greedy token is the reference's wherever its margin exceeds twice that
        assert diff.max() <= BF16_MAX_DIFF and diff.mean() <= BF16_MEAN_DIFF, (
            f"step {i}: max {diff.max():.3f} mean {diff.mean():.4f}"
        )


def test_bf16_triton_matches_torch_backend(model_dir, bf16_reference):
    check_backend_matches_torch(model_dir, "triton", bf16_reference)


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer is not installed")
def test_bf16_flashinfer_matches_torch_backend(model_dir, bf16_reference):
    # last in the file: flashinfer compiles its kernels on first use (minutes)
    check_backend_matches_torch(model_dir, "flashinfer", bf16_reference)
