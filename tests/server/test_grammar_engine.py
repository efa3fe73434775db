"""Constrained decoding and logit_bias in the engine, on the real model (SmolLM2-135M, CPU)
through the OfflineEngine and its Scheduler: JSON schemas, regexes and EBNF give outputs
that match, greedy and sampled, n > 1; a constrained request leaves its unconstrained
neighbours' tokens alone; retraction keeps each matcher right; a grammar that fails, or a
disabled backend, ends its request with an ERROR and nothing else; a compile in progress
never holds up other requests' steps; the null model honours the mask."""

from __future__ import annotations

import dataclasses
import json
import re
import threading

import jsonschema
import numpy as np
import pytest
import regex

from protocol.records import NO_TOKEN, ErrorCode, Finish, TokenKind
from protocol.sampling_params import GrammarKind, SamplingParams
from runtime.offline import OfflineEngine
from runtime.scheduler.core import Scheduler
from runtime.scheduler.grammar import DISABLED_MESSAGE
from runtime.scheduler.req import ReqStatus

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "student": {"type": "boolean"},
    },
    "required": ["name", "age", "student"],
}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}
LIST = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}},
    "required": ["items"],
}
ASK = "Reply in JSON. Describe a {}."
TEXT = (
    "The history of the city goes back to a small fishing village on the river, where traders "
    "from the north came every spring to exchange furs for salt and grain. Over the centuries the "
    "village grew into a market town, then into a busy port with shipyards, warehouses and a "
    "cathedral whose bells could be heard far out at sea. In the nineteenth century the railway "
    "arrived, factories rose along the canals, and the population doubled within a single generation."
)


def json_params(schema: dict, **kw) -> SamplingParams:
    kw.setdefault("max_new_tokens", 40)
    return SamplingParams(grammar_kind=GrammarKind.JSON_SCHEMA, grammar=json.dumps(schema), **kw)


def regex_params(pattern: str, **kw) -> SamplingParams:
    kw.setdefault("max_new_tokens", 24)
    return SamplingParams(grammar_kind=GrammarKind.REGEX, grammar=pattern, **kw)


def chat_ids(engine: OfflineEngine, text: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)


@pytest.fixture(scope="module")
def engine() -> OfflineEngine:
    # a small KV pool and eager admission: a handful of requests is enough to retract some
    return OfflineEngine(
        max_total_tokens=512,
        max_running_requests=8,
        scheduler_overrides={"init_new_token_ratio": 0.0, "min_new_token_ratio": 0.0},
    )


def drive(sched: Scheduler, until=None) -> dict[tuple[int, int], dict]:
    """Steps until nothing is left (or until(outs) is true): per (worker, slot), its tokens,
    finish, event kind and error code."""
    outs: dict[tuple[int, int], dict] = {}
    while sched.has_work and not (until and until(outs)):
        if sched.only_compiling:
            sched.wait_for_grammar(10)
        for e in sched.step().events:
            o = outs.setdefault((int(e["worker"]), int(e["slot"])), {"tokens": [], "finish": Finish.NONE})
            if int(e["token"]) != NO_TOKEN:
                o["tokens"].append(int(e["token"]))
            o["finish"], o["kind"], o["error"] = Finish(int(e["finish"])), int(e["kind"]), int(e["error"])
    return outs


def test_json_schemas_greedy_sampled_and_n(engine):
    prompts = [chat_ids(engine, ASK.format(w)) for w in ("person", "flag", "list of numbers")]
    greedy = [json_params(s, temperature=0.0) for s in (PERSON, COLOR, LIST)]
    sampled = json_params(PERSON, temperature=0.9)  # unseeded: the n choices sample apart
    outs = engine.generate(prompts + [prompts[0]] * 2, greedy + [sampled] * 2)  # n = 2 of one schema
    for o, schema in zip(outs, [PERSON, COLOR, LIST] + [PERSON] * 2):
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), schema)
        assert o.token_ids[-1] in engine.runner.model_config.eos_token_ids
    assert len({o.text for o in outs[3:]}) > 1  # sampled apart
    assert engine.generate(prompts[0], greedy[0])[0].token_ids == outs[0].token_ids  # alone: the same


