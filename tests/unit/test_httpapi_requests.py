"""What the parsers make of good requests: defaults, aliases, SGLang's names, prompts."""

import logging

import numpy as np
import orjson
import pytest

from httpapi.chat_request import parse_chat_completion
from httpapi.errors import APIError
from httpapi.requests import (
    parse_abort,
    parse_completion,
    parse_detokenize,
    parse_generate,
    parse_tokenize,
)
from httpapi.sampling import resolve_max_tokens
from protocol.sampling_params import SamplingParams

HI = [{"role": "user", "content": "Hi"}]


def body(**fields) -> bytes:
    return orjson.dumps(fields)


def test_chat_defaults_leave_max_tokens_to_the_context():
    req = parse_chat_completion(body(messages=HI))
    assert (req.model, req.n, req.stream, req.include_usage, req.sampling.max_tokens) == (None, 1, False, False, None)
    params = req.sampling.resolve([1] * 100, context_len=8192, vocab_size=49152)
    assert params == SamplingParams(max_new_tokens=8092)


def test_nulls_mean_defaults():
    req = parse_chat_completion(
        body(
            messages=HI,
            temperature=None,
            top_p=None,
            stop=None,
            seed=None,
            n=None,
            max_tokens=None,
            logprobs=None,
            stream=None,
            stream_options=None,
        )
    )
    assert req.sampling.resolve([1], 10, 10) == SamplingParams(max_new_tokens=9)


def test_chat_fields_reach_sampling_params():
    req = parse_chat_completion(
        body(
            model="m",
            messages=HI,
            max_tokens=99,
            max_completion_tokens=7,
            temperature=0,
            top_p=0.9,
            top_k=5,
            min_p=0.1,
            seed=-3,
            n=3,
            stop="END",
            stop_token_ids=[2, 5],
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            logprobs=True,
            top_logprobs=4,
            stream=True,
            stream_options={"include_usage": True},
            ignore_eos=True,
            min_tokens=2,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            user="u",
        )
    )
    assert (req.model, req.n, req.stream, req.include_usage) == ("m", 3, True, True)
    assert req.sampling.resolve([1, 2], 8192, 49152) == SamplingParams(
        max_new_tokens=7,
        min_new_tokens=2,
        temperature=0.0,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=-3,
        repetition_penalty=1.1,
        frequency_penalty=-0.5,
        presence_penalty=0.5,
        stop=("END",),
        stop_token_ids=(2, 5),
        ignore_eos=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        logprobs=True,
        top_logprobs=4,
    )


def test_requests_asking_the_same_share_one_sampling_spec():
    def spec(**fields):
        return parse_chat_completion(body(messages=HI, **fields)).sampling

    a = spec(max_tokens=8, temperature=0.5, stop=["x"])
    assert spec(max_tokens=8, temperature=0.5, stop="x") is a  # the same request, another spelling
    others = [
        spec(max_tokens=8, temperature=0.5, stop=["y"]),
        spec(max_tokens=8, temperature=0.25, stop=["x"]),
        spec(max_completion_tokens=8, temperature=0.5, stop=["x"]),
        spec(temperature=0.5, stop=["x"]),
        spec(max_tokens=8, temperature=0.5, stop=["x"], seed=1),
    ]
    assert all(o is not a and o.params != a.params or o.names != a.names for o in others)
    assert parse_completion(body(prompt="Hi", max_tokens=8, temperature=0.5, stop=["x"])).sampling is not a


