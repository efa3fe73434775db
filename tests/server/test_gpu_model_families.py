"""Tiny randomly initialised transformers models of each supported family, saved as
safetensors, loaded by the ModelRunner: its logits over a mixed, chunked, paged batch equal
transformers' own forward (real code on both sides)."""

import numpy as np
import pytest
import torch

from gpu.forward_batch import SeqInput, build_forward_batch
from gpu.model_runner import ModelRunner, ModelRunnerConfig

SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=320,
)
PAGE = 4


def tiny_config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if family == "llama3_rope_untied":
        return LlamaConfig(
            **SMALL,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        )
    if family == "llama_linear_rope_head_dim":
        return LlamaConfig(
            **SMALL,
            head_dim=24,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
        )
    if family == "qwen2_bias":
        return Qwen2Config(**SMALL, tie_word_embeddings=True)
    if family == "mistral":
        return MistralConfig(**SMALL, sliding_window=None)
    raise ValueError(family)


def save_tiny(family: str, path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32).eval()
    if family == "qwen2_bias":  # random init leaves biases at zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(path)
    return model


def forward_logits(runner: ModelRunner, seqs: list[SeqInput]) -> torch.Tensor:
    """Logits of every token of the step (step() itself only returns sampled tokens)."""
    batch = build_forward_batch(seqs, PAGE, runner.model_config.context_length, runner.device)
    runner.attn.plan(batch.meta)
    every = torch.arange(batch.meta.num_tokens)
    with torch.inference_mode():
        return runner.model.forward(batch.input_ids, batch.meta.positions, every, runner.attn).cpu()


@pytest.mark.parametrize("family", ["llama3_rope_untied", "llama_linear_rope_head_dim", "qwen2_bias", "mistral"])
def test_logits_match_transformers(family, tmp_path):
    hf = save_tiny(family, tmp_path)
    runner = ModelRunner(
        ModelRunnerConfig(
            model_path=str(tmp_path),
            quantization="none",
            page_size=PAGE,
            max_total_tokens=1024,
            max_running_requests=4,
        )
    )
    assert runner.model_config.architecture == type(hf).__name__
    rng = np.random.default_rng(1)
    long = rng.integers(0, 256, 300).astype(np.int32)  # far past llama3's original 64 positions
    short = rng.integers(0, 256, 9).astype(np.int32)
    p_long = runner.pool.alloc(runner.pool.pages_for(301))
    p_short = runner.pool.alloc(runner.pool.pages_for(9))
    with torch.inference_mode():
        want_long = hf(torch.from_numpy(long.astype(np.int64))[None]).logits[0]
        want_short = hf(torch.from_numpy(short.astype(np.int64))[None]).logits[0]
    # step 1: the long prompt's first 250 tokens with the short prompt's first 5
    got = forward_logits(runner, [SeqInput(0, long[:250], 0, p_long, False), SeqInput(1, short[:5], 0, p_short, False)])
    torch.testing.assert_close(got[:250], want_long[:250], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[250:], want_short[:5], rtol=1e-4, atol=1e-4)
    # step 2: the rest of both, the short one second and ending mid-page
    got = forward_logits(runner, [SeqInput(1, short[5:], 5, p_short, True), SeqInput(0, long[250:], 250, p_long, True)])
    torch.testing.assert_close(got[:4], want_short[5:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[4:], want_long[250:], rtol=1e-4, atol=1e-4)


def test_rms_norm_is_bit_identical_to_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from gpu.models.llama import rms_norm

    ref = LlamaRMSNorm(576, eps=1e-5)
    torch.nn.init.normal_(ref.weight)
    for T in (1, 7, 300):
        x = torch.randn(T, 576) * 3
        assert torch.equal(rms_norm(x, ref.weight.detach(), 1e-5), ref(x).detach())
