"""The model's tokenizer as AutoTokenizer loads it, without torch: the HTTP workers and the
detokenizer need a tokenizer, not the model, yet AutoTokenizer's module imports torch through
transformers' model configs (a few hundred MB in each process). The tokenizer classes
themselves do not: load_tokenizer picks the class AutoTokenizer would pick for a local model
directory of the families ringserve serves and loads it directly, so its tokens, decoded text
and chat template are AutoTokenizer's (tests/unit/test_tokenizer_load.py compares the two).

Building the tokenizer is the costly part of a start for a large vocabulary: transformers
json-loads tokenizer.json and rebuilds the BPE from its vocab and merges in Python (Gemma 3's
262k tokens: 2-3 CPU s, in the HTTP worker and the detokenizer at once). The object built is
pickled under the cache directory, keyed by the bytes of the directory's tokenizer files and
the versions that built it (without the Python copies of the vocabulary and merges its class
built the Rust tokenizer from); a later start unpickles it, about half the work (the Rust
tokenizer is rebuilt from its own serialization). The cache directory is trusted as the C
kernels built there are: what it holds is loaded and run."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

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


# files of a model directory that are not the tokenizer's (weights): left out of the cache key
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack", ".onnx"})
CACHE_FORMAT = b"ringserve tokenizer pickle 2"
BUILD_INPUTS = ("_vocab", "_merges")  # transformers' classes read them in __init__ alone


def load_tokenizer(path: str | os.PathLike, decode_only: bool = False) -> Any:
    """The tokenizer of the model directory `path` (or of a tokenizer directory: --tokenizer-path),
    from the cache when a start before made it from the same files. `decode_only` (the
    detokenizer): the same tokenizer without a BPE's merges, which only encoding uses (its
    decode is the whole tokenizer's; its encode is wrong): Gemma 3's 515k merges are ~250 MB
    of each process that holds them and most of the load's CPU."""
    path = Path(path)
    cls = tokenizer_class(path)
    cached = _cache_file(path, cls, decode_only)
    try:
        with cached.open("rb") as f:
            tokenizer = pickle.load(f)
        if type(tokenizer) is cls:
            tokenizer.name_or_path = str(path)  # the key is the files' bytes, not where they are
            return tokenizer
    except FileNotFoundError:
        pass
    except Exception as e:  # a damaged or foreign file: built again, and replaced
        logger.warning("cached tokenizer %s unreadable (%s: %s): building it again", cached, type(e).__name__, e)
    if decode_only:
        tokenizer = load_tokenizer(path)
        tokenizer._tokenizer = _without_merges(tokenizer.backend_tokenizer)
    else:
        tokenizer = cls.from_pretrained(str(path))
        # what the class's __init__ built the Rust tokenizer from, as Python objects kept on the
        # instance and never read again (Gemma 3's: ~150 MB, and most of the pickle)
        for name in BUILD_INPUTS:
            tokenizer.__dict__.pop(name, None)
    _store(tokenizer, cached)
    return tokenizer


def _without_merges(backend: Any) -> Any:
    """A copy of the Rust tokenizer whose BPE model has no merges: ids map to the same tokens,
    through the same decoder and added tokens."""
    from tokenizers import Tokenizer

    state = json.loads(backend.to_str())
    if state["model"].get("type") != "BPE":
        return backend
    state["model"]["merges"] = []
    return Tokenizer.from_str(json.dumps(state))


def _cache_file(path: Path, cls: type[Any], decode_only: bool) -> Path:
    """Where the tokenizer of `path` built by `cls` is cached: named by the hash of every
    file of the directory but its weights (the tokenizer's files, config.json, the chat
    template) and the versions of Python, transformers and tokenizers (not by the directory:
    a test's temporary copies of one tokenizer share its entry)."""
    import tokenizers
    import transformers

    from cbuild import cache_root

    h = hashlib.sha256(CACHE_FORMAT)
    versions = (sys.version, transformers.__version__, tokenizers.__version__, cls.__module__, cls.__qualname__)
    h.update(b"decode only\0" if decode_only else b"whole\0")
    h.update("\0".join(versions).encode())
    for file in sorted(path.iterdir()):
        if file.suffix in WEIGHT_SUFFIXES or not file.is_file():
            continue
        h.update(f"\0{file.name}\0".encode())
        h.update(hashlib.sha256(file.read_bytes()).digest())
    return cache_root() / "tokenizers" / f"{h.hexdigest()[:32]}.pickle"


def _store(tokenizer: Any, target: Path) -> None:
    """Writes the pickle whole or not at all (concurrent starts each write their own and
    rename it); a cache that cannot be written only costs the next start the build."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tokenizer-", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(tokenizer, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
        logger.warning("tokenizer not cached in %s: %s", target.parent, e)


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
