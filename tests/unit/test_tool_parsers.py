"""Tool-call parsers on recorded model texts: what the whole parse finds, and that a stream of
the same text, split anywhere, sends the same content and calls."""

from __future__ import annotations

import json
import random

import pytest

from structured.tool_parsers import (
    PARSERS,
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    ParsedCalls,
    ToolCall,
    call_id,
    make_parser,
)

TOOLS = ["get_weather", "search_web", "book_flight"]


def streamed(parser_name: str, pieces: list[str]) -> ParsedCalls:
    """The content and calls a stream's events add up to, checking the events' order on the way:
    a call's name comes before its arguments, and indices count up from 0."""
    stream = make_parser(parser_name, TOOLS).stream()
    events = [event for piece in pieces for event in stream.feed(piece)] + stream.finish()
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    content = ""
    for event in events:
        if isinstance(event, ContentDelta):
            assert event.text
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(names)
            names[event.index] = event.name
            arguments[event.index] = ""
        else:
            assert isinstance(event, ArgumentsDelta) and event.index in names
            arguments[event.index] += event.text
    return ParsedCalls(content, [ToolCall(names[i], arguments[i]) for i in sorted(names)])


def assert_stream_agrees(parser_name: str, text: str) -> ParsedCalls:
    """Every split into two pieces, every character alone, and random multi-splits."""
    whole = make_parser(parser_name, TOOLS).parse(text)
    for offset in range(len(text) + 1):
        assert streamed(parser_name, [text[:offset], text[offset:]]) == whole, offset
    assert streamed(parser_name, list(text)) == whole
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(parser_name, pieces) == whole, cuts
    return whole


def call(name: str, **arguments: object) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


HERMES_CASES = [
    (  # Qwen2.5's usual answer: a bare call
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "",
        [call("get_weather", city="Paris", unit="celsius")],
    ),
    (  # text first, two calls, unicode and nesting
        "Je vais vérifier la météo et chercher des vols.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "note": "☀️ 東京"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "book_flight", "arguments": {"route": {"from": "ZRH", "to": "NRT"}, '
        '"passengers": [{"name": "Ana", "age": 31}], "flexible": true, "budget": null}}\n</tool_call>',
        "Je vais vérifier la météo et chercher des vols.",
        [
            call("get_weather", city="Zürich", note="☀️ 東京"),
            call(
                "book_flight",
                route={"from": "ZRH", "to": "NRT"},
                passengers=[{"name": "Ana", "age": 31}],
                flexible=True,
                budget=None,
            ),
        ],
    ),
    (  # markers, braces and escapes inside strings are text
        '<tool_call>{"name": "search_web", "arguments": {"q": "what is </tool_call> or {\\"<tool_call>\\"}?"}}'
        "</tool_call>",
        "",
        [call("search_web", q='what is </tool_call> or {"<tool_call>"}?')],
    ),
    (  # text between and after calls is content too
        'First:\n<tool_call>\n{"name": "search_web", "arguments": {"q": "a"}}\n</tool_call>\nthen\n'
        '<tool_call>\n{"name": "search_web", "arguments": {"q": "b"}}\n</tool_call>\nDone.\n',
        "First:\n\nthen\n\nDone.",
        [call("search_web", q="a"), call("search_web", q="b")],
    ),
    (  # "parameters" for "arguments", arguments as a JSON string, and no arguments at all
        '<tool_call>{"name": "search_web", "parameters": {"q": "x"}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
        '<tool_call>{"name": "get_weather"}</tool_call>',
        "",
        [call("search_web", q="x"), call("get_weather", city="Oslo"), call("get_weather")],
    ),
    (  # cut off after the JSON (a stop string, max_tokens): the call was made
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n',
        "Checking.",
        [call("get_weather", city="Lima")],
    ),
    (  # numbers keep their value: big integers stay integers
        '<tool_call>{"name": "search_web", "arguments": {"id": 123456789012345678901234567890, "x": 1.5e3}}'
        "</tool_call>",
        "",
        [ToolCall("search_web", '{"id":123456789012345678901234567890,"x":1500.0}')],
    ),
]

HERMES_CONTENT_ONLY = [
    "Hello! How can I help you today?",
    "  The capital of France is Paris.  \n",
    "A <tool without call, and < or <tool_ca at the end <tool_ca",
    # an unknown tool stays as text
    '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',
    # malformed JSON
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",}}\n</tool_call>',
    '<tool_call>\n{"name": get_weather}\n</tool_call>',
    # never closed, or cut inside the JSON
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
    "<tool_call>",
    # the JSON is not an object, or the arguments are not one
    '<tool_call>["get_weather"]</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": [1, 2]}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {}, "parameters": {}}</tool_call>',
    # something else than the closer after the JSON
    '<tool_call>{"name": "get_weather", "arguments": {}} oops </tool_call>',
    # NaN and lone surrogates are not JSON a client can read
    '<tool_call>{"name": "get_weather", "arguments": {"x": NaN}}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"x": "\\ud800"}}</tool_call>',
    # brackets that cannot match, and nesting past the limit
    '<tool_call>{"name": "get_weather", "arguments": {]}</tool_call>',
    "<tool_call>" + "[" * 200 + "]" * 200 + "</tool_call>",
]


