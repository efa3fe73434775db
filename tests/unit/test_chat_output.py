"""A chat choice's text -> message fields, whole and streamed: reasoning, content and tool calls
(parsed, or forced by a grammar), and a stream's deltas adding up to the whole answer
whatever the split."""

from __future__ import annotations

import json
import random

import pytest

from httpapi.chat_output import ChatDeltas, ChatOutput, chat_message
from structured.reasoning import make_reasoning_parser
from structured.tool_parsers import call_id, make_parser
from structured.tools import parse_tool_choice, parse_tools

TOOLS = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        },
        {"type": "function", "function": {"name": "get_time"}},
    ]
)
NAMES = [t.name for t in TOOLS]


def outputs() -> dict[str, ChatOutput]:
    hermes = make_parser("hermes", NAMES)
    return {
        "plain": ChatOutput("chatcmpl-1"),
        "reasoning": ChatOutput("chatcmpl-1", reasoning=make_reasoning_parser("qwen3")),
        "auto": ChatOutput("chatcmpl-1", tool_parser=hermes, tools=TOOLS),
        "auto, one call": ChatOutput("chatcmpl-1", tool_parser=hermes, tools=TOOLS, max_calls=1),
        "reasoning+auto": ChatOutput(
            "chatcmpl-1", reasoning=make_reasoning_parser("deepseek-r1"), tool_parser=hermes, tools=TOOLS
        ),
        "required": ChatOutput("chatcmpl-1", tools=TOOLS, forced=parse_tool_choice("required", TOOLS)),
        "named": ChatOutput(
            "chatcmpl-1",
            tools=TOOLS,
            forced=parse_tool_choice({"type": "function", "function": {"name": "get_weather"}}, TOOLS),
        ),
    }