def test_regex_and_ebnf_outputs_match(engine):
    date = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"
    word = r"[A-Z][a-z]{2,8}( [a-z]{2,8}){0,2}\."
    ebnf = 'root ::= answer " because " reason "."\nanswer ::= "yes" | "no"\nreason ::= [a-z]+ (" " [a-z]+)?'
    ebnf_re = r"(yes|no) because [a-z]+( [a-z]+)?\."
    params = [
        regex_params(date, temperature=0.0),
        regex_params(date, temperature=1.0, seed=3),
        regex_params(word, temperature=0.7, seed=11),
        SamplingParams(grammar_kind=GrammarKind.EBNF, grammar=ebnf, temperature=0.0, max_new_tokens=24),
    ]
    prompts = ["The treaty was signed on", "Born on", "A short sentence:", "Is the sky blue? Answer:"]
    outs = engine.generate(prompts, params)
    for o, pattern in zip(outs, [date, date, word, ebnf_re]):
        assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), (o.text, pattern)


def test_constrained_rows_leave_unconstrained_greedy_rows_unchanged(engine):
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    free = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    alone = [o.token_ids for o in engine.generate(texts, free)]
    mixed = engine.generate(
        [texts[0], "My phone number is", texts[1], ASK.format("person"), texts[2]],
        [free, regex_params(r"\d{3}-\d{4}", temperature=0.8), free, json_params(COLOR, temperature=0.0), free],
    )
    assert [mixed[i].token_ids for i in (0, 2, 4)] == alone
    assert re.fullmatch(r"\d{3}-\d{4}", mixed[1].text)


def is_prefix(pattern: str, text: str) -> bool:
    """`text` can still become a full match of `pattern`."""
    return regex.fullmatch(pattern, text, partial=True) is not None


def test_retraction_keeps_each_matcher_right(engine):
    sched = engine.scheduler
    sentence = r"([a-z]+ ){20}[a-z]+\."
    params = regex_params(sentence, temperature=0.0, max_new_tokens=40)
    # 8 prompts of 4 full pages each, nothing shared, in a 32-page pool: the six or so admitted
    # need two more pages each within their first 17 tokens, so the newest are retracted
    ids = engine.tokenizer.encode(TEXT)
    prompts = [ids[3 * i : 3 * i + 64] for i in range(8)]
    assert all(len(p) == 64 for p in prompts)
    alone = engine.generate(prompts[-1], params)[0]
    engine.flush_cache()
    before = sched.stats.retractions
    outs = engine.generate(prompts, params)
    assert sched.stats.retractions > before
    for o in outs:  # in the language, or (out of tokens) a prefix of it: greedy may wander in one
        assert re.fullmatch(sentence, o.text) if o.finish_reason == "stop" else is_prefix(sentence, o.text), o.text
    assert outs[-1].token_ids == alone.token_ids  # the newest, retracted first: the same greedy tokens


def test_a_grammar_that_fails_to_compile_ends_with_an_error(engine):
    bad = json_params({"type": "objectx"})
    outs = engine.generate(
        ["Hello", "Hello", "Hello"],
        [bad, regex_params("(unclosed"), SamplingParams(temperature=0.0, max_new_tokens=3)],
    )
    assert [o.finish_reason for o in outs] == ["error", "error", "length"]
    assert outs[0].error.startswith("grammar: ") and "objectx" in outs[0].error
    assert outs[1].error.startswith("grammar: ") and "parenthes" in outs[1].error
    # the failure is cached: sent again, it fails the same way without a compile
    assert engine.generate("Hello", bad)[0].error == outs[0].error
    o = engine.generate("Hello", regex_params("(yes|no)", temperature=0.0))[0]
    assert o.finish_reason == "stop" and o.text in ("yes", "no")
    assert not engine.scheduler.has_work and engine.scheduler.num_constrained == 0


