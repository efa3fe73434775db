"""The bad-request table (bad_requests.py) through the real parsing layer and the real tokenizer,
in the order a route applies the checks: API key, body, model, prompt."""

import gzip

import pytest
from bad_requests import API_KEY, BAD_REQUESTS, CONTEXT_LEN, MODEL, VOCAB_SIZE, BadRequest, chat, completion, generate

from httpapi.auth import check_api_key
from httpapi.chat_request import parse_chat_completion
from httpapi.errors import APIError
from httpapi.info import check_model
from httpapi.requests import (
    parse_abort,
    parse_completion,
    parse_detokenize,
    parse_generate,
    parse_tokenize,
)
from httpapi.sampling import check_max_logprobs, check_token_ids
from protocol.sampling_params import MAX_TOP_LOGPROBS


def handle(path: str, body: bytes, authorization: str | None, tokenizer) -> None:
    """What a route does with a request before it reaches the engine; raises APIError."""
    check_api_key(authorization, API_KEY)
    if path == "/v1/chat/completions":
        req = parse_chat_completion(body)
        check_model(req.model, (MODEL,))
        req.sampling.check_grammar("xgrammar", False)
        template = req.template.call_kwargs() if req.template is not None else {"add_generation_prompt": True}
        ids = req.prompt_ids  # vLLM's pre-tokenized prompt, else the rendered messages
        if ids is None:
            ids = tokenizer.apply_chat_template(req.messages, tokenize=True, return_dict=False, **template)
        params = req.sampling.resolve(ids, CONTEXT_LEN, VOCAB_SIZE)
        check_max_logprobs(params, req.sampling.names, MAX_TOP_LOGPROBS, len(ids))  # the server's default
    elif path in ("/v1/completions", "/generate"):
        req = parse_completion(body) if path == "/v1/completions" else parse_generate(body)
        check_model(getattr(req, "model", None), (MODEL,))
        samplings = req.samplings if path == "/generate" else [req.sampling] * len(req.prompts)
        for sampling in samplings:
            sampling.check_grammar("xgrammar", False)
        for prompt, sampling in zip(req.prompts, samplings):
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            params = sampling.resolve(ids, CONTEXT_LEN, VOCAB_SIZE)
            check_max_logprobs(params, sampling.names, MAX_TOP_LOGPROBS, len(ids))  # the server's default
    elif path == "/tokenize":
        check_model(parse_tokenize(body).model, (MODEL,))
    elif path == "/detokenize":
        req = parse_detokenize(body)
        check_model(req.model, (MODEL,))
        for ids in req.token_ids:
            check_token_ids(ids, VOCAB_SIZE, "tokens")
    elif path == "/abort_request":
        parse_abort(body)
    else:
        raise AssertionError(f"no route {path}")


def test_the_table_is_big_enough():
    assert len(BAD_REQUESTS) >= 30
    assert len({r.name for r in BAD_REQUESTS}) == len(BAD_REQUESTS)


@pytest.mark.parametrize("row", BAD_REQUESTS, ids=lambda r: r.name)
def test_bad_request(row: BadRequest, tokenizer):
    with pytest.raises(APIError) as caught:
        handle(row.path, row.body, row.auth, tokenizer)
    err = caught.value
    assert (err.status, err.param) == (row.status, row.param), err.message
    assert err.message and err.type in ("invalid_request_error", "server_error")
    if row.param is not None:
        assert (
            row.param.split("[")[0].split(".")[-1] in err.message
            or row.param in err.message
            or err.code == "context_length_exceeded"
        ), err.message


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", chat()),
        (
            "/v1/chat/completions",
            chat(
                max_tokens=None,
                messages=[
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                    {"role": "assistant", "content": None},
                    {"role": "tool", "content": "42"},
                    {"role": "user", "content": "ok"},
                ],
            ),
        ),
        (
            "/v1/chat/completions",
            chat(
                messages=[
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
                    {"role": "user", "content": "ok"},
                ],
                function_call="none",
                user="u",
                metadata={"k": "v"},
                store=True,
                service_tier="auto",
                parallel_tool_calls=False,
                logit_bias={},
            ),
        ),
        (
            "/v1/chat/completions",
            chat(
                max_completion_tokens=8000,
                stream=True,
                stream_options={"include_usage": True},
                logprobs=True,
                top_logprobs=20,
                stop=["\n"],
                seed=2**63 - 1,
                n=4,
                top_k=0,
            ),
        ),
        (
            "/v1/chat/completions",
            chat(
                model=None,
                user="u",
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice="none",
                response_format={"type": "text"},
                unknown_field=1,
            ),
        ),
        ("/v1/completions", completion(prompt=["a", "b"], n=64, echo=True, logprobs=None)),
        ("/v1/completions", completion(echo=True, logprobs=2, logit_bias={"50": -100, "7": 2.5})),
        (
            "/v1/chat/completions",
            chat(
                tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                tool_choice="required",
                chat_template_kwargs={"enable_thinking": False},
                prompt_logprobs=2,
                messages=[
                    {"role": "user", "content": "Hi"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    {"role": "tool", "content": "42", "tool_call_id": "c1"},
                ],
            ),
        ),
        ("/v1/chat/completions", chat(structured_outputs={"choice": ["yes", "no"], "disable_any_whitespace": True})),
        ("/v1/completions", completion(response_format={"type": "json_object"}, guided_decoding_backend="xgrammar")),
        ("/v1/completions", completion(prompt=[[1, 2], [3]], logprobs=0, max_tokens=8190)),
        ("/v1/completions", completion(prompt=[1] * 8176, max_tokens=None)),
        ("/generate", generate(text=None, input_ids=[[1, 2], [3]], rid=["a", "b"])),
        (
            "/generate",
            generate(
                sampling_params={"max_new_tokens": 4, "n": 2, "sampling_seed": 3, "min_new_tokens": 2},
                return_logprob=True,
                top_logprobs_num=5,
                stream=True,
            ),
        ),
        (
            "/generate",
            generate(
                sampling_params={"max_new_tokens": 4, "regex": "[a-z]+", "logit_bias": {"5": 1}},
                return_logprob=True,
                logprob_start_len=0,
            ),
        ),
        ("/tokenize", b'{"prompt": ["", "a"]}'),
        ("/detokenize", b'{"tokens": []}'),
        ("/abort_request", b'{"abort_all": true}'),
    ],
)
def test_good_requests_pass(path, body, tokenizer):
    handle(path, body, f"Bearer {API_KEY}", tokenizer)