def test_messages_become_template_input():
    req = parse_chat_completion(
        body(
            messages=[
                {"role": "developer", "content": "Be brief.", "name": "ops"},
                {"role": "user", "content": [{"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"}]},
                {"role": "assistant", "content": None, "tool_calls": []},
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ]
        )
    )
    assert req.messages == [
        {"role": "developer", "content": "Be brief.", "name": "ops"},
        {"role": "user", "content": "line 1\nline 2"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert req.template is not None  # a tool's answer renders through apply_chat_template


def test_min_tokens_is_checked_against_what_the_context_leaves():
    req = parse_chat_completion(body(messages=HI, min_tokens=100))
    assert req.sampling.resolve([1] * 50, 200, 49152).max_new_tokens == 150
    with pytest.raises(APIError) as caught:
        req.sampling.resolve([1] * 150, 200, 49152)
    assert caught.value.param == "min_tokens"


@pytest.mark.parametrize(
    "prompt,prompts,batch",
    [
        ("a b", ("a b",), False),
        (["a", "b"], ("a", "b"), True),
        ([5, 6, 7], ([5, 6, 7],), False),
        ([[5], [6, 7]], ([5], [6, 7]), True),
    ],
)
def test_completion_prompt_forms(prompt, prompts, batch):
    assert parse_completion(body(prompt=prompt)).prompts == prompts
    assert parse_generate(body(text=prompt) if isinstance(prompts[0], str) else body(input_ids=prompt)).batch == batch


@pytest.mark.parametrize("prompt", [None, ""])
def test_a_missing_or_empty_prompt_is_refused_in_vllms_words(prompt):
    with pytest.raises(APIError) as caught:
        parse_completion(body(prompt=prompt, prompt_embeds=[]))
    assert (caught.value.param, caught.value.message) == (
        "prompt",
        "Either prompt or prompt_embeds must be provided and non-empty.",
    )


def test_completion_defaults_and_logprobs():
    req = parse_completion(body(prompt="x"))
    assert req.sampling.resolve([1], 8192, 49152).max_new_tokens == 16 and not req.echo
    top3 = parse_completion(body(prompt="x", logprobs=3, echo=False)).sampling.resolve([1], 8192, 49152)
    assert (top3.logprobs, top3.top_logprobs) == (True, 3)
    top0 = parse_completion(body(prompt="x", logprobs=0)).sampling.resolve([1], 8192, 49152)
    assert (top0.logprobs, top0.top_logprobs) == (True, 0)
    assert parse_completion(body(prompt="x", echo=True, best_of=1)).echo


def test_generate_speaks_sglang():
    req = parse_generate(
        body(
            text="hi",
            rid="abc",
            stream=True,
            return_logprob=True,
            top_logprobs_num=2,
            return_text_in_logprobs=True,
            sampling_params={
                "max_new_tokens": 5,
                "min_new_tokens": 1,
                "sampling_seed": 7,
                "temperature": 0.5,
                "stop": ["x"],
                "n": 1,
            },
        )
    )
    assert (req.prompts, req.rids, req.batch, req.stream, req.return_text_in_logprobs) == (
        ("hi",),
        ("abc",),
        False,
        True,
        True,
    )
    params = req.samplings[0].resolve([1], 8192, 49152)
    assert (params.max_new_tokens, params.min_new_tokens, params.seed, params.temperature, params.stop) == (
        5,
        1,
        7,
        0.5,
        ("x",),
    )
    assert (params.logprobs, params.top_logprobs) == (True, 2)
    default = parse_generate(body(input_ids=[1, 2]))
    assert default.samplings[0].resolve([1, 2], 8192, 49152).max_new_tokens == 128 and default.rids == (None,)
    assert parse_generate(body(text="hi", sampling_params={"n": 2})).batch  # n > 1 answers with a list
    # a list of sampling_params: one per prompt (SGLang's); each names its own fields
    two = parse_generate(body(text=["a", "b"], sampling_params=[{"max_new_tokens": 3}, {"max_new_tokens": 4}]))
    assert [s.resolve([1], 8192, 49152).max_new_tokens for s in two.samplings] == [3, 4]
    with pytest.raises(APIError) as caught:
        parse_generate(body(text=["a", "b"], sampling_params=[{}, {"temperature": -1}])).samplings[1].resolve(
            [1], 8192, 49152
        )
    assert caught.value.param == "sampling_params[1].temperature"
    for bad in ([{}], [{"n": 1}, {"n": 2}], "x"):
        with pytest.raises(APIError) as caught:
            parse_generate(body(text=["a", "b"], sampling_params=bad))
        assert caught.value.param == "sampling_params"


def test_generate_ignores_top_logprobs_num_without_return_logprob():
    params = parse_generate(body(text="hi", top_logprobs_num=5)).samplings[0].resolve([1], 8192, 49152)
    assert (params.logprobs, params.top_logprobs) == (False, 0)


def test_tokenize_detokenize_abort():
    assert parse_tokenize(body(prompt="hi")).prompts == ("hi",)
    tok = parse_tokenize(body(prompt=["a", ""], add_special_tokens=False, model="m"))
    assert (tok.prompts, tok.batch, tok.add_special_tokens, tok.model) == (("a", ""), True, False, "m")
    assert parse_detokenize(body(tokens=[1, 2])).token_ids == ([1, 2],)
    assert parse_detokenize(body(tokens=[[1], [2, 3]])).batch
    assert parse_abort(body(rid="r1")) == parse_abort(body(rid="r1", abort_all=False))
    assert parse_abort(body(abort_all=True)).abort_all


def test_unknown_fields_are_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="ringserve.httpapi"):
        parse_chat_completion(
            body(messages=HI, user="u", metadata={}, frobnicate=1, seed=None, top_k=None, unset_knob=None)
        )
        parse_generate(body(text="x", sampling_params={"no_such_knob": 1}))
    assert "frobnicate" in caplog.text and "sampling_params.no_such_knob" in caplog.text
    assert "user" not in caplog.text and "metadata" not in caplog.text
    # null reads as unset, known field or not
    assert "seed" not in caplog.text and "top_k" not in caplog.text and "unset_knob" not in caplog.text


@pytest.mark.parametrize(
    "max_tokens,prompt_len,expected", [(None, 100, 8092), (None, 8191, 1), (92, 8100, 92), (1, 8191, 1)]
)
def test_resolve_max_tokens(max_tokens, prompt_len, expected):
    assert resolve_max_tokens(max_tokens, prompt_len, 8192) == expected


@pytest.mark.parametrize("max_tokens,prompt_len", [(None, 8192), (93, 8100), (2, 8191)])
def test_resolve_max_tokens_past_the_context(max_tokens, prompt_len):
    with pytest.raises(APIError) as caught:
        resolve_max_tokens(max_tokens, prompt_len, 8192, "max_completion_tokens")
    assert (caught.value.status, caught.value.param, caught.value.code) == (
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    )


def test_resolve_takes_numpy_prompts():
    req = parse_completion(body(prompt=[1]))
    assert req.sampling.resolve(np.array([1, 2, 3], dtype=np.int32), 100, 10).max_new_tokens == 16
    with pytest.raises(APIError, match="out of vocabulary"):
        req.sampling.resolve(np.array([1, 10], dtype=np.int32), 100, 10)


def test_prompt_truncation_keeps_the_last_or_first_tokens():
    from httpapi.request_fields import PromptTruncation

    ids = list(range(10))
    assert PromptTruncation(3).apply(ids, 100) == [7, 8, 9]
    assert PromptTruncation(3, "right").apply(ids, 100) == [0, 1, 2]
    assert PromptTruncation(-1).apply(ids, 4) == [6, 7, 8, 9]  # the context's length
    assert PromptTruncation(20).apply(ids, 100) == ids


def test_logit_bias_errors_name_every_bad_key_and_the_vocabulary():
    """As vLLM's suite checks: all bad keys at once; an id out of vocabulary and the size."""
    with pytest.raises(APIError) as e:
        parse_chat_completion(body(messages=HI, logit_bias={"bad1": 50.0, "bad2": 20.0, "3": 1}))
    assert "'bad1'" in e.value.message and "'bad2'" in e.value.message and e.value.param == "logit_bias"
    req = parse_chat_completion(body(messages=HI, logit_bias={"60001": 1.0}))
    with pytest.raises(APIError) as e:
        req.sampling.resolve([1, 2], 100, 60000)
    assert "60001" in e.value.message and "60000" in e.value.message and "out of vocabulary" in e.value.message
