"""The OfflineEngine on the real model: prompt forms, finish reasons (EOS, ignore_eos,
stop token ids, stop strings, length), usage with cached tokens, logprobs, a thinking budget,
bad input."""

from __future__ import annotations

import pytest

from protocol.sampling_params import InvalidParam, SamplingParams
from runtime.offline import OfflineEngine

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
QUESTION = [{"role": "user", "content": "What is 2+2? Answer with one number only."}]


@pytest.fixture(scope="module")
def engine() -> OfflineEngine:
    return OfflineEngine(max_total_tokens=4096, max_running_requests=8)


def test_prompt_forms_and_outputs_in_order(engine):
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    outs = engine.generate(texts, GREEDY)
    assert [o.prompt_token_ids for o in outs] == [engine.tokenizer.encode(t) for t in texts]
    for o in outs:
        assert o.finish_reason == "length" and len(o.token_ids) == 8 and o.completion_tokens == 8
        assert o.text == engine.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert o.prompt_tokens == len(o.prompt_token_ids)
    # one string, one list of ids, a list of id lists: the same greedy tokens
    ids = outs[1].prompt_token_ids
    short = SamplingParams(temperature=0.0, max_new_tokens=3)
    assert engine.generate(texts[1], short)[0].token_ids == outs[1].token_ids[:3]
    assert engine.generate(ids, short)[0].token_ids == outs[1].token_ids[:3]
    both = engine.generate([ids, outs[0].prompt_token_ids], [GREEDY, short])
    assert both[0].token_ids == outs[1].token_ids and both[1].token_ids == outs[0].token_ids[:3]


def test_eos_ignore_eos_and_cached_tokens(engine):
    first = engine.chat(QUESTION, SamplingParams(temperature=0.0, max_new_tokens=16))[0]
    assert first.finish_reason == "stop" and first.token_ids[-1] in engine.runner.model_config.eos_token_ids
    # what it answers is the model's near tie: the exact mode (--quantization none) says "4", the
    # default gguf-q8 "Two is a positive integer."
    assert first.text and "<|im_end|>" not in first.text
    kept = engine.chat(QUESTION, SamplingParams(temperature=0.0, max_new_tokens=16, skip_special_tokens=False))[0]
    assert kept.text == first.text  # EOS ends the text without being in it, special tokens kept or not
    again = engine.chat(QUESTION, SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True))[0]
    assert again.finish_reason == "length" and len(again.token_ids) == 16
    assert again.token_ids[: len(first.token_ids)] == first.token_ids
    assert again.cached_tokens >= 16 and again.cached_tokens % 16 == 0 and again.cached_tokens < again.prompt_tokens


def test_stop_token_ids_and_stop_strings(engine):
    base = engine.generate("The capital of France is", SamplingParams(temperature=0.0, max_new_tokens=12))[0]
    stop_id = base.token_ids[3]
    cut = base.token_ids.index(stop_id)
    o = engine.generate(
        "The capital of France is", SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop_id,))
    )[0]
    assert o.finish_reason == "stop" and o.token_ids == base.token_ids[: cut + 1]
    assert o.text == engine.tokenizer.decode(base.token_ids[:cut])  # a stop token's text is not output
    o = engine.generate(
        "The capital of France is",
        SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop_id,), no_stop_trim=True),
    )[0]
    assert o.text == engine.tokenizer.decode(base.token_ids[: cut + 1])  # unless no_stop_trim
    word = base.text.split()[2]
    o = engine.generate("The capital of France is", SamplingParams(temperature=0.0, max_new_tokens=12, stop=(word,)))[0]
    assert o.finish_reason == "stop" and o.text == base.text[: base.text.index(word)]
    a = base.text.index(word)  # of two matches, the one that ends first wins (as in the server)
    two = (base.text[a : a + 8], base.text[a + 2 : a + 4])
    o = engine.generate("The capital of France is", SamplingParams(temperature=0.0, max_new_tokens=12, stop=two))[0]
    assert o.finish_reason == "stop" and o.text == base.text[: a + 2]
    assert base.finish_reason == "length"  # no stop string ends in the first min_new_tokens tokens' text
    o = engine.generate(
        "The capital of France is", SamplingParams(temperature=0.0, max_new_tokens=12, stop=(word,), min_new_tokens=12)
    )[0]
    assert (o.finish_reason, o.text) == ("length", base.text)
    # a stop string completed by the last token max_new_tokens allows ends the request with "stop"
    last = engine.tokenizer.decode(base.token_ids[5:6])
    o = engine.generate("The capital of France is", SamplingParams(temperature=0.0, max_new_tokens=6, stop=(last,)))[0]
    head = engine.tokenizer.decode(base.token_ids[:6])
    assert (o.finish_reason, o.text) == ("stop", head[: head.index(last)])
    assert engine.scheduler.num_running == 0 and not engine.scheduler.has_work


def test_a_thinking_budget_forces_the_reasoning_end(engine):
    """vLLM's thinking_token_budget through the scheduler and the sampler: the answer's first
    `budget` tokens are the model's own (greedy: as without a budget), then `</think>` is forced,
    then the model goes on; the n-gram speculation of this engine leaves such a request alone."""
    end = tuple(engine.tokenizer.encode("</think>", add_special_tokens=False))
    free = engine.chat(QUESTION, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))[0]
    budgeted = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, thinking_budget=4, think_end_ids=end)
    o = engine.chat(QUESTION, budgeted)[0]
    assert o.token_ids[:4] == free.token_ids[:4]
    assert tuple(o.token_ids[4 : 4 + len(end)]) == end and "</think>" in o.text


def test_logprobs(engine):
    o = engine.generate(
        "Once upon a time", SamplingParams(temperature=0.0, max_new_tokens=4, logprobs=True, top_logprobs=3)
    )[0]
    assert len(o.logprobs) == 4 and all(lp <= 0.0 for lp in o.logprobs)
    assert len(o.top_logprobs) == 4
    for token, lp, top in zip(o.token_ids, o.logprobs, o.top_logprobs):
        assert len(top) == 3 and max(top, key=top.get) == token and top[token] == pytest.approx(lp)


def test_bad_input_raises_naming_the_parameter(engine):
    with pytest.raises(InvalidParam) as err:
        engine.generate("hi", SamplingParams(temperature=-1.0))
    assert err.value.param == "temperature"
    with pytest.raises(InvalidParam) as err:
        engine.generate(["a", "b"], [GREEDY])
    assert err.value.param == "sampling_params"
    with pytest.raises(InvalidParam) as err:
        engine.generate([])
    assert err.value.param == "prompt"
    # a prompt the context cannot hold is an error output, not an exception
    too_long = engine.generate([1] * engine.runner.model_config.context_length, GREEDY)[0]
    assert too_long.finish_reason == "error" and too_long.token_ids == []
    assert engine.runner.pool.num_free + engine.scheduler.cache.cached_pages == engine.runner.pool.num_pages


def test_more_prompts_than_the_detokenizer_holds():
    """generate() with more prompts than the Engine's detokenizer was built for (256): it grows,
    and every text is still its tokens' decode (null model: instant tokens)."""
    engine = OfflineEngine(null_model=True, max_total_tokens=65536, max_running_requests=64)
    params = SamplingParams(temperature=0.0, max_new_tokens=3)
    for n in (1, 300, 5):
        outs = engine.generate([[1, 2, 3 + k] for k in range(n)], params)
        assert [o.completion_tokens for o in outs] == [3] * n
        assert [o.text for o in outs] == [engine.tokenizer.decode(o.token_ids) for o in outs]