def test_no_api_key_configured_lets_everything_through():
    check_api_key(None, None)
    check_api_key("Bearer anything", None)
    check_api_key(f"bearer  {API_KEY}", API_KEY)  # the scheme is case-insensitive


def test_an_integer_past_64_bits_is_called_out_of_range():
    """orjson reads it as a float: the 400 says the integer is too large, not that it is no integer."""
    with pytest.raises(APIError) as caught:
        parse_chat_completion(chat().replace(b'"max_tokens":8', b'"max_tokens":100000000000000000000000'))
    assert caught.value.param == "max_tokens" and "64-bit" in caught.value.message


@pytest.mark.parametrize("seed,kind", [(-(2**63) - 1, "greater_than_equal"), (2**63, "less_than_equal")])
def test_a_seed_past_64_bits_names_pydantics_error_type(seed, kind):
    """vLLM's clients (its suite's test_long_seed) match pydantic's error type in the message,
    on either side of the 64-bit range (2**63 is an int to orjson, -2**63 - 1 a float)."""
    with pytest.raises(APIError) as caught:
        parse_chat_completion(chat().replace(b'"max_tokens":8', b'"max_tokens":8,"seed":' + str(seed).encode()))
    assert caught.value.param == "seed" and f"[type={kind}]" in caught.value.message


def test_a_gzip_body_is_named():
    """Content-Encoding is not decoded: the 400 says why, not that the bytes are bad UTF-8."""
    with pytest.raises(APIError) as caught:
        parse_chat_completion(gzip.compress(chat()))
    assert "gzip" in caught.value.message


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", completion(prompt=[1] * 3000), "prompt"),
        ("/generate", generate(text=None, input_ids=[1] * 2048), "input_ids"),
    ],
)
def test_a_prompt_past_the_kv_cache_names_the_prompt(path, body, param):
    """A KV cache smaller than the context (--max-total-tokens): the prompt gets its 400 here,
    not the scheduler's rejection without a param (inside a 200 stream when streaming)."""
    req = parse_completion(body) if path == "/v1/completions" else parse_generate(body)
    sampling = req.samplings[0] if path == "/generate" else req.sampling
    with pytest.raises(APIError) as caught:
        sampling.resolve(req.prompts[0], CONTEXT_LEN, VOCAB_SIZE, kv_tokens=2048)
    err = caught.value
    assert (err.status, err.param, err.code) == (400, param, "context_length_exceeded"), err.message
    assert "2048" in err.message
    sampling.resolve([1] * 2047, CONTEXT_LEN, VOCAB_SIZE, kv_tokens=2048)


def test_context_overflows_say_what_sglangs_clients_look_for():
    """SGLang's clients (its own suite among them) match these words: a prompt that fills the
    context "is longer than the model's context length", a max_tokens past what is left is a
    "Requested token count [that] exceeds the model's maximum context length", and one past the
    context itself "max_completion_tokens is too large" as well (SGLang's releases have matched
    either); all name their field and carry OpenAI's code."""
    req = parse_completion(completion(prompt=[1] * CONTEXT_LEN))
    with pytest.raises(APIError) as caught:
        req.sampling.resolve(req.prompts[0], CONTEXT_LEN, VOCAB_SIZE)
    err = caught.value
    assert (err.param, err.code) == ("prompt", "context_length_exceeded")
    assert "is longer than the model's context length" in err.message and str(CONTEXT_LEN) in err.message
    req = parse_completion(completion(prompt=[1] * 10, max_tokens=CONTEXT_LEN))
    with pytest.raises(APIError) as caught:
        req.sampling.resolve(req.prompts[0], CONTEXT_LEN, VOCAB_SIZE)
    err = caught.value
    assert (err.param, err.code) == ("max_tokens", "context_length_exceeded")
    assert err.message.startswith("Requested token count exceeds the model's maximum context length")
    req = parse_completion(completion(prompt=[1], max_tokens=CONTEXT_LEN + 1))  # more than any context holds
    with pytest.raises(APIError) as caught:
        req.sampling.resolve(req.prompts[0], CONTEXT_LEN, VOCAB_SIZE)
    err = caught.value
    assert (err.param, err.code) == ("max_tokens", "context_length_exceeded")
    assert err.message.startswith("max_completion_tokens is too large")
    assert "Requested token count exceeds the model's maximum context length" in err.message
