"""A LoRA adapter's logits as ringserve computes them in mixed batches (the base and three
adapters of ranks 4, 8 and 16, random non-zero A and B on every attention and MLP projection;
a prefill chunk, then a few tokens on its KV as a speculative verify runs them: the deltas of
decode_cpu.c's lora_apply) equal PEFT's, unmerged (its LoRA layers) and merged
(merge_and_unload), at 1e-4 in the exact mode, for tiny random-weight models of two families
(Llama; Qwen2, whose q/k/v have biases); and the C decode loop adds the deltas as the Python
forward does."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tiny_models import save_tiny, save_tiny_adapter

from gpu.forward_batch import SeqInput, build_forward_batch
from gpu.kernels import cpu_kernels_available
from gpu.lora import LoraBatch
from gpu.model_runner import ModelRunner, ModelRunnerConfig
from protocol.sampling_params import SamplingParams

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
    pages = [runner.pool.alloc(runner.pool.pages_for(len(prompt))) for _ in range(4)]
    chunks = []
    for lo, hi in ((0, 16), (16, 21)):  # a prefill chunk, then 5 tokens on its KV (a verify's shape)
        seqs = [SeqInput(row, prompt[lo:hi], lo, pages[row], True) for row in range(4)]
        batch = build_forward_batch(seqs, PAGE, runner.model_config.context_length, runner.device)
        runner.attn.plan(batch.meta)
        token_lora = np.repeat(np.arange(4), hi - lo)  # row 0 the base, row i adapter i
        lora = LoraBatch(runner.loras.resident, token_lora, runner.device)
        with torch.inference_mode():
            every = torch.arange(batch.meta.num_tokens)
            logits = runner.model.forward(batch.input_ids, batch.meta.positions, every, runner.attn, lora).cpu()
        chunks.append(logits.reshape(4, hi - lo, -1))
    got = torch.cat(chunks, 1)

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


@pytest.mark.skipif(not cpu_kernels_available(), reason="needs an AVX2 CPU and a C compiler")
@torch.inference_mode()
def test_c_decode_loop_adds_the_deltas_as_the_python_forward(tmp_path):
    """The embedded GGUF in `gguf` mode, whose decode steps run the C layer loop: a decode batch
    of the base and two adapters (ranks 4 and 8) gives the Python forward's logits to 1e-4. (Not
    in gguf-q8: the deltas' sums in another order move an activation across an int8 rounding
    step now and then, which 30 layers amplify; both paths are right to the mode's own noise.)"""
    from perf.lora_bench import write_random_adapter

    runner = ModelRunner(
        ModelRunnerConfig(
            quantization="gguf",
            max_total_tokens=1024,
            max_running_requests=4,
            enable_lora=True,
            max_loras_per_batch=2,
        )
    )
    assert runner.decoder is not None and runner.loras is not None
    for lid in (1, 2):
        path = write_random_adapter(tmp_path / f"a{lid}", runner.model_config, 4 * lid, seed=lid)
        runner.loras.register(lid, runner.loras.load(path.name, str(path)))
    rows_lora = [0, 1, 2, 1]
    rng = np.random.default_rng(0)
    seqs = []
    for row, (lid, n) in enumerate(zip(rows_lora, (5, 16, 17, 30))):
        prompt = rng.integers(100, 40000, n).astype(np.int32)
        pages = runner.pool.alloc(runner.pool.pages_for(n + 1))
        runner.set_request(row, SamplingParams(temperature=0.0, lora_id=lid), prompt, np.zeros(0, np.int32))
        token = runner.step([SeqInput(row, prompt, 0, pages, True)]).tokens[:1]  # its adapter's KV
        seqs.append(SeqInput(row, token.astype(np.int32), n, pages, True))
    batch = build_forward_batch(seqs, runner.config.page_size, runner.model_config.context_length, runner.device)
    assert runner.decoder.takes(batch.meta)
    lora = LoraBatch(runner.loras.resident, np.array(rows_lora), runner.device)
    c_logits = runner.decoder.forward(batch.input_ids, batch.meta, batch.logits_index, lora)
    runner.attn.plan(batch.meta)
    python = runner.model.forward(batch.input_ids, batch.meta.positions, batch.logits_index, runner.attn, lora)
    torch.testing.assert_close(c_logits, python, rtol=1e-4, atol=1e-4)
    base = runner.decoder.forward(batch.input_ids, batch.meta, batch.logits_index)
    assert torch.equal(c_logits[0], base[0])  # the base model's row is left as it is
    assert all((c_logits[i] - base[i]).abs().max() > 1e-2 for i in (1, 2, 3)), "the deltas must count"
