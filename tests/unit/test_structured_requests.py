"""Structured output, tools and chat-template inputs as the request parsers make them, and the
grammar check's 400s (the walk over a live server is tests/server/test_request_fields.py)."""

from __future__ import annotations

import time

import orjson
import pytest
import xgrammar

from httpapi.chat_request import parse_chat_completion
from httpapi.errors import APIError
from httpapi.requests import parse_completion, parse_generate
from protocol.sampling_params import MAX_GRAMMAR_BYTES, GrammarKind
from structured.grammars import (
    MAX_SCHEMA_DEPTH,
    InvalidGrammar,
    check_grammar,
    choice_grammar,
    is_checked,
    json_schema_text,
    structural_tag_text,
)

HI = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def chat(**fields):
    return parse_chat_completion(orjson.dumps({"messages": HI, **fields}))


def refused(make, param: str) -> str:
    with pytest.raises(APIError) as caught:
        req = make()
        for spec in getattr(req, "samplings", None) or [req.sampling]:
            spec.check_grammar("xgrammar", False)
    assert (caught.value.status, caught.value.param) == (400, param), caught.value.message
    return caught.value.message


def test_choices_match_exactly_one_string_however_they_are_spelled():
    choices = ['say "hi"', "back\\slash", "new\nline", "[x]*+?.", "é 漢 🎉", "ctl\x01"]
    grammar = xgrammar.Grammar.from_ebnf(choice_grammar(choices))
    accepts = xgrammar.testing._is_grammar_accept_string
    assert all(accepts(grammar, c) for c in choices)
    assert not accepts(grammar, 'say "hi"!') and not accepts(grammar, "say")
    with pytest.raises(InvalidGrammar):
        choice_grammar([])


def test_schemas_are_canonical_and_bounded():
    assert json_schema_text('{ "type" : "object" }') == json_schema_text({"type": "object"}) == '{"type":"object"}'
    deep = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidGrammar, match="nests"):
        json_schema_text(deep)
    with pytest.raises(InvalidGrammar, match="bytes"):
        json_schema_text({"type": "string", "description": "x" * MAX_GRAMMAR_BYTES})


def test_a_legacy_structural_tag_becomes_xgrammars():
    tag = structural_tag_text(
        {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}], "triggers": ["<f"]}
    )
    assert orjson.loads(tag)["format"]["type"] == "triggered_tags"
    check_grammar(GrammarKind.STRUCTURAL_TAG, tag)


def test_verdicts_are_memoized_failures_too():
    text = '{"type": "object", "properties": {"memo_probe": {"type": "nope"}}}'
    assert not is_checked(GrammarKind.JSON_SCHEMA, text)
    with pytest.raises(InvalidGrammar, match="nope"):
        check_grammar(GrammarKind.JSON_SCHEMA, text)
    assert is_checked(GrammarKind.JSON_SCHEMA, text)
    start = time.perf_counter()
    with pytest.raises(InvalidGrammar):
        check_grammar(GrammarKind.JSON_SCHEMA, text)
    assert time.perf_counter() - start < 0.01


@pytest.mark.parametrize(
    "fields,kind,param",
    [
        ({"response_format": {"type": "json_object"}}, GrammarKind.JSON_SCHEMA, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}},
            GrammarKind.JSON_SCHEMA,
            "response_format.json_schema.schema",
        ),
        ({"guided_json": '{"type": "object"}'}, GrammarKind.JSON_SCHEMA, "guided_json"),
        ({"guided_choice": ["a", "b"]}, GrammarKind.EBNF, "guided_choice"),
        ({"structured_outputs": {"json_object": True}}, GrammarKind.JSON_SCHEMA, "structured_outputs.json_object"),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, GrammarKind.EBNF, "structured_outputs.grammar"),
        ({"tools": [TOOL], "tool_choice": "required"}, GrammarKind.JSON_SCHEMA, "tools"),
    ],
)
def test_grammar_fields_name_themselves(fields, kind, param):
    req = chat(**fields)
    p = req.sampling.params
    assert (p.grammar_kind, req.sampling.grammar_param) == (kind, param)
    req.sampling.check_grammar("xgrammar", False)
    with pytest.raises(APIError) as caught:  # the server without a grammar backend
        req.sampling.check_grammar("none", False)
    assert (caught.value.param, "--grammar-backend none" in caught.value.message) == (param, True)


def test_a_named_tool_forces_its_parameters():
    req = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert req.sampling.params.grammar == '{"type":"object"}' and req.tool_choice.name == "get_weather"
    assert chat(tools=[TOOL]).sampling.params.grammar_kind == GrammarKind.NONE  # auto: the parser's job