@pytest.mark.parametrize("parser_name", ["hermes", "qwen25"])
@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_calls(parser_name: str, text: str, content: str, calls: list[ToolCall]) -> None:
    assert assert_stream_agrees(parser_name, text) == ParsedCalls(content, calls)


@pytest.mark.parametrize("text", HERMES_CONTENT_ONLY)
def test_hermes_text_that_holds_no_call_is_content(text: str) -> None:
    assert assert_stream_agrees("hermes", text) == ParsedCalls(text.strip(), [])


def test_hermes_bad_block_then_good_one() -> None:
    """A block that fails is text up to its marker; a call after it is still found."""
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    good = '<tool_call>{"name": "search_web", "arguments": {"q": "x"}}</tool_call>'
    assert assert_stream_agrees("hermes", f"{bad}\n{good}") == ParsedCalls(bad, [call("search_web", q="x")])
    unclosed = '<tool_call>{"name": "get_weather", "arguments": {'
    assert assert_stream_agrees("hermes", unclosed + good) == ParsedCalls(unclosed, [call("search_web", q="x")])


def test_hermes_without_tools_finds_no_call() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    assert make_parser("hermes", []).parse(text) == ParsedCalls(text, [])


def test_stream_holds_back_a_marker_start_only() -> None:
    """Text is sent as soon as it cannot begin a marker; a partial marker waits."""
    stream = make_parser("hermes", TOOLS).stream()
    assert stream.feed("Let me look") == [ContentDelta("Let me look")]
    assert stream.feed(" that up <tool_") == [ContentDelta(" that up")]
    assert stream.feed("box>") == [ContentDelta(" <tool_box>")]
    assert stream.feed("\n<tool_call>\n{") == []
    assert stream.feed('"name": "search_web", "arguments": {"q": "x"}}\n</tool_call>') == [
        CallStart(0, "search_web"),
        ArgumentsDelta(0, '{"q":"x"}'),
    ]
    assert stream.finish() == []


LLAMA3_CASES = [
    (  # Llama 3.1/3.2 JSON tool calling: the answer is the call
        '{"name": "get_weather", "parameters": {"city": "San Francisco", "unit": "fahrenheit"}}',
        "",
        [call("get_weather", city="San Francisco", unit="fahrenheit")],
    ),
    (
        '<|python_tag|>{"name": "search_web", "parameters": {"q": "llama 3.2 release date"}}',
        "",
        [call("search_web", q="llama 3.2 release date")],
    ),
    (  # several, joined by ";", "arguments" as well as "parameters", and a "type" key
        '<|python_tag|>{"type": "function", "name": "get_weather", "parameters": {"city": "Köln"}}; '
        '{"name": "search_web", "arguments": {"q": "Dom"}};{"name": "book_flight", "parameters": {}}',
        "",
        [call("get_weather", city="Köln"), call("search_web", q="Dom"), call("book_flight")],
    ),
    (  # text before the tag is content
        'I will look it up.<|python_tag|>{"name": "search_web", "parameters": {"q": "x"}}',
        "I will look it up.",
        [call("search_web", q="x")],
    ),
    (  # after the last call that parses, the rest is content
        '\n {"name": "get_weather", "parameters": {"city": "Rome"}} ; then I will answer.',
        "; then I will answer.",
        [call("get_weather", city="Rome")],
    ),
    (
        '{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "unknown", "parameters": {}}',
        '; {"name": "unknown", "parameters": {}}',
        [call("get_weather", city="Rome")],
    ),
    (
        '{"name": "get_weather", "parameters": {"city": "Rome"}};\n',
        ";",
        [call("get_weather", city="Rome")],
    ),
]

LLAMA3_CONTENT_ONLY = [
    "The weather in Paris is sunny.",
    'Use a dict like {"name": "get_weather"} in Python.',  # a `{` later in the text is not a call
    '{"name": "get_weather", "parameters": {"city": "Rome"}',  # cut short
    '{"name": "not_a_tool", "parameters": {}}',
    '{"answer": 42}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": ',
    '<|python_tag|>print("hello")',  # code for the python interpreter, not a JSON call
    "<|python_ta",
    "   ",
]


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3_CASES)
def test_llama3_calls(text: str, content: str, calls: list[ToolCall]) -> None:
    assert assert_stream_agrees("llama3", text) == ParsedCalls(content, calls)


@pytest.mark.parametrize("text", LLAMA3_CONTENT_ONLY)
def test_llama3_text_that_holds_no_call_is_content(text: str) -> None:
    assert assert_stream_agrees("llama3", text) == ParsedCalls(text.strip(), [])


