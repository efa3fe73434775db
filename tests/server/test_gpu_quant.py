"""--quantization gguf / gguf-q8 on the embedded SmolLM2 Q4_1: every weight is used where it
lies in the file's mapping (no copy), the projections through the block kernels, but for
gguf-q8's Q4_1 projections (a repacked copy, the in-place kernel being slower); the exact
mode (gguf) gives the dequantized fp32 executor's (none) greedy tokens, gguf-q8 follows them
for as long as measured below; the q/k rows stay in llama.cpp's permuted order and the rope
rotates adjacent pairs. What auto resolves to, and a bad mode or a model that is not a GGUF,
in one line each."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gpu.kernels import cpu_kernels_available
from gpu.models.model_files import ModelLoadError
from gpu.quant.gguf_weight import GGUFWeight
from protocol.sampling_params import SamplingParams
from runtime.config import ServerArgs

needs_kernels = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the GGUF kernels need an AVX2 CPU and a C compiler"
)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:"]
# gguf-q8's greedy tokens equal gguf's for at least this many of 16 (measured: all 16 of each;
# where near ties fall moves with the kernels' order of sums, so less is asked)
Q8_PROMPTS = {"The capital of France is": 5, "Water boils at": 7, "The best way to learn Python is": 8}


def runner(quantization: str):
    from gpu.model_runner import ModelRunner, ModelRunnerConfig

    return ModelRunner(ModelRunnerConfig(quantization=quantization, max_total_tokens=1024, max_running_requests=4))


@pytest.fixture(scope="module")
def gguf_engine():
    from runtime.offline import OfflineEngine

    return OfflineEngine(quantization="gguf", max_total_tokens=2048, max_running_requests=4)


def mapping(array: np.ndarray) -> np.ndarray:
    """The array over the whole file that `array` is a view of."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


@needs_kernels
def test_every_weight_is_read_in_place_from_the_mapping():
    model = runner("gguf").model
    projections = [*model.qkv, *model.o, *model.gate_up, *model.down, model.embed, model.lm_head]
    assert all(isinstance(w, GGUFWeight) and w.activations == "f32" for w in projections)
    assert model.lm_head is model.embed  # tied: one weight
    assert {t for w in projections for t in w.type_names} == {"Q4_1", "Q8_0"}
    assert len(model.qkv[0].parts) == 3 and len(model.gate_up[0].parts) == 2  # fused without a copy
    file = mapping(model.embed.parts[0].data)
    start, end = file.ctypes.data, file.ctypes.data + file.nbytes
    assert end - start == model.cfg.gguf_path.stat().st_size
    for w in projections:
        for p in w.parts:
            assert not p.data.flags.writeable and start <= p.address < end
    for norm in (model.norm, *model.input_norm, *model.post_norm):  # F32 tensors of the file
        assert start <= norm.data_ptr() < end
    assert model.ops.rope_style == "pairs"  # llama.cpp's permuted q/k rows, used as they are


