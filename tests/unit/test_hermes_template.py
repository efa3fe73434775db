"""structured/templates/hermes.jinja with the default model's tokenizer: without tools it must
render exactly what SmolLM2's own template does; with tools it lists them, and renders calls
and their results, as Qwen2.5's template does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import structured
from structured.tool_parsers import ToolCall, make_parser

TEMPLATE = (Path(structured.__file__).parent / "templates" / "hermes.jinja").read_text()


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, generation_prompt: bool = True) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=generation_prompt
    )


SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [SYSTEM, {"role": "user", "content": "Hi!"}],
    [SYSTEM],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [SYSTEM, {"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}],
    [
        {"role": "user", "content": "Translate 'hello' to Japanese and Greek."},
        {"role": "assistant", "content": "こんにちは / Γειά σου 👋"},
        {"role": "user", "content": "And to Russian?"},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "  leading and trailing spaces \n\n"}],
    [{"role": "user", "content": "a"}, {"role": "system", "content": "A system turn later on."}],
    [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "Then me."}],
    [SYSTEM, {"role": "user", "content": "{{ not jinja }} <|im_start|> {% raw %}"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "Empty system prompt."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_without_tools_renders_as_smollm2(tokenizer, messages: list[dict], generation_prompt: bool) -> None:
    own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert render(tokenizer, messages, generation_prompt=generation_prompt) == own


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SEARCH = {"type": "function", "function": {"name": "search_web", "parameters": {"type": "object", "properties": {}}}}
INSTRUCTIONS = (
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def tools_block(tools: list[dict]) -> str:
    listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return f"<tools>{listed}\n</tools>\n\n"


def test_tools_are_listed_in_the_system_turn(tokenizer) -> None:
    text = render(tokenizer, [{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, SEARCH])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face")
    assert tools_block([WEATHER, SEARCH]) + INSTRUCTIONS in text
    assert text.endswith("<|im_start|>user\nWeather in Oslo?<|im_end|>\n<|im_start|>assistant\n")
    assert text.count("<|im_start|>system") == 1


def test_tools_follow_the_requests_system_prompt(tokenizer) -> None:
    text = render(tokenizer, [SYSTEM, {"role": "user", "content": "Hi"}], tools=[WEATHER])
    assert text.startswith(f"<|im_start|>system\n{SYSTEM['content']}\n\n# Tools\n\n")
    assert "SmolLM" not in text
    assert text.count("<|im_start|>system") == 1
    assert text.count(SYSTEM["content"]) == 1


def test_calls_and_results(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather in Zürich and Paris?"},
        {
            "role": "assistant",
            "content": "Checking both.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 12}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temp_c": 15}'},
        {"role": "assistant", "content": "Zürich 12°C, Paris 15°C."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "search_web", "arguments": {}}}]},
        {"role": "tool", "content": "no results"},
    ]
    text = render(tokenizer, messages, tools=[WEATHER, SEARCH])
    assert (
        "<|im_start|>assistant\nChecking both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n"
        '{"temp_c": 12}\n</tool_response>\n<tool_response>\n{"temp_c": 15}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\nZürich 12°C, Paris 15°C.<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "search_web", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nno results\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    ) in text


def test_rendered_calls_parse_back(tokenizer) -> None:
    """What the template shows the model as its own calls, the hermes parser reads as those calls."""
    messages = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "Sure.",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2]}}},
                {"function": {"name": "search_web", "arguments": "{}"}},
            ],
        },
    ]
    text = render(tokenizer, messages, tools=[WEATHER, SEARCH], generation_prompt=False)
    turn = text.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    parsed = make_parser("hermes", ["get_weather", "search_web"]).parse(turn)
    assert parsed.content == "Sure."
    assert parsed.calls == [ToolCall("get_weather", '{"city":"Zürich","days":[1,2]}'), ToolCall("search_web", "{}")]
