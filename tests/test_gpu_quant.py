"""--quantization gguf: the embedded model's Q4_1 / Q8_0 blocks, kept quantized, dequantize
to exactly the fp32 weights the GGUF converter writes; the AVX2 kernel's products equal fp32
ones up to summation order for every shape of token tile; the executor on them gives the
fp32 executor's greedy tokens; a model that is not a GGUF file is refused in one line."""
from __future__ import annotations

import pytest
import torch

from gpu.kernels import cpu_kernels_available
from gpu.model_config import ModelConfig
from gpu.model_files import ModelLoadError, default_model_path, resolve_model_dir
from gpu.quant import load_quantized
from gpu.weights import load_weights
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernels_available(),
                                reason="the GGUF kernels need an AVX2 CPU and a C compiler")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:"]


@pytest.fixture(scope="module")
def weights():
    cfg = ModelConfig.from_dir(resolve_model_dir(None))
    return load_quantized(default_model_path(), cfg), load_weights(cfg, torch.float32, torch.device("cpu"))


def test_blocks_dequantize_to_the_converted_fp32_weights(weights):
    quantized, fp32 = weights
    assert quantized["layers.0.qkv"].kind == "Q4_1" and quantized["lm_head"].kind == "Q8_0"
    for name, w in quantized.items():
        # q and k rows come back in transformers' order (llama.cpp's rotary permutation undone)
        assert torch.equal(w.dequantize(), fp32.get(name, fp32["embed"])), name


@pytest.mark.parametrize("tokens", [1, 3, 8, 9, 33])
@pytest.mark.parametrize("name", ["layers.3.qkv", "layers.3.down", "lm_head"])
def test_kernel_products_equal_fp32_ones(weights, tokens, name):
    quantized, fp32 = weights
    w = fp32.get(name, fp32["embed"])
    x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(tokens))
    want = (x.double() @ w.double().T).float()
    got = quantized[name].matmul(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("name", ["layers.0.gate_up", "lm_head"])
def test_kernel_reads_exactly_the_fp32_weights(weights, name):
    """One-hot inputs pick single weights out of the kernel: each equals the converted fp32
    weight bit for bit (d * q is exact in fp32: an fp16 scale times a 4- or 8-bit integer)."""
    quantized, fp32 = weights
    w = fp32.get(name, fp32["embed"])
    cols = torch.arange(0, w.shape[1], 37)
    x = torch.zeros(len(cols), w.shape[1])
    x[torch.arange(len(cols)), cols] = 1.0
    assert torch.equal(quantized[name].matmul(x), w[:, cols].T.contiguous())


def test_greedy_tokens_equal_the_fp32_executor(offline_engine):
    from runtime.engine import Engine

    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    engine = Engine(quantization="gguf", max_total_tokens=2048, max_running_requests=4)
    want = offline_engine.generate(PROMPTS, params)
    got = engine.generate(PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_a_model_that_is_not_gguf_is_refused():
    from gpu.model_runner import ModelRunner, ModelRunnerConfig

    with pytest.raises(ModelLoadError, match="needs a .gguf model"):
        ModelRunner(ModelRunnerConfig(model_path=str(resolve_model_dir(None)), quantization="gguf",
                                      max_total_tokens=256, max_running_requests=1))
