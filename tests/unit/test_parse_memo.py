"""ParseMemo on chat requests: requests that send the same settings share one parse of them,
and each still gets what its own messages decide, every warning and every error."""

from __future__ import annotations

import logging

import orjson
import pytest

from httpapi.chat_request import ChatTemplateArgs, parse_chat_completion
from httpapi.errors import APIError
from httpapi.fields import FieldLog


def body(**fields) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_same_settings_share_one_parse_each_its_own_messages():
    settings = {"max_tokens": 7, "temperature": 0.25, "stream": True, "stream_options": {"include_usage": True}}
    a = parse_chat_completion(body(**settings))
    b = parse_chat_completion(body(**settings, messages=[{"role": "user", "content": "other"}]))
    assert a.sampling is b.sampling  # one parse of the settings
    assert a.messages == [{"role": "user", "content": "hi"}]
    assert b.messages == [{"role": "user", "content": "other"}]
    assert (a.stream, a.include_usage, a.sampling.max_tokens, a.sampling.params.temperature) == (True, True, 7, 0.25)
    c = parse_chat_completion(body(**{**settings, "temperature": 0.5}))
    assert c.sampling.params.temperature == 0.5


def test_what_the_messages_decide_is_decided_per_request():
    settings = {"max_tokens": 3, "echo": True}
    plain = parse_chat_completion(body(**settings, messages=[{"role": "assistant", "content": "so far"}]))
    assert (plain.template, plain.echo) == (None, "so far")
    user = parse_chat_completion(body(**settings))
    assert (user.template, user.echo) == (None, "")  # echo needs the answer's role last
    answered = [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "42"},
    ]
    rich = parse_chat_completion(body(**settings, messages=answered))
    assert rich.template == ChatTemplateArgs()  # tool calls render through the template
    cont = {"continue_final_message": True, "add_generation_prompt": False}
    ok = parse_chat_completion(body(**cont, messages=[{"role": "assistant", "content": "so"}]))
    assert ok.template is not None and ok.template.continue_final_message
    with pytest.raises(APIError) as err:  # the same settings after a user's message
        parse_chat_completion(body(**cont))
    assert err.value.param == "continue_final_message"


def test_unknown_fields_are_warned_on_every_request(caplog):
    caplog.set_level(logging.WARNING, "ringserve.httpapi")
    for _ in range(3):
        parse_chat_completion(body(max_tokens=5, frobnicate=1, stream=True, stream_options={"zap": True}))
    warned = [r.getMessage() for r in caplog.records]
    assert warned.count("/v1/chat/completions: ignoring unknown fields ['frobnicate']") == 3
    assert warned.count("stream_options: ignoring unknown fields ['stream_options.zap']") == 3


def test_a_refused_request_is_refused_every_time():
    for _ in range(2):
        with pytest.raises(APIError) as err:
            parse_chat_completion(body(temperature="hot"))
        assert err.value.param == "temperature"


def test_fields_too_deep_to_key_are_parsed_unkept(caplog):
    caplog.set_level(logging.WARNING, "ringserve.httpapi")
    deep = b"[" * 300 + b"]" * 300  # past orjson's depth for writing, within its depth for reading
    for _ in range(2):
        req = parse_chat_completion(body(max_tokens=9)[:-1] + b', "deep": ' + deep + b"}")
        assert req.sampling.max_tokens == 9
    assert [r.getMessage() for r in caplog.records].count("/v1/chat/completions: ignoring unknown fields ['deep']") == 2


def test_a_field_log_sees_every_read_of_a_parse_kept_before():
    parse_chat_completion(body(max_tokens=4))
    with FieldLog() as log:
        parse_chat_completion(body(max_tokens=4))
    assert {"messages", "max_tokens", "temperature", "stream_options"} <= log.fields.keys()
