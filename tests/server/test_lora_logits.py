"""A LoRA adapter's logits as ringserve computes them in one mixed batch (the base and three
adapters of ranks 4, 8 and 16, random non-zero A and B on every attention and MLP projection)
equal PEFT's, unmerged (its LoRA layers) and merged (merge_and_unload), at 1e-4 in the exact
mode, for tiny random-weight models of two families (Llama; Qwen2, whose q/k/v have biases)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tiny_models import save_tiny, save_tiny_adapter

from gpu.forward_batch import SeqInput, build_forward_batch
from gpu.lora import LoraBatch
from gpu.model_runner import ModelRunner, ModelRunnerConfig

pytestmark = pytest.mark.torch_threads(2)

RANKS = (4, 8, 16)
PAGE = 16


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_adapter_logits_equal_peft_merged_and_unmerged(family, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = save_tiny(tmp_path / "m", 3, family)
    if family == "qwen2":  # random init leaves the q/k/v biases at zero: make them count
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        torch.manual_seed(4)
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
        hf.save_pretrained(base)
    adapters = [save_tiny_adapter(base, tmp_path / f"r{r}", r, seed=r) for r in RANKS]
    runner = ModelRunner(
        ModelRunnerConfig(
            model_path=str(base),
            quantization="none",
            page_size=PAGE,
            max_total_tokens=1024,
            max_running_requests=4,
            enable_lora=True,
            max_loras_per_batch=len(RANKS),
        )
    )
    assert runner.loras is not None
    for lid, path in enumerate(adapters, 1):
        runner.loras.register(lid, runner.loras.load(path.name, str(path)))

    prompt = np.random.default_rng(0).integers(0, 2000, 21).astype(np.int32)
    seqs = [SeqInput(row, prompt, 0, runner.pool.alloc(runner.pool.pages_for(len(prompt))), True) for row in range(4)]
    batch = build_forward_batch(seqs, PAGE, runner.model_config.context_length, runner.device)
    runner.attn.plan(batch.meta)
    token_lora = np.repeat(np.arange(4), len(prompt))  # row 0 the base, row i adapter i
    lora = LoraBatch(runner.loras.resident, token_lora, runner.device)
    with torch.inference_mode():
        every = torch.arange(batch.meta.num_tokens)
        got = runner.model.forward(batch.input_ids, batch.meta.positions, every, runner.attn, lora).cpu()
    got = got.reshape(4, len(prompt), -1)

    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.inference_mode():
        torch.testing.assert_close(got[0], hf(ids).logits[0], rtol=1e-4, atol=1e-4)
        for i, path in enumerate(adapters, 1):
            unmerged = PeftModel.from_pretrained(copy.deepcopy(hf), path).eval()
            want = unmerged(ids).logits[0]
            assert (want - hf(ids).logits[0]).abs().max() > 0.1, "the adapter must change the logits"
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
            merged = unmerged.merge_and_unload().eval()
            torch.testing.assert_close(got[i], merged(ids).logits[0], rtol=1e-4, atol=1e-4)
