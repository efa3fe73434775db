"""The model's tokenizer as AutoTokenizer loads it, without torch: the HTTP workers and the
detokenizer need a tokenizer, not the model, yet AutoTokenizer's module imports torch through
transformers' model configs (a few hundred MB in each process). The tokenizer classes
themselves do not: load_tokenizer picks the class AutoTokenizer would pick for a local model
directory of the families ringserve serves and loads it directly, so its tokens, decoded text
and chat template are AutoTokenizer's (tests/unit/test_tokenizer_load.py compares the two)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# AutoTokenizer's registered class of each model type ringserve serves (transformers'
# TOKENIZER_MAPPING_NAMES), and those whose tokenizer_config.json's class it overrides
# (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS); tests/unit/test_tokenizer_load.py checks both
REGISTERED_CLASSES: dict[str, str | None] = {
    "llama": None,
    "mistral": "TokenizersBackend",
    "qwen2": "Qwen2Tokenizer",
    "qwen3": "Qwen2Tokenizer",
    "phi3": "TokenizersBackend",
    "gemma2": "GemmaTokenizer",
    "gemma3": "GemmaTokenizer",
    "gemma3_text": "GemmaTokenizer",
    "smollm3": None,
}
HUB_CLASS_OVERRIDDEN = frozenset({"phi3", "qwen2"})
GENERIC_CLASSES = frozenset({"TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(path: str | os.PathLike) -> Any:
    """The tokenizer of the model directory `path` (or of a tokenizer directory: --tokenizer-path)."""
    return tokenizer_class(Path(path)).from_pretrained(str(path))


def tokenizer_class(path: Path) -> type[Any]:
    """The class AutoTokenizer.from_pretrained(path) instantiates, following its choice
    (transformers/models/auto/tokenization_auto.py) for a local directory without remote code."""
    from transformers import TokenizersBackend

    tokenizer_config, config = _read_json(path / "tokenizer_config.json"), _read_json(path / "config.json")
    model_type = config.get("model_type")
    registered = REGISTERED_CLASSES.get(model_type) if isinstance(model_type, str) else None
    hub = tokenizer_config.get("tokenizer_class") or config.get("tokenizer_class")
    if not isinstance(hub, str):
        return _class_named(registered) or TokenizersBackend
    hub = hub.removesuffix("Fast")
    # LlamaTokenizer builds a Metaspace tokenizer: a byte-level tokenizer.json that names it
    # (Llama 3 style) is loaded as it is
    if hub == "LlamaTokenizer" and model_type not in HUB_CLASS_OVERRIDDEN and _byte_level(path):
        return TokenizersBackend
    if registered is not None and registered != hub:
        if registered not in GENERIC_CLASSES:
            chosen = _class_named(registered if model_type in HUB_CLASS_OVERRIDDEN else hub)
            if chosen is not None and chosen.__name__ not in GENERIC_CLASSES:
                return chosen
        return TokenizersBackend
    return _class_named(hub) or TokenizersBackend


def _class_named(name: str | None) -> type[Any] | None:
    """transformers' tokenizer class of that name (its module imported alone), or its Fast
    alias; the Python backend's name gives the Rust one, as AutoTokenizer does."""
    import transformers

    if name is None:
        return None
    for candidate in (name, name + "Fast"):
        try:
            cls = getattr(transformers, candidate)
        except (AttributeError, ImportError):
            continue
        if isinstance(cls, type):
            return transformers.TokenizersBackend if cls.__name__ == "PythonBackend" else cls
    return None


def _byte_level(path: Path) -> bool:
    """AutoTokenizer's test (TokenizersBackend._tokenizer_json_has_byte_level)."""
    try:
        return '"ByteLevel"' in (path / "tokenizer.json").read_text(encoding="utf-8")
    except OSError:
        return False


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