def test_completions_and_generate_take_grammars():
    req = parse_completion(orjson.dumps({"prompt": "x", "response_format": {"type": "json_object"}}))
    assert req.sampling.params.grammar == '{"type":"object"}'
    gen = parse_generate(orjson.dumps({"text": "x", "sampling_params": {"regex": "[0-9]+"}}))
    assert (gen.samplings[0].params.grammar, gen.samplings[0].grammar_param) == ("[0-9]+", "sampling_params.regex")
    refused(
        lambda: parse_generate(orjson.dumps({"text": "x", "sampling_params": {"ebnf": "root ::="}})),
        "sampling_params.ebnf",
    )


def test_compact_json_cannot_be_asked_of_a_server_that_allows_whitespace():
    req = chat(structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True})
    req.sampling.check_grammar("xgrammar", False)
    with pytest.raises(APIError) as caught:
        req.sampling.check_grammar("xgrammar", True)
    assert caught.value.param == "structured_outputs.disable_any_whitespace"


def test_logit_bias_and_prompt_logprobs_reach_sampling_params():
    params = chat(logit_bias={"7": 1, "3": -100.0}, prompt_logprobs=2).sampling.resolve([1, 2], 8192, 49152)
    assert (params.logit_bias, params.prompt_logprobs, params.prompt_logprobs_start) == (((3, -100.0), (7, 1.0)), 2, 0)
    echo = parse_completion(orjson.dumps({"prompt": "x", "echo": True, "logprobs": 3})).sampling.params
    assert (echo.prompt_logprobs, echo.top_logprobs) == (3, 3)
    gen = parse_generate(
        orjson.dumps({"text": "x", "return_logprob": True, "logprob_start_len": 1, "top_logprobs_num": 2})
    ).samplings[0]
    assert (gen.params.prompt_logprobs, gen.params.prompt_logprobs_start) == (2, 1)
    without = parse_generate(orjson.dumps({"text": "x", "logprob_start_len": 1})).samplings[0]
    assert without.params.prompt_logprobs == -1  # SGLang: nothing without return_logprob
    refused(lambda: chat(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias")


def test_template_inputs():
    assert chat().template is None  # the fast render
    req = chat(
        tools=[TOOL],
        documents=[{"title": "t", "text": "x"}],
        chat_template_kwargs={"enable_thinking": False},
        reasoning_effort="low",
        add_special_tokens=True,
    )
    kwargs = req.template.call_kwargs()
    assert kwargs["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    assert (kwargs["documents"], kwargs["enable_thinking"], kwargs["reasoning_effort"]) == (
        [{"title": "t", "text": "x"}],
        False,
        "low",
    )
    assert req.template.add_special_tokens and kwargs["add_generation_prompt"]
    cont = chat(
        messages=[*HI, {"role": "assistant", "content": "Hel"}],
        continue_final_message=True,
        add_generation_prompt=False,
    )
    assert cont.template.call_kwargs()["continue_final_message"]
    # SGLang's prefill: continue_final_message alone (add_generation_prompt left at its default)
    prefill = chat(messages=[*HI, {"role": "assistant", "content": "Hel"}], continue_final_message=True)
    assert prefill.template.call_kwargs()["continue_final_message"]
    assert not prefill.template.call_kwargs()["add_generation_prompt"]
    refused(lambda: chat(chat_template_kwargs={"k": "x" * 70000}), "chat_template_kwargs")
    refused(lambda: chat(chat_template_kwargs={"tools": []}), "chat_template_kwargs")
    refused(lambda: chat(documents=[{"title": 5}]), "documents")


def test_tool_calls_in_messages_are_parsed_for_the_template():
    req = chat(
        messages=[
            *HI,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
            },
            {"role": "tool", "content": "2", "tool_call_id": "c1", "name": "f"},
        ]
    )
    assert req.messages[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}, "id": "c1"}
    ]
    assert req.messages[2] == {"role": "tool", "content": "2", "name": "f", "tool_call_id": "c1"}
    assert req.template is not None
    refused(
        lambda: chat(messages=[{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]),
        "messages[0].tool_calls",
    )


def test_grammar_checks_held_at_once_are_bounded():
    """A worker holds at most `limit` grammar checks (running or queued); past it a 503, and a
    check that ends frees its place."""
    import asyncio
    import threading

    from httpapi.errors import APIError
    from runtime.http_worker.grammar_checks import GrammarChecks

    async def scenario() -> None:
        checks, release = GrammarChecks("xgrammar", False, threads=1, limit=2), threading.Event()
        held = [asyncio.ensure_future(checks.run(release.wait)) for _ in range(2)]
        await asyncio.sleep(0.05)  # both are held: one running, one queued
        with pytest.raises(APIError) as caught:  # at once: not queued behind the held ones
            await asyncio.wait_for(checks.run(lambda: None), 5)
        assert caught.value.status == 503 and "limit" in caught.value.message
        release.set()
        await asyncio.gather(*held)
        await checks.run(lambda: None)  # places are free again
        checks.close()

    asyncio.run(scenario())
