"""A GGUF model's directory (gpu/models/model_files.py): config.json made from the file's
metadata equals what the conversion through transformers wrote (the config of transformers'
model of the GGUF, with the hyperparameters transformers misses set from the file), field by
field; the tokenizer files are AutoTokenizer's; the directory holds no weights, is made once,
and names the file in gguf.json."""

import dataclasses
import json

import gguf
import pytest
import torch
from test_gpu_model_families import SMALL
from test_gpu_model_families_gguf import ARCH, FAMILIES, tiny_model, write_gguf

from gpu.models.model_config import ModelConfig
from gpu.models.model_files import default_model_path, resolve_model_dir

pytestmark = pytest.mark.torch_threads(2)

# what transformers' GGUF loader leaves at its class defaults, set from the file as the
# conversion set it (model_files._fix_config): held to the original model's config
FIXED = ("head_dim", "attn_logit_softcapping", "final_logit_softcapping", "rope_parameters")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "ringserve" / "gguf"


def converted_config(path, architecture: str) -> dict:
    """config.json as the conversion wrote it, before its fixes: transformers' config of the
    GGUF, written for the model class it loaded."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    config.pop("_name_or_path")
    return json.loads(json.dumps({**config, "architectures": [architecture], "dtype": "float32"}))  # as written


@pytest.mark.parametrize("family", FAMILIES)
def test_config_equals_the_conversions(family, tmp_path, cache):
    model = tiny_model(family)
    path = tmp_path / f"tiny-{family}.gguf"
    write_gguf(family, model, path)
    model_dir = resolve_model_dir(path)
    got = json.loads((model_dir / "config.json").read_text())
    converted, original = converted_config(path, type(model).__name__), model.config.to_dict()
    for key in sorted(set(got) | set(converted)):
        if key in FIXED and key in original:
            assert got.get(key) == original[key], key
        else:
            assert got.get(key, "missing") == converted.get(key, "missing"), key
    assert not any(model_dir.glob("*.safetensors"))


def test_default_model_directory(cache):
    """The embedded SmolLM2 (llama): config.json as transformers' conversion wrote it, tokenizer
    files as AutoTokenizer writes them, gguf.json naming the file; made once."""
    from transformers import AutoTokenizer

    path = default_model_path()
    model_dir = resolve_model_dir(None)
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "gguf.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((model_dir / "gguf.json").read_text()) == {"gguf": str(path.resolve())}
    got = json.loads((model_dir / "config.json").read_text())
    assert got == converted_config(path, "LlamaForCausalLM")
    assert json.loads((model_dir / "generation_config.json").read_text()) == {
        "pad_token_id": 2,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    expected = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    expected.save_pretrained(cache.parent / "expected")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (model_dir / name).read_bytes() == (cache.parent / "expected" / name).read_bytes(), name
    config = ModelConfig.from_dir(model_dir)
    assert config.gguf_path == path.resolve() and config.architecture == "LlamaForCausalLM"
    assert resolve_model_dir(model_dir) == model_dir  # the directory itself is a model path too
    made = (model_dir / "config.json").stat().st_mtime_ns
    assert resolve_model_dir(None) == model_dir and (model_dir / "config.json").stat().st_mtime_ns == made
    assert [p.name for p in cache.iterdir()] == [model_dir.name]  # no temporary directory left


def test_smollm3_from_its_metadata(tmp_path, cache, monkeypatch):
    """SmolLM3, which transformers' GGUF loader cannot read: llama.cpp's keys (its converter's
    SmolLM3Model is a LlamaModel) give the model ModelConfig reads from the original config,
    its every fourth layer without rope as llama.cpp fixes it."""
    from transformers import AutoModelForCausalLM, SmolLM3Config

    monkeypatch.setitem(ARCH, "smollm3", gguf.MODEL_ARCH.SMOLLM3)
    config = SmolLM3Config(
        **dict(SMALL, num_hidden_layers=4), rms_norm_eps=2.0**-20, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )  # an eps float32 holds: GGUF stores it so
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path / "hf")
    write_gguf("smollm3", model, tmp_path / "tiny.gguf")
    got = ModelConfig.from_dir(resolve_model_dir(tmp_path / "tiny.gguf"))
    want = ModelConfig.from_dir(tmp_path / "hf")
    assert got.rope_layers == (True, True, True, False)
    assert dataclasses.replace(got, model_dir=want.model_dir, gguf_path=None) == want