@needs_kernels
def test_q8_repacks_the_q4_1_projections_and_multiplies_as_in_place():
    """The one exception (gpu/quant/blocks.py): gguf-q8's Q4_1 projections are a repacked copy
    whose products are the in-place kernel's (the same int8 arithmetic, sums in another order);
    the Q8_0 embedding and LM head stay in the mapping."""
    from gpu.models.gguf_file import GGUFFile

    model = runner("gguf-q8").model
    file = mapping(model.embed.parts[0].data)
    start, end = file.ctypes.data, file.ctypes.data + file.nbytes
    assert model.embed.type_names == ("Q8_0",) and start <= model.embed.parts[0].address < end
    tensors = GGUFFile(model.cfg.gguf_path).tensors
    for w, names in (
        (model.qkv[2], ["blk.2.attn_q.weight", "blk.2.attn_k.weight", "blk.2.attn_v.weight"]),
        (model.down[7], ["blk.7.ffn_down.weight"]),
    ):
        assert w.type_names == ("Q4_1",) and not start <= w.parts[0].address < end
        in_place = GGUFWeight([tensors[n] for n in names], "q8")
        x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0))
        want = in_place.matmul(x)
        torch.testing.assert_close(w.matmul(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_kernels
def test_exact_mode_greedy_tokens_equal_the_dequantized_executor(gguf_engine):
    from runtime.offline import OfflineEngine

    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    want = OfflineEngine(quantization="none", max_total_tokens=2048, max_running_requests=4).generate(PROMPTS, params)
    got = gguf_engine.generate(PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


@needs_kernels
def test_q8_greedy_tokens_follow_gguf(gguf_engine):
    from runtime.offline import OfflineEngine

    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    engine = OfflineEngine(quantization="gguf-q8", max_total_tokens=2048, max_running_requests=4)
    want = gguf_engine.generate(list(Q8_PROMPTS), params)
    got = engine.generate(list(Q8_PROMPTS), params)
    for (prompt, n), g, w in zip(Q8_PROMPTS.items(), got, want):
        assert g.token_ids[:n] == w.token_ids[:n], prompt


@needs_kernels
def test_exact_mode_logits_equal_the_dequantized_weights():
    """A prefill's logits, gguf against none: the same values, the sums in another order."""
    from gpu.forward_batch import SeqInput, build_forward_batch

    prompt = np.arange(100, 140, dtype=np.int32)
    logits = []
    for r in (runner("gguf"), runner("none")):
        pages = r.pool.alloc(r.pool.pages_for(len(prompt)))
        batch = build_forward_batch(
            [SeqInput(0, prompt, 0, pages, True)], r.config.page_size, r.model_config.context_length, r.device
        )
        r.attn.plan(batch.meta)
        with torch.inference_mode():
            logits.append(r.model.forward(batch.input_ids, batch.meta.positions, batch.logits_index, r.attn))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("value", ["q8", "GGUF", "gguf_q8"])
def test_a_bad_quantization_is_named(value):
    with pytest.raises(ValueError, match=r"--quantization must be one of \['auto', 'none', 'gguf', 'gguf-q8'\]"):
        ServerArgs.from_env({"RINGSERVE_QUANTIZATION": value})
    with pytest.raises(ModelLoadError, match="--quantization must be one of"):
        runner(value)


def test_a_model_that_is_not_gguf_is_refused(tmp_path):
    from test_gpu_model_families import save_tiny

    from gpu.model_runner import ModelRunner, ModelRunnerConfig

    save_tiny("llama3_rope_untied", tmp_path)
    with pytest.raises(ModelLoadError, match="needs a .gguf model"):
        ModelRunner(
            ModelRunnerConfig(
                model_path=str(tmp_path), quantization="gguf", max_total_tokens=256, max_running_requests=1
            )
        )


@pytest.mark.parametrize(
    "path, device, dtype, want",
    [
        ("m.gguf", "cpu", torch.float32, "gguf-q8"),  # every family
        ("m.gguf", "cpu", torch.bfloat16, "none"),  # the kernels take fp32 activations
        ("m.gguf", "cuda", torch.float32, "none"),  # the kernels are CPU C
        ("hf_dir", "cpu", torch.float32, "none"),  # no blocks to use
    ],
)
def test_auto_quantization_is_gguf_q8_where_its_kernels_run(path, device, dtype, want):
    from gpu.model_runner import resolve_quantization

    if want != "none" and not cpu_kernels_available():
        want = "none"
    assert resolve_quantization("auto", Path(path), torch.device(device), dtype) == want
    for given in ("none", "gguf", "gguf-q8"):  # an explicit mode is kept (and checked at load)
        assert resolve_quantization(given, Path(path), torch.device(device), dtype) == given


def test_the_default_is_auto_and_the_runner_says_what_it_resolved_to():
    from gpu.model_runner import ModelRunnerConfig

    assert ServerArgs().quantization == ModelRunnerConfig().quantization == "auto"
    want = "gguf-q8" if cpu_kernels_available() else "none"
    assert runner("auto").quantization == want
