"""The chat route's readers of a choice's text, wired for real: a null-model server (its text is a
fixed English sentence, so it has no `</think>` and no call) started with the default model's
own chat template, which renders no tools, and --reasoning-parser deepseek-r1.

- tools the template cannot show the model are a 400 naming `tools` (but with tool_choice
  "none"), and tool_choice "auto" with no parser for the template's format a 400 too;
- deepseek-r1's reasoning starts at the first token: a text that never closes it is all
  reasoning_content, whole and streamed alike; dropped with include_reasoning false, left in the
  content with separate_reasoning false."""

from __future__ import annotations

import openai
import pytest
from bad_requests import MODEL

from gpu.models.model_files import resolve_model_dir

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CHAT = [{"role": "user", "content": "What time is it?"}]


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    from transformers import AutoTokenizer

    own = tmp_path_factory.mktemp("template") / "smollm2.jinja"
    own.write_text(AutoTokenizer.from_pretrained(resolve_model_dir(None)).chat_template)
    return start_server(
        start_server.Server.granian,
        workers=1,
        null_model=True,
        log_level="warning",
        chat_template=str(own),
        reasoning_parser="deepseek-r1",
    )


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


@pytest.mark.parametrize("tool_choice", [None, "required", {"type": "function", "function": {"name": "get_time"}}])
def test_tools_a_template_cannot_render_are_refused(client, tool_choice):
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, tools=TOOLS, **extra)
    assert e.value.body["param"] == "tools" and "--chat-template" in e.value.body["message"]


def test_tool_choice_none_needs_no_rendering(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, tools=TOOLS, tool_choice="none")
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls


def test_reasoning_that_never_closes_is_all_reasoning(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12)
    message = r.model_dump()["choices"][0]["message"]
    assert message["reasoning_content"] and not message["content"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, stream=True))
    reasoning = "".join(c.model_dump()["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert reasoning == message["reasoning_content"] and content == ""
    assert chunks[-1].choices[0].finish_reason == "length"


def test_reasoning_dropped_or_left_in_the_content(client):
    """vLLM's include_reasoning false drops it; SGLang's separate_reasoning false leaves it in the content."""
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12)
    reasoning = whole.model_dump()["choices"][0]["message"]["reasoning_content"]
    dropped = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, extra_body={"include_reasoning": False}
    )
    message = dropped.model_dump()["choices"][0]["message"]
    assert not message.get("reasoning_content") and not message["content"]
    kept = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, extra_body={"separate_reasoning": False}
    )
    message = kept.model_dump()["choices"][0]["message"]
    assert message["content"] == reasoning and not message.get("reasoning_content")