def test_a_slow_compile_does_not_hold_up_other_requests(engine):
    sched = engine.scheduler
    gate = threading.Event()
    blocker = sched.grammar.executor.submit(gate.wait)  # the pool's one thread is busy
    try:
        prompt = engine.tokenizer.encode("Count: one, two,")
        sched.add_request(1, 0, 1, prompt, regex_params(r" three, four, (five|six)", temperature=0.0))
        sched.add_request(1, 1, 1, prompt, regex_params(r" (seven|eight)", temperature=0.0))
        sched.add_request(1, 2, 1, prompt, SamplingParams(temperature=0.0, max_new_tokens=6))
        waiting = sched.requests[(1, 0)]
        outs = drive(sched, until=lambda outs: outs.get((1, 2), {}).get("finish"))
        assert outs[(1, 2)]["finish"] == Finish.LENGTH and len(outs[(1, 2)]["tokens"]) == 6
        assert (1, 0) not in outs and waiting.status is ReqStatus.COMPILING and sched.has_work
        assert sched.abort(1, 1, 1)  # a waiting request can be aborted
        assert drive(sched, until=lambda outs: (1, 1) in outs)[(1, 1)]["finish"] == Finish.ABORT
        assert [r.key for r in sched.compiling] == [(1, 0)] and sched.only_compiling
    finally:
        gate.set()
    blocker.result()
    out = drive(sched)[(1, 0)]
    assert out["finish"] == Finish.STOP
    text = engine.tokenizer.decode(out["tokens"], skip_special_tokens=True)
    assert re.fullmatch(r" three, four, (five|six)", text)
    # a worker gone: abort_where ends its waiting requests too
    gate2 = threading.Event()
    blocker = sched.grammar.executor.submit(gate2.wait)
    try:
        sched.add_request(1, 3, 1, prompt, regex_params(r"[0-9]{5}"))
        assert sched.abort_where(lambda r: r.worker == 1) == 1 and not sched.compiling
    finally:
        gate2.set()
    assert drive(sched)[(1, 3)]["finish"] == Finish.ABORT and not sched.has_work


def test_logit_bias_forces_or_forbids_a_token(engine):
    prompt = "The capital of France is"
    base = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=2))[0].token_ids
    forced = engine.tokenizer.encode(" banana")[0]
    o = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=2, logit_bias=((forced, 100.0),)))[0]
    assert o.token_ids == [forced, forced]
    o = engine.generate(prompt, SamplingParams(temperature=0.0, max_new_tokens=2, logit_bias=((base[0], -100.0),)))[0]
    assert o.token_ids[0] != base[0]
    # beside a grammar: the bias cannot take a token the grammar forbids
    o = engine.generate(prompt, regex_params("(yes|no)", temperature=0.0, logit_bias=((forced, 100.0),)))[0]
    assert o.text in ("yes", "no")


@pytest.fixture(scope="module")
def null_engine() -> OfflineEngine:
    return OfflineEngine(null_model=True, max_total_tokens=2048, max_running_requests=8)


def test_null_model_honours_the_mask(null_engine):
    free = SamplingParams(max_new_tokens=6)
    outs = null_engine.generate(
        ["a", "b", "c"],
        [regex_params(r"[0-9]{3}-[a-z]{2}"), json_params(COLOR), free],
    )
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0].text) and outs[0].finish_reason == "stop"
    assert json.loads(outs[1].text)["color"] in ("red", "green", "blue") and outs[1].finish_reason == "stop"
    assert outs[2].token_ids == null_engine.runner.cycle[:6].tolist()  # the unconstrained row: its cycle
    # where the grammar allows the cycle's tokens, they are taken
    first = null_engine.tokenizer.decode(null_engine.runner.cycle[:2])
    o = null_engine.generate("d", regex_params(re.escape(first) + "!"))[0]
    assert o.text == first + "!" and o.token_ids[:2] == null_engine.runner.cycle[:2].tolist()


def test_grammar_backend_none_ends_constrained_requests_with_an_error(null_engine):
    config = dataclasses.replace(null_engine.scheduler.config, grammar_backend="none")
    sched = Scheduler(null_engine.runner, config)
    sched.add_request(0, 0, 1, np.array([1, 2, 3]), regex_params("[0-9]+"))
    sched.add_request(0, 1, 1, np.array([1, 2, 3]), SamplingParams(max_new_tokens=2))
    res = sched.step()
    (err,) = np.flatnonzero(res.events["kind"] == TokenKind.ERROR)
    assert res.events["slot"][err] == 0 and res.events["error"][err] == ErrorCode.INVALID_REQUEST
    assert [r.error for r in res.failed] == [DISABLED_MESSAGE]
    assert drive(sched)[(0, 1)]["finish"] == Finish.LENGTH
