"""Reasoning parsers on recorded model texts: the whole split into reasoning and content, and
that a stream of the same text, split anywhere, sends the same two texts."""

from __future__ import annotations

import random

import pytest

from structured.reasoning import REASONING_PARSERS, StripStream, make_reasoning_parser


def streamed(parser_name: str, pieces: list[str]) -> tuple[str | None, str]:
    stream = make_reasoning_parser(parser_name).stream()
    reasoning = content = ""
    for piece in [*pieces, None]:
        r, c = stream.finish() if piece is None else stream.feed(piece)
        reasoning += r
        content += c
    return (reasoning if stream.has_reasoning else None), content


def assert_stream_agrees(parser_name: str, text: str) -> tuple[str | None, str]:
    whole = make_reasoning_parser(parser_name).parse(text)
    for offset in range(len(text) + 1):
        assert streamed(parser_name, [text[:offset], text[offset:]]) == whole, offset
    assert streamed(parser_name, list(text)) == whole
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 8))))
        assert streamed(parser_name, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]) == whole
    return whole


R1_THOUGHT = "Okay, the user asks for 17 × 23. 17 × 20 = 340, 17 × 3 = 51, so 391."

DEEPSEEK_R1_CASES = [
    # DeepSeek-R1: the template opened <think>, the output starts inside the reasoning
    (f"{R1_THOUGHT}\n</think>\n\n17 × 23 = **391**.", R1_THOUGHT, "17 × 23 = **391**."),
    # R1-0528 writes the <think> itself
    (f"<think>\n{R1_THOUGHT}\n</think>\n\n391", R1_THOUGHT, "391"),
    ("  <think>x</think>y", "x", "y"),
    # never closed (max_tokens): all reasoning
    ("Let me think about Привет and 你好 step by step...", "Let me think about Привет and 你好 step by step...", ""),
    ("<think>\nhmm", "hmm", ""),
    # empty reasoning, empty content
    ("</think>\n\nThe answer.", "", "The answer."),
    ("<think></think>", "", ""),
    ("", "", ""),
    # only the first </think> closes; a later one is content, a later <think> is reasoning
    ("a <think> b </think> c </think> d", "a <think> b", "c </think> d"),
    # partial tags that are not tags
    ("I use </thin and <thi> here</think>ok", "I use </thin and <thi> here", "ok"),
    ("<thin", "<thin", ""),
]

QWEN3_CASES = [
    (
        "<think>\nThe user greets me. Reply kindly.\n</think>\n\nHello! 👋",
        "The user greets me. Reply kindly.",
        "Hello! 👋",
    ),
    ("\n<think>x</think>\n\n  answer  \n", "x", "answer"),
    ("<think>\n\n</think>\n\nNo reasoning (enable_thinking=False).", "", "No reasoning (enable_thinking=False)."),
    ("<think>cut off in the middle", "cut off in the middle", ""),
]

QWEN3_CONTENT_ONLY = [
    "Hello! How can I help?",
    "  spaced out  \n",
    "The tag <think> later is not reasoning</think>.",
    "<thi",
    "<",
    "",
]


@pytest.mark.parametrize(("text", "reasoning", "content"), DEEPSEEK_R1_CASES)
def test_deepseek_r1(text: str, reasoning: str, content: str) -> None:
    assert assert_stream_agrees("deepseek-r1", text) == (reasoning, content)


@pytest.mark.parametrize(("text", "reasoning", "content"), QWEN3_CASES)
def test_qwen3_with_reasoning(text: str, reasoning: str, content: str) -> None:
    assert assert_stream_agrees("qwen3", text) == (reasoning, content)


@pytest.mark.parametrize("text", QWEN3_CONTENT_ONLY)
def test_qwen3_without_think_is_content_as_is(text: str) -> None:
    assert assert_stream_agrees("qwen3", text) == (None, text)


def test_end_tag_split_across_deltas() -> None:
    stream = make_reasoning_parser("deepseek-r1").stream()
    assert stream.feed("<think>Weighing options") == ("Weighing options", "")
    assert stream.feed(" carefully.</th") == (" carefully.", "")
    assert stream.feed("ink") == ("", "")
    assert stream.feed(">\n\nUse the") == ("", "Use the")
    assert stream.feed(" second. ") == ("", " second.")
    assert stream.finish() == ("", "")


def test_qwen3_decides_at_the_first_non_space() -> None:
    stream = make_reasoning_parser("qwen3").stream()
    assert stream.feed("\n") == ("", "")
    assert stream.feed("<th") == ("", "")
    assert stream.feed("e") == ("", "\n<the")
    assert stream.feed(" end") == ("", " end")
    assert stream.has_reasoning is False


def test_strip_stream_adds_up_to_strip() -> None:
    pieces = ["  ", "\n a", " b ", "\t", "", "c  ", " "]
    stream = StripStream()
    assert "".join(stream.push(p) for p in pieces) == "".join(pieces).strip()


def test_parser_names() -> None:
    assert {"deepseek-r1", "qwen3"} <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match="known: deepseek-r1"):
        make_reasoning_parser("o1")


@pytest.mark.parametrize("parser_name", sorted(REASONING_PARSERS))
def test_stream_agrees_on_fragment_soup(parser_name: str) -> None:
    fragments = ["<think>", "</think>", "<thi", "</th", "<", ">", " ", "\n", "word", "ü"]
    rng = random.Random(parser_name)
    for _ in range(400):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 10)))
        whole = make_reasoning_parser(parser_name).parse(text)
        for _ in range(5):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
            assert streamed(parser_name, [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]) == whole
