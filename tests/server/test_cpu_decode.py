"""Decode steps with the layer loop in C (gpu/models/cpu_decode.py) give bit for bit the Python
forward's logits: same kernels, same order, same values, on a batch of requests whose
lengths sit around page boundaries, with and without a qkv bias, with a fp32, fp16 or bf16
KV cache (the C store rounds as torch's .to() does), for every family's variations (tiny
GGUFs: q/k norms, Gemma's norms, GELU and soft-caps, sliding windows, per-layer and absent
rope); and the decoder is used only where it reproduces the model (GGUF blocks, C glue, the
cpu attention backend)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.forward_batch import SeqInput, build_forward_batch
from gpu.kernels import cpu_kernels_available
from gpu.model_runner import ModelRunner, ModelRunnerConfig
from gpu.models.cpu_decode import CpuDecoder
from protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="needs an AVX2 CPU and a C compiler")

LENGTHS = [1, 15, 16, 17, 33, 70]  # the page size is 16


@pytest.fixture(
    scope="module",
    params=[
        ("gguf", "auto"),
        ("gguf-q8", "auto"),  # float16 K and V
        ("gguf-q8", "float32"),
        ("gguf-q8", "float16"),
        ("gguf-q8", "bfloat16"),
        ("gguf", "float16"),
        ("gguf-q8", "fp8_e5m2"),
    ],
    ids="-".join,
)
def runner(request):
    quantization, kv_cache_dtype = request.param
    return ModelRunner(
        ModelRunnerConfig(
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            max_total_tokens=1024,
            max_running_requests=len(LENGTHS),
        )
    )


def decode_batch(runner: ModelRunner, lengths: list[int] = LENGTHS):
    """Every request prefilled, then one decode step's batch of all of them."""
    rng = np.random.default_rng(0)
    seqs = []
    vocab = runner.model_config.vocab_size
    for row, n in enumerate(lengths):
        prompt = rng.integers(min(100, vocab // 2), min(40000, vocab), n).astype(np.int32)
        pages = runner.pool.alloc(runner.pool.pages_for(n + 1))
        runner.set_request(row, SamplingParams(temperature=0.0), prompt, np.zeros(0, np.int32))
        token = runner.step([SeqInput(row, prompt, 0, pages, True)]).tokens[:1]
        seqs.append(SeqInput(row, token.astype(np.int32), n, pages, True))
    return build_forward_batch(seqs, runner.config.page_size, runner.model_config.context_length, runner.device)


def python_forward(runner: ModelRunner, batch) -> torch.Tensor:
    runner.attn.plan(batch.meta)
    return runner.model.forward(batch.input_ids, batch.meta.positions, batch.logits_index, runner.attn)


@torch.inference_mode()
def test_decode_logits_equal_the_python_forward(runner):
    assert runner.decoder is not None and runner.decoder.takes(decode_batch(runner).meta)
    batch = decode_batch(runner)
    kv = runner.kv_cache
    stored = lambda: kv.buffer.view(kv.num_layers, 2, -1, kv.num_kv_heads, kv.head_dim)[:, :, batch.meta.out_cache_loc]
    c_logits = runner.decoder.forward(batch.input_ids, batch.meta, batch.logits_index)
    c_stored = stored().clone()
    # both store the step's K and V at the same slots, with the same bits (rounded alike)
    assert torch.equal(c_logits, python_forward(runner, batch))
    assert torch.equal(c_stored.view(torch.uint8), stored().view(torch.uint8))
    # as a step runs it: into the storage the runner keeps (its prefills' used it, and their
    # MLP inputs the model's) until idle
    assert runner.logits_buffer.capacity >= 1 and runner.model.mlp_input.capacity >= max(LENGTHS)
    out = runner.logits_buffer.rows(len(batch.logits_index))
    into = runner.decoder.forward(batch.input_ids, batch.meta, batch.logits_index, None, out)
    assert into.data_ptr() == out.data_ptr()
    assert torch.equal(out, c_logits)
    runner.idle()  # the scheduler's, after a burst
    assert runner.logits_buffer.capacity == runner.model.mlp_input.capacity == 0


def check_variation(runner: ModelRunner, monkeypatch, name: str, value) -> None:
    """With the model's `name` set to `value`, a decoder made then gives the Python forward's
    logits, which differ from the unchanged model's."""
    monkeypatch.setattr(runner.model, name, value)
    decoder = CpuDecoder(runner.model, runner.kv_cache)
    batch = decode_batch(runner)
    changed = decoder.forward(batch.input_ids, batch.meta, batch.logits_index)
    assert torch.equal(changed, python_forward(runner, batch))
    monkeypatch.undo()
    assert not torch.equal(changed, runner.decoder.forward(batch.input_ids, batch.meta, batch.logits_index))


@torch.inference_mode()
def test_qkv_bias_is_added(runner, monkeypatch):
    width = runner.model.qkv[0].shape[0]
    layers = len(runner.model.qkv)
    biases = [torch.randn(width, generator=torch.Generator().manual_seed(i)) * 0.1 for i in range(layers)]
    check_variation(runner, monkeypatch, "qkv_bias", biases)


def test_only_where_it_reproduces_the_model():
    exact = ModelRunnerConfig(quantization="none", max_total_tokens=256, max_running_requests=2)
    assert ModelRunner(exact).decoder is None  # fp32: MKL
    assert (
        ModelRunner(
            ModelRunnerConfig(
                quantization="gguf-q8", attention_backend="torch", max_total_tokens=256, max_running_requests=2
            )
        ).decoder
        is None
    )


def test_prefill_takes_the_python_forward(runner):
    decoder = runner.decoder
    prefill = build_forward_batch(
        [SeqInput(0, np.arange(5, dtype=np.int32), 0, np.arange(1, dtype=np.int32), True)],
        runner.config.page_size,
        runner.model_config.context_length,
        runner.device,
    )
    assert not decoder.takes(prefill.meta)


FAMILIES = ["llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_every_family_decodes_as_the_python_forward(family, tmp_path, monkeypatch):
    """Tiny Q8_0 GGUFs of each family (tests/server/test_gpu_model_families_gguf.py), windows of 16
    tokens under requests of up to 70: the C loop's logits and stored K/V bit for bit the
    Python forward's."""
    from test_gpu_model_families_gguf import typed_model, write_gguf

    import gpu.models.model_files

    monkeypatch.setattr(gpu.models.model_files, "cache_root", lambda: tmp_path / "cache")
    path = tmp_path / f"{family}.gguf"
    write_gguf(family, typed_model(family), path, "Q8_0")
    runner = ModelRunner(
        ModelRunnerConfig(
            model_path=str(path),
            quantization="gguf-q8",
            max_total_tokens=1024,
            max_running_requests=len(LENGTHS),
        )
    )
    assert runner.decoder is not None
    gate_up = runner.model.gate_up[0].parts  # packed (an AVX512-VNNI CPU): act(gate) * up in one product
    if len(gate_up) == 1 and gate_up[0].kernels.gated is not None:
        assert all(layer.gated for layer in runner.decoder._layers)
    test_decode_logits_equal_the_python_forward(runner)


@torch.inference_mode()
def test_layers_without_rope_are_left_unrotated(runner, monkeypatch):
    """SmolLM3's NoPE layers: a layer whose rope is None in the model is None in the C loop too."""
    ropes = [None if i % 2 else r for i, r in enumerate(runner.model.layer_rope)]
    check_variation(runner, monkeypatch, "layer_rope", ropes)