TEXTS = {
    "plain": ["Hello there, é🙂!", ""],
    "reasoning": ["<think>\nLet me think.\n</think>\n\nThe answer is 4.", "No thinking here."],
    "auto": [
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>',
        "Just text, no <tool_ call.",
        '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>',
    ],
    "auto, one call": [
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    ],
    "reasoning+auto": [
        'I should look it up.</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    ],
    "required": ['[{"name":"get_weather","parameters":{"city":"Oslo"}},{"name":"get_time","parameters":{}}]'],
    "named": ['{"city":"Lima"}'],
}
CASES = [(kind, text) for kind, texts in TEXTS.items() for text in texts]


def streamed(out: ChatOutput, pieces: list[str], finish: str) -> tuple[dict, str | None]:
    """The message a stream's deltas add up to, as a client assembles it."""
    deltas = ChatDeltas(out)
    events = [d for piece in pieces for d in deltas.feed(piece)]
    tail, reason = deltas.finish(finish)
    content, reasoning, calls = None, None, {}
    for d in events + tail:
        if "reasoning_content" in d:  # under both names, vLLM's newer beside the older
            assert d == {"reasoning_content": d["reasoning"], "reasoning": d["reasoning"]} and d["reasoning"]
            reasoning = (reasoning or "") + d["reasoning_content"]
            continue
        assert len(d) == 1 and next(iter(d.values())) not in ("", [])
        if "content" in d:
            content = (content or "") + d["content"]
        else:
            (call,) = d["tool_calls"]
            if "id" in call:  # the head: index, id, type, name first
                assert call["index"] == len(calls) and call["function"]["arguments"] == ""
                calls[call["index"]] = {"id": call["id"], "type": "function", "function": dict(call["function"])}
            else:
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    message = {"role": "assistant", "content": content if content or not calls else None}
    if out.reasoning is not None and (reasoning is not None or content is not None or calls):
        message["reasoning_content"] = message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, reason


def normalized(message: dict) -> dict:
    """A whole answer as a stream can tell it: no content is no content, whether "" or None."""
    out = dict(message)
    if out.get("content") == "":
        out["content"] = None if "tool_calls" in out else ""
    return out


@pytest.mark.parametrize(("kind", "text"), CASES)
def test_a_stream_split_anywhere_adds_up_to_the_whole_answer(kind, text):
    out = outputs()[kind]
    whole, reason = chat_message(text, "stop", out)
    whole = normalized(whole)
    rng = random.Random(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    for pieces in splits:
        got, got_reason = streamed(out, pieces, "stop")
        if whole.get("reasoning_content") is None:
            got.pop("reasoning_content", None)
        assert got_reason == reason, pieces
        assert {k: v for k, v in got.items() if v not in ("", None)} == {
            k: v for k, v in whole.items() if v not in ("", None)
        }, pieces


def test_parsed_calls_make_tool_calls_with_stable_ids_and_finish_tool_calls():
    text = TEXTS["auto"][1]
    message, reason = chat_message(text, "stop", outputs()["auto"])
    assert reason == "tool_calls" and message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time", "get_weather"]
    assert [c["id"] for c in message["tool_calls"]] == [call_id("chatcmpl-1", 0), call_id("chatcmpl-1", 1)]
    assert json.loads(message["tool_calls"][1]["function"]["arguments"]) == {"city": "Zürich"}
    # a choice cut by max_tokens keeps "length", calls or not
    assert chat_message(text, "length", outputs()["auto"])[1] == "length"


def test_parallel_tool_calls_false_keeps_the_first_call():
    message, reason = chat_message(TEXTS["auto, one call"][0], "stop", outputs()["auto, one call"])
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"] and reason == "tool_calls"


def test_forced_calls_are_read_from_the_grammars_json():
    message, reason = chat_message(TEXTS["required"][0], "stop", outputs()["required"])
    assert reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    message, reason = chat_message('{"city":"Lima"}', "stop", outputs()["named"])
    assert reason == "tool_calls" and message["tool_calls"][0]["function"]["arguments"] == '{"city":"Lima"}'


def test_forced_json_cut_short_is_never_content():
    """A forced answer cut by max_tokens keeps the calls that were complete, as OpenAI answers;
    its stream has sent the cut call's head and arguments so far, and finish_reason "length"."""
    message, reason = chat_message('[{"na', "length", outputs()["required"])
    assert message == {"role": "assistant", "content": ""} and reason == "length"
    cut = '[{"name":"get_time","parameters":{}},{"name":"get_weather","parameters":{"city":"Os'
    message, reason = chat_message(cut, "length", outputs()["required"])
    assert message["content"] is None and reason == "length"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("get_time", "{}")]
    sent, reason = streamed(outputs()["required"], [cut[:20], cut[20:]], "length")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in sent["tool_calls"]] == [
        ("get_time", "{}"),
        ("get_weather", '{"city":"Os'),
    ]
    assert reason == "length" and not sent["content"]


def test_reasoning_goes_to_reasoning_content():
    message, _ = chat_message(TEXTS["reasoning"][0], "stop", outputs()["reasoning"])
    assert message["reasoning_content"] == "Let me think." and message["content"] == "The answer is 4."
    assert message["reasoning"] == message["reasoning_content"]  # vLLM's newer name
    message, _ = chat_message("I pondered.</think>The end.", "stop", outputs()["reasoning+auto"])
    assert message["reasoning_content"] == "I pondered." and message["content"] == "The end."
    assert "tool_calls" not in message


def test_plain_output_is_content_only():
    assert chat_message("hi", "stop", outputs()["plain"]) == ({"role": "assistant", "content": "hi"}, "stop")
    assert outputs()["plain"].plain and not outputs()["auto"].plain


def test_include_reasoning_false_drops_the_reasoning_whole_and_streamed():
    """vLLM's include_reasoning: false: the reasoning is still parsed out of the content, then dropped."""
    out = ChatOutput("chatcmpl-1", reasoning=make_reasoning_parser("qwen3"), include_reasoning=False)
    text = TEXTS["reasoning"][0]
    message, _ = chat_message(text, "stop", out)
    assert message == {"role": "assistant", "content": "The answer is 4."}
    deltas = ChatDeltas(out)
    events = [d for ch in text for d in deltas.feed(ch)] + deltas.finish("stop")[0]
    assert all(set(d) == {"content"} for d in events)
    assert "".join(d["content"] for d in events) == "The answer is 4."
