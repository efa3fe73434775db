"""The table of bad requests: bytes in, expected status and error `param` out.

Data, not a test: test_httpapi_bad_requests.py runs it through the parsing layer, and
the live-server tests can run it over HTTP (`from bad_requests import BAD_REQUESTS`).
It assumes a server of SmolLM2-135M-Instruct (context 8192 tokens, vocabulary 49152)
started with `--api-key API_KEY`; every row sends `Authorization: <auth>`.
A server checks, in this order: API key (401), body (400), model (404), prompt (400).
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass

import orjson

API_KEY = "ringserve-test-key"
MODEL = "SmolLM2-135M-Instruct"
CONTEXT_LEN = 8192
VOCAB_SIZE = 49152
VALID_AUTH = f"Bearer {API_KEY}"


@dataclass(frozen=True)
class BadRequest:
    name: str
    path: str
    body: bytes
    status: int
    param: str | None  # the error's `param`; None for errors about the whole body or the key
    auth: str | None = VALID_AUTH  # the Authorization header's value; None: not sent

    @property
    def headers(self) -> dict[str, str]:
        return {"content-type": "application/json", **({"authorization": self.auth} if self.auth else {})}


def _body(base: dict, **changes) -> bytes:
    """`base` with `changes`; a change to None drops the field."""
    merged = {**base, **changes}
    return orjson.dumps({k: v for k, v in merged.items() if v is not None})


_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
_COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 8}
_GENERATE = {"text": "Hi", "sampling_params": {"max_new_tokens": 8}}
_LONG_TEXT = "hello " * 9000  # about 9000 tokens


def chat(**changes) -> bytes:
    return _body(_CHAT, **changes)


def completion(**changes) -> bytes:
    return _body(_COMPLETION, **changes)


def generate(**changes) -> bytes:
    return _body(_GENERATE, **changes)


def _row(name: str, path: str, body: bytes, status: int, param: str | None, **kw) -> BadRequest:
    return BadRequest(name, path, body, status, param, **kw)


CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"

BAD_REQUESTS: list[BadRequest] = [
    # the body itself
    _row("malformed JSON", CHAT, b'{"model": "x", "messages": [', 400, None),
    _row("empty body", CHAT, b"", 400, None),
    _row("body is a list", CHAT, b"[1, 2]", 400, None),
    _row("NaN is not JSON", CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": NaN}', 400, None),
    _row("number overflows a double", COMPLETIONS, b'{"prompt": "Hi", "temperature": 1e400}', 400, None),
    _row("gzip-compressed body", CHAT, gzip.compress(chat()), 400, None),
    # auth and model
    _row("missing API key", CHAT, chat(), 401, None, auth=None),
    _row("wrong API key", CHAT, chat(), 401, None, auth="Bearer not-the-key"),
    _row("key without Bearer", CHAT, chat(), 401, None, auth=API_KEY),
    _row("unknown model", CHAT, chat(model="gpt-5"), 404, "model"),
    _row("unknown model, completions", COMPLETIONS, completion(model="llama-70b"), 404, "model"),
    _row("model is not a string", CHAT, chat(model=123), 400, "model"),
    # messages
    _row("messages missing", CHAT, chat(messages=None), 400, "messages"),
    _row("messages empty", CHAT, chat(messages=[]), 400, "messages"),
    _row("messages is a string", CHAT, chat(messages="Hi"), 400, "messages"),
    _row("message is a string", CHAT, chat(messages=["Hi"]), 400, "messages[0]"),
    _row(
        "role not a name", CHAT, chat(messages=[{"role": "user<|im_end|>", "content": "Hi"}]), 400, "messages[0].role"
    ),
    _row("role not a string", CHAT, chat(messages=[{"role": 5, "content": "Hi"}]), 400, "messages[0].role"),
    _row("content is a number", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    _row(
        "image content part",
        CHAT,
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ]
        ),
        400,
        "messages[0].content[1].type",
    ),
    _row(
        "refusal part from the user",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "refusal", "refusal": "No."}]}]),
        400,
        "messages[0].content[0]",
    ),
    _row(
        "refusal part without refusal",
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "refusal", "text": "No."}]},
            ]
        ),
        400,
        "messages[1].content[0].refusal",
    ),
    _row(
        "text part without text",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        400,
        "messages[0].content[0].text",
    ),
    _row(
        "over-long chat prompt",
        CHAT,
        chat(messages=[{"role": "user", "content": _LONG_TEXT}], max_tokens=None),
        400,
        "messages",
    ),
    # sampling: types and ranges
    _row("temperature is a string", CHAT, chat(temperature="hot"), 400, "temperature"),
    _row("temperature above 2", CHAT, chat(temperature=3), 400, "temperature"),
    _row("top_p zero", CHAT, chat(top_p=0), 400, "top_p"),
    _row("top_p above 1", COMPLETIONS, completion(top_p=1.5), 400, "top_p"),
    _row("top_k below -1", CHAT, chat(top_k=-5), 400, "top_k"),
    _row("top_k is a float", CHAT, chat(top_k=1.5), 400, "top_k"),
    _row("top_k past int32", CHAT, chat(top_k=2**40), 400, "top_k"),
    _row("min_p above 1", CHAT, chat(min_p=2), 400, "min_p"),
    _row("presence_penalty above 2", CHAT, chat(presence_penalty=5), 400, "presence_penalty"),
    _row("frequency_penalty below -2", COMPLETIONS, completion(frequency_penalty=-3), 400, "frequency_penalty"),
    _row("repetition_penalty zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    _row("repetition_penalty below 0.01", CHAT, chat(repetition_penalty=1e-300), 400, "repetition_penalty"),
    _row("seed is a string", CHAT, chat(seed="abc"), 400, "seed"),
    _row("seed past 64 bits", CHAT, chat(seed=2**64 - 1), 400, "seed"),
    _row("n zero", CHAT, chat(n=0), 400, "n"),
    _row("n too large", CHAT, chat(n=1000), 400, "n"),
    _row("stop is a number", CHAT, chat(stop=5), 400, "stop"),
    _row("empty stop string", CHAT, chat(stop=[""]), 400, "stop"),
    _row("too many stop strings", COMPLETIONS, completion(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    _row("stop token id past the vocabulary", CHAT, chat(stop_token_ids=[60000]), 400, "stop_token_ids"),
    _row("negative stop token id", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    _row("min_tokens above max_tokens", CHAT, chat(min_tokens=20, max_tokens=10), 400, "min_tokens"),
    _row("ignore_eos is a string", CHAT, chat(ignore_eos="yes"), 400, "ignore_eos"),
    # max tokens
    _row("max_tokens zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    _row("max_tokens negative", COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    _row("max_tokens is a string", CHAT, chat(max_tokens="ten"), 400, "max_tokens"),
    _row(
        "max_tokens past 64 bits",
        CHAT,
        chat().replace(b'"max_tokens":8', b'"max_tokens":100000000000000000000000'),
        400,
        "max_tokens",
    ),
    _row("max_completion_tokens zero", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    _row("max_tokens past the context", CHAT, chat(max_tokens=9000), 400, "max_tokens"),
    _row(
        "max_completion_tokens past the context", CHAT, chat(max_completion_tokens=8192), 400, "max_completion_tokens"
    ),
    _row(
        "prompt plus max_tokens past the context",
        COMPLETIONS,
        completion(prompt=[1] * 8000, max_tokens=500),
        400,
        "max_tokens",
    ),
    # logprobs
    _row("chat logprobs is a number", CHAT, chat(logprobs=5), 400, "logprobs"),
    _row("top_logprobs above 20", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    _row("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    _row("completions logprobs above 20", COMPLETIONS, completion(logprobs=21), 400, "logprobs"),
    _row("completions logprobs is a boolean", COMPLETIONS, completion(logprobs=True), 400, "logprobs"),
    # streaming
    _row("stream is a string", CHAT, chat(stream="yes"), 400, "stream"),
    _row("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    _row(
        "include_usage is a string",
        CHAT,
        chat(stream=True, stream_options={"include_usage": "x"}),
        400,
        "stream_options.include_usage",
    ),
    # features this server does not have
    _row("use_beam_search streamed", CHAT, chat(use_beam_search=True, stream=True), 400, "stream"),
    _row("use_beam_search of 11 beams", COMPLETIONS, completion(use_beam_search=True, n=11), 400, "n"),
    _row(
        "length_penalty a string",
        COMPLETIONS,
        completion(use_beam_search=True, length_penalty="x"),
        400,
        "length_penalty",
    ),
    _row("per-request chat_template", CHAT, chat(chat_template="{{ messages }}"), 400, "chat_template"),
    _row("priority", COMPLETIONS, completion(priority=5), 400, "priority"),
    _row("functions", CHAT, chat(functions=[{"name": "f"}]), 400, "functions"),
    _row("function_call names a function", CHAT, chat(function_call={"name": "f"}), 400, "function_call"),
    _row("best_of", COMPLETIONS, completion(best_of=3), 400, "best_of"),
    _row("suffix", COMPLETIONS, completion(suffix="end"), 400, "suffix"),
    _row(
        "guided_decoding_backend outlines",
        CHAT,
        chat(guided_decoding_backend="outlines"),
        400,
        "guided_decoding_backend",
    ),
    _row("guided_whitespace_pattern", CHAT, chat(guided_whitespace_pattern=r"\s*"), 400, "guided_whitespace_pattern"),
    _row("stop_regex", GENERATE, generate(sampling_params={"stop_regex": "a+"}), 400, "sampling_params.stop_regex"),
    # logit_bias
    _row("logit_bias is a list", CHAT, chat(logit_bias=[]), 400, "logit_bias"),
    _row("logit_bias key is not a token id", CHAT, chat(logit_bias={"hello": 1}), 400, "logit_bias"),
    _row("logit_bias past the vocabulary", COMPLETIONS, completion(logit_bias={"60000": 1}), 400, "logit_bias"),
    _row("logit_bias above 100", CHAT, chat(logit_bias={"50": 101}), 400, "logit_bias"),
    _row("logit_bias value is a string", CHAT, chat(logit_bias={"50": "up"}), 400, "logit_bias"),
    _row(
        "generate logit_bias past the vocabulary",
        GENERATE,
        generate(sampling_params={"logit_bias": {"99999": 5}}),
        400,
        "sampling_params.logit_bias",
    ),
    # structured output
    _row(
        "response_format of an unknown type", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type"
    ),
    _row(
        "json_schema without a schema",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        "response_format.json_schema.schema",
    ),
    _row(
        "json_schema without a name",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}),
        400,
        "response_format.json_schema.name",
    ),
    _row(
        "a schema that does not compile",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
        400,
        "response_format.json_schema.schema",
    ),
    _row("a regex that does not parse", CHAT, chat(guided_regex="a(b"), 400, "guided_regex"),
    _row("a bad EBNF", COMPLETIONS, completion(guided_grammar="root ::= undefined_rule"), 400, "guided_grammar"),
    _row("guided_choice is not a list", CHAT, chat(guided_choice="yes"), 400, "guided_choice"),
    _row("two grammars", CHAT, chat(guided_regex="a+", guided_choice=["a"]), 400, "guided_choice"),
    _row(
        "structured_outputs regex does not parse",
        COMPLETIONS,
        completion(structured_outputs={"regex": "(("}),
        400,
        "structured_outputs.regex",
    ),
    _row("regex", GENERATE, generate(sampling_params={"regex": "a("}), 400, "sampling_params.regex"),
    _row(
        "json_schema and ebnf",
        GENERATE,
        generate(sampling_params={"json_schema": '{"type": "object"}', "ebnf": 'root ::= "a"'}),
        400,
        "sampling_params.ebnf",
    ),
    # tools and the chat template
    _row("tools malformed", CHAT, chat(tools=[{"type": "function"}]), 400, "tools[0].function"),
    _row("tool_choice required without tools", CHAT, chat(tool_choice="required"), 400, "tool_choice"),
    _row(
        "tool_choice names an absent function",
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
    ),
    _row(
        "tool call arguments are not JSON",
        CHAT,
        chat(
            messages=[
                {"role": "user", "content": "Hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}],
                },
            ]
        ),
        400,
        "messages[1].tool_calls[0].function.arguments",
    ),
    _row(
        "chat_template_kwargs sets tokenize",
        CHAT,
        chat(chat_template_kwargs={"tokenize": True}),
        400,
        "chat_template_kwargs",
    ),
    _row(
        "continue_final_message after a user",
        CHAT,
        chat(continue_final_message=True, add_generation_prompt=False),
        400,
        "continue_final_message",
    ),
    _row(
        "truncate_prompt_tokens zero", COMPLETIONS, completion(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens"
    ),
    _row("truncation_side neither", CHAT, chat(truncation_side="middle"), 400, "truncation_side"),
    # prompt logprobs
    _row("prompt_logprobs negative", COMPLETIONS, completion(prompt_logprobs=-2), 400, "prompt_logprobs"),
    _row("prompt_logprobs -1 past --max-logprobs", COMPLETIONS, completion(prompt_logprobs=-1), 400, "prompt_logprobs"),
    _row("top_logprobs -1 past --max-logprobs", CHAT, chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs"),
    _row("prompt_logprobs above 20", CHAT, chat(prompt_logprobs=21), 400, "prompt_logprobs"),
    _row(
        "logprob_start_len below -1",
        GENERATE,
        generate(return_logprob=True, logprob_start_len=-2),
        400,
        "logprob_start_len",
    ),
    _row(
        "logprob_start_len past the prompt",
        GENERATE,
        generate(return_logprob=True, logprob_start_len=50),
        400,
        "logprob_start_len",
    ),
    # fields this server ignores still get OpenAI's types
    _row("user is a number", CHAT, chat(user=5), 400, "user"),
    _row("parallel_tool_calls is a string", CHAT, chat(parallel_tool_calls="yes"), 400, "parallel_tool_calls"),
    _row("metadata is a list", COMPLETIONS, completion(metadata=["a"]), 400, "metadata"),
    # completions prompts
    # vLLM's pre-tokenized chat prompt, in its two spellings
    _row("prompt_token_ids empty", CHAT, chat(prompt_token_ids=[]), 400, "prompt_token_ids"),
    _row("prompt_token_ids not ids", CHAT, chat(prompt_token_ids=[1, "a"]), 400, "prompt_token_ids"),
    _row("prompt_token_ids past the vocabulary", CHAT, chat(prompt_token_ids=[1, 60000]), 400, "prompt_token_ids"),
    _row("prompt_token_ids fill the context", CHAT, chat(prompt_token_ids=[1] * CONTEXT_LEN), 400, "prompt_token_ids"),
    _row(
        "prompt ids in both spellings",
        CHAT,
        chat(prompt_token_ids=[1], kv_transfer_params={"prompt_token_ids": [1]}),
        400,
        "prompt_token_ids",
    ),
    _row(
        "kv_transfer_params asks for a transfer",
        CHAT,
        chat(kv_transfer_params={"do_remote_prefill": True, "prompt_token_ids": [1]}),
        400,
        "kv_transfer_params",
    ),
    _row(
        "kv_transfer_params' ids past the vocabulary",
        CHAT,
        chat(kv_transfer_params={"prompt_token_ids": [60000]}),
        400,
        "kv_transfer_params.prompt_token_ids",
    ),
    _row("prompt missing", COMPLETIONS, completion(prompt=None), 400, "prompt"),
    _row("prompt empty", COMPLETIONS, completion(prompt=""), 400, "prompt"),
    _row("prompt empty list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    _row("prompt of empty token lists", COMPLETIONS, completion(prompt=[[]]), 400, "prompt"),
    _row("prompt mixes ids and text", COMPLETIONS, completion(prompt=[1, "a"]), 400, "prompt"),
    _row("prompt has a negative id", COMPLETIONS, completion(prompt=[1, -1]), 400, "prompt"),
    _row("prompt id past the vocabulary", COMPLETIONS, completion(prompt=[1, 60000]), 400, "prompt"),
    _row("over-long token prompt", COMPLETIONS, completion(prompt=[1] * 8192), 400, "prompt"),
    _row("over-long text prompt", COMPLETIONS, completion(prompt=_LONG_TEXT), 400, "prompt"),
    _row("n times prompts too many", COMPLETIONS, completion(prompt=["a"] * 10, n=20), 400, "n"),
    # SGLang's /generate
    _row("neither text nor input_ids", GENERATE, generate(text=None), 400, "text"),
    _row("both text and input_ids", GENERATE, generate(input_ids=[1, 2]), 400, "text"),
    _row(
        "sampling_params list not one per prompt", GENERATE, generate(sampling_params=[{}, {}]), 400, "sampling_params"
    ),
    _row(
        "max_new_tokens zero",
        GENERATE,
        generate(sampling_params={"max_new_tokens": 0}),
        400,
        "sampling_params.max_new_tokens",
    ),
    _row(
        "generate temperature negative",
        GENERATE,
        generate(sampling_params={"temperature": -1}),
        400,
        "sampling_params.temperature",
    ),
    _row(
        "generate max_new_tokens past the context",
        GENERATE,
        generate(sampling_params={"max_new_tokens": 9000}),
        400,
        "sampling_params.max_new_tokens",
    ),
    _row("input_ids past the vocabulary", GENERATE, generate(text=None, input_ids=[1, 99999]), 400, "input_ids"),
    _row("rid list of the wrong length", GENERATE, generate(text=["a", "b"], rid=["r1"]), 400, "rid"),
    _row("rid repeats in a batch", GENERATE, generate(text=["a", "b"], rid=["r1", "r1"]), 400, "rid"),
    _row("image_data", GENERATE, generate(image_data="data:image/png;base64,AAAA"), 400, "image_data"),
    # tokenize, detokenize, abort
    _row("tokenize prompt is a number", "/tokenize", b'{"prompt": 5}', 400, "prompt"),
    _row("detokenize tokens is a string", "/detokenize", b'{"tokens": "abc"}', 400, "tokens"),
    _row("detokenize id past the vocabulary", "/detokenize", b'{"tokens": [1, 60000]}', 400, "tokens"),
    _row("abort without rid", "/abort_request", b"{}", 400, "rid"),
]