MISTRAL_CASES = [
    (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
        "",
        [call("get_weather", city="Paris", unit="celsius")],
    ),
    (
        'Bien sûr !\n\n[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}, '
        '{"name": "search_web", "arguments": {"q": "TGV Lyon–Paris"}}]',
        "Bien sûr !",
        [call("get_weather", city="Lyon"), call("search_web", q="TGV Lyon–Paris")],
    ),
    (  # a single object instead of an array, and text after it
        '[TOOL_CALLS] {"name": "search_web", "arguments": {"q": "x"}}\nI searched.',
        "I searched.",
        [call("search_web", q="x")],
    ),
]

MISTRAL_CASES += [
    (  # tokenizer v11+: one [TOOL_CALLS] per call, the name before [ARGS]
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Genève"}[TOOL_CALLS]search_web[ARGS]{"q": "CERN"}',
        "Checking.",
        [call("get_weather", city="Genève"), call("search_web", q="CERN")],
    ),
    (  # [ARGS] skipped as a special token in detokenizing
        '[TOOL_CALLS]book_flight{"route": {"from": "CDG", "to": "JFK"}}',
        "",
        [call("book_flight", route={"from": "CDG", "to": "JFK"})],
    ),
]

MISTRAL_CONTENT_ONLY = [
    "No tools needed: 2 + 2 = 4.",
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "nope", "arguments": {}}]',
    "[TOOL_CALLS] []",
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Pa',
    "[TOOL_CALLS] oops",
    "[TOOL_CALL",
    '[TOOL_CALLS]unknown_tool[ARGS]{"a": 1}',
    '[TOOL_CALLS]get_weather[ARGS]["Paris"]',
    '[TOOL_CALLS]get_weather[ARG]{"city": "Paris"}',
    "[TOOL_CALLS]get_weather",
    "[TOOL_CALLS]" + "x" * 65 + '{"a": 1}',
]


@pytest.mark.parametrize(("text", "content", "calls"), MISTRAL_CASES)
def test_mistral_calls(text: str, content: str, calls: list[ToolCall]) -> None:
    assert assert_stream_agrees("mistral", text) == ParsedCalls(content, calls)


@pytest.mark.parametrize("text", MISTRAL_CONTENT_ONLY)
def test_mistral_text_that_holds_no_call_is_content(text: str) -> None:
    assert assert_stream_agrees("mistral", text) == ParsedCalls(text.strip(), [])


def test_long_call_streamed_token_by_token() -> None:
    """A long call fed in small deltas is scanned once (kept across deltas), and still found."""
    arguments = {"items": [{"id": i, "text": "x" * 50} for i in range(400)]}
    text = '<tool_call>{"name": "search_web", "arguments": ' + json.dumps(arguments) + "}</tool_call>"
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    assert streamed("hermes", pieces) == ParsedCalls("", [call("search_web", **arguments)])


def test_call_ids_are_per_request_and_index() -> None:
    first = call_id("chatcmpl-abc", 0)
    assert first.startswith("call_") and len(first) == 5 + 24
    int(first[5:], 16)
    assert first == call_id("chatcmpl-abc", 0)
    assert len({first, call_id("chatcmpl-abc", 1), call_id("chatcmpl-abd", 0)}) == 3


def test_parser_names() -> None:
    assert {"hermes", "qwen25", "llama3", "mistral"} <= set(PARSERS)
    with pytest.raises(ValueError, match="known: hermes"):
        make_parser("nonexistent", TOOLS)


@pytest.mark.parametrize("parser_name", ["hermes", "mistral"])
def test_arguments_string_nested_too_deep_is_content(parser_name: str) -> None:
    deep = "[" * 5000 + "]" * 5000
    body = '{"name": "get_weather", "arguments": "' + deep + '"}'
    text = f"<tool_call>{body}</tool_call>" if parser_name == "hermes" else f"[TOOL_CALLS] [{body}]"
    assert make_parser(parser_name, TOOLS).parse(text) == ParsedCalls(text, [])
    assert streamed(parser_name, [text[:7], text[7:]]) == ParsedCalls(text, [])


FRAGMENTS = [
    '<tool_call>\n{"name": "search_web", "arguments": {"q": "x"}}',
    "[TOOL_CALLS]get_weather",
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|python_tag|>",
    '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
    '{"name": "search_web", "parameters": {}}',
    '[{"name": "book_flight", "arguments": {}}]',
    "get_weather",
    '"name"',
    "{",
    "}",
    "[",
    "]",
    '"',
    "\\",
    ";",
    ":",
    " ",
    "\n",
    "text",
    "é",
]


@pytest.mark.parametrize("parser_name", sorted(PARSERS))
def test_stream_agrees_on_fragment_soup(parser_name: str) -> None:
    """Random texts of markers, call JSON and stray brackets, split at random: a stream sends what
    the whole parse finds."""
    rng = random.Random(parser_name)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 12)))
        whole = make_parser(parser_name, TOOLS).parse(text)
        for _ in range(5):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            assert streamed(parser_name, pieces) == whole, (text, cuts)
