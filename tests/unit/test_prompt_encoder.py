"""runtime/http_worker/prompt_encoder.py against the tokenizer's own encode: the ASCII fast path on the real
SmolLM2 tokenizer, with an added BOS/EOS template, and the fallbacks."""

import json
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from runtime.http_worker.prompt_encoder import ASCII_SPLIT, PromptEncoder, _encode_with_regex, cached_encoder


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return PromptEncoder(tokenizer)


def variant(tokenizer, change) -> PreTrainedTokenizerFast:
    """The SmolLM2 tokenizer with its JSON spec edited by `change`."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    change(spec)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))


def reference(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return tokenizer.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<reponame>"]
# every ASCII character, and the pieces the split treats specially, often
ascii_text = st.lists(
    st.one_of(
        st.sampled_from([chr(c) for c in range(128)]),
        st.sampled_from(
            [
                "'s",
                "'t",
                "'re",
                "'ve",
                "'m",
                "'ll",
                "'d",
                "'S",
                "  ",
                "\n\n",
                " \n",
                "\t ",
                "123",
                " hello",
                "world",
                "!!",
                " ?",
            ]
            + SPECIALS
        ),
    ),
    max_size=40,
).map("".join)


def pieces_and_ids(encode, text: str, start: int, end: int, cache) -> tuple[list[tuple[int, int]], list[int]]:
    """Every miss `encode` reports on text[start:end] (each then cached, as the encoder does,
    with made-up ids) and the ids it appended."""
    misses, ids = [], []
    while (miss := encode(text, start, end, cache, ids)) is not None:
        misses.append(miss)
        cache[text[miss[0] : miss[1]]] = piece_ids = [miss[0], 1000 + miss[1]]
        ids += piece_ids
        start = miss[1]
    return misses, ids


@settings(max_examples=600, deadline=None)
@given(text=ascii_text, cut=st.tuples(st.integers(-2, 45), st.integers(-2, 45)), cached=st.integers(0, 3))
def test_c_encode_equals_the_regex(text, cut, cached):
    encode, table = cached_encoder()
    assert encode is not _encode_with_regex, "the C split was not built"
    start, end = max(cut[0], 0), min(max(cut[1], 0), len(text))
    spans = [m.span() for m in ASCII_SPLIT.finditer(text, start, end)]
    # some pieces cached already, with one id (kept in the table's slot) or more
    warm = {text[i:j]: [7] * (1 + (j - i) % 3) for i, j in spans[::2]} if cached else {}
    cache = table()
    for piece, piece_ids in warm.items():
        cache[piece] = piece_ids
    misses, ids = pieces_and_ids(encode, text, start, end, cache)
    assert (misses, ids) == pieces_and_ids(_encode_with_regex, text, start, end, dict(warm))
    assert ids == [t for i, j in spans for t in cache[text[i:j]]]  # every piece's ids, in order


def test_piece_table_is_a_mapping_of_ascii_pieces():
    _, table = cached_encoder()
    pieces = table()
    want = {f" w{i}" + "x" * (i % 40): list(range(i % 5 + 1)) for i in range(5000)}  # grows; keys past 16 bytes
    for piece, piece_ids in want.items():
        pieces[piece] = piece_ids
    pieces[" w0"] = want[" w0"] = [2**32 - 1]  # replaced
    pieces["\x04"] = want["\x04"] = []  # BPE drops a byte its vocabulary lacks
    assert len(pieces) == len(want) and all(pieces[k] == v for k, v in want.items())
    assert " w0" in pieces and " w0 " not in pieces and "" not in pieces and "é" not in pieces
    with pytest.raises(KeyError):
        pieces[" missing"]
    for key, value, error in (
        ("é", [1], KeyError),
        ("", [1], KeyError),
        ("a", [-1], OverflowError),
        ("a", [2**32], OverflowError),
        ("a", 5, TypeError),
        ("a", [0] * 65536, ValueError),
    ):
        with pytest.raises(error):
            pieces[key] = value
    pieces.clear()
    assert len(pieces) == 0 and " w1" not in pieces


@pytest.mark.parametrize("text", ["x" * 300 + " hi", " " + "7" * 1000, "a" * 70000])
def test_pieces_too_long_to_cache(tokenizer, encoder, text):
    for _ in range(2):
        assert encoder.encode(text, False) == reference(tokenizer, text, False)


def test_default_model_takes_the_fast_path(encoder):
    assert encoder.fast


@settings(max_examples=400, deadline=None)
@given(text=ascii_text, add_special_tokens=st.booleans())
def test_ascii_equals_the_tokenizer(tokenizer, encoder, text, add_special_tokens):
    assert encoder.encode(text, add_special_tokens) == reference(tokenizer, text, add_special_tokens)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=30))
def test_any_text_equals_the_tokenizer(tokenizer, encoder, text):
    assert encoder.encode(text, False) == reference(tokenizer, text, False)


def test_chat_prompt_and_the_piece_cache(tokenizer, encoder):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three " + string.ascii_letters}], add_generation_prompt=True, tokenize=False
    )
    want = reference(tokenizer, text, False)
    assert encoder.encode(text, False) == want
    assert encoder.encode(text, False) == want  # now from the cache


def test_bos_and_eos_template(tokenizer):
    def wrap(spec):
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            ],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {
                "<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]},
                "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]},
            },
        }

    wrapped = variant(tokenizer, wrap)
    enc = PromptEncoder(wrapped)
    assert enc.fast
    for text in ("Hello there", "", "<|im_end|> x"):
        assert enc.encode(text, True) == reference(wrapped, text, True)
        assert enc.encode(text, False) == reference(wrapped, text, False)
    assert enc.encode("Hi", True)[0] == 1 and enc.encode("Hi", True)[-1] == 0


@pytest.mark.parametrize(
    "change",
    [
        lambda spec: spec["pre_tokenizer"].update(add_prefix_space=True),
        lambda spec: spec.update(normalizer={"type": "Lowercase"}),
        lambda spec: spec["added_tokens"][1].update(lstrip=True),
    ],
    ids=["prefix-space", "normalizer", "lstrip"],
)
def test_other_tokenizers_fall_back(tokenizer, change):
    other = variant(tokenizer, change)
    enc = PromptEncoder(other)
    assert not enc.fast
    for text in ("Hello World", " <|im_start|> user"):
        assert enc.encode(text, False) == reference(other, text, False)
