"""runtime/tokenizer_load.py: the class it loads is AutoTokenizer's for every model type
ringserve serves, whatever tokenizer_config.json names and whether tokenizer.json is
byte-level; its tables are transformers'; the default model's tokenizer gives AutoTokenizer's
ids, text and chat prompt; and loading it, as the HTTP worker and the detokenizer do, imports
no torch."""

from __future__ import annotations

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


def test_default_model_tokenizer_is_autotokenizers(tokenizer):
    from gpu.models.model_files import resolve_model_dir

    ours = load_tokenizer(resolve_model_dir(None))
    assert type(ours) is type(tokenizer)
    text = "Hello, world!  Ünïcödé, digits 12345, <|im_start|> and\ttabs\n"
    ids = tokenizer.encode(text)
    assert ours.encode(text) == ids
    assert ours.decode(ids) == tokenizer.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )


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
