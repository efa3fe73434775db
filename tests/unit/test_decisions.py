"""The Decisions API's body, prompts and answers (httpapi/decisions.py), and the reply's label
tokens (runtime/http_worker/decisions_routes.py) on the default model's tokenizer."""

from __future__ import annotations

import asyncio
import math

import orjson
import pytest

from httpapi.decisions import (
    LABELS,
    MAX_QUESTIONS,
    MAX_READ_QUESTIONS,
    Option,
    answer,
    decisions_body,
    parse_decisions,
    question_prompt,
)
from httpapi.errors import APIError
from httpapi.openapi import OPERATIONS, body_schema
from runtime.http_worker.decisions_routes import _reply_label_ids

PREDICATE = {"type": "predicate", "instructions": "Is it broken?"}
CHOICE = {
    "type": "choice",
    "name": "team",
    "instructions": "Who handles it?",
    "choices": [{"value": "returns", "description": "sends it back"}, {"value": False}],
}
SCORE = {"type": "score", "instructions": "How bad?", "levels": [{"label": "fine"}, {"label": "broken"}]}
BODY = {"model": "m", "input": "The screen is broken.", "questions": [PREDICATE, CHOICE, SCORE]}


def parse(**changes):
    return parse_decisions(orjson.dumps({**BODY, **changes}))


def refused(**changes) -> APIError:
    with pytest.raises(APIError) as err:
        parse(**changes)
    assert err.value.status == 400
    return err.value


def test_questions_become_labelled_options():
    req = parse()
    assert req.model == "m" and req.text == "The screen is broken."
    predicate, choice, score = req.questions
    assert predicate.options == (Option("false"), Option("true")) and predicate.name is None
    # a choice's value is written as its JSON, so a boolean reads unlike the string "false"
    assert choice.options == (Option('"returns"', "sends it back"), Option("false"))
    assert choice.values == ("returns", False) and choice.name == "team"
    assert score.options == (Option("fine"), Option("broken")) and score.labels == ("A", "B")


def test_the_prompt_is_vllms():
    choice = parse().questions[1]
    assert question_prompt("The screen is broken.", choice) == (
        "The screen is broken.\n\nQuestion: Who handles it?\n"
        'A: "returns" - sends it back\nB: false\nAnswer with the letter of one option only.'
    )
    untitled = parse(questions=[{**PREDICATE, "instructions": ""}]).questions[0]
    assert question_prompt("x", untitled) == "x\n\nA: false\nB: true\nAnswer with the letter of one option only."


def test_messages_join_as_vllm_joins_them():
    messages = [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "user", "content": "c"},
    ]
    assert parse(input=messages).text == "a\nb\n\nc"


def test_answers_are_the_labels_softmax():
    predicate, choice, score = parse().questions
    lps = [math.log(0.2), math.log(0.6)]  # the labels hold 0.8 of the vocabulary's mass
    assert answer(predicate, lps) == {"type": "predicate", "name": None, "probability": pytest.approx(0.75)}
    got = answer(choice, lps)
    assert got["choice"] is False and got["confidence"] == pytest.approx(0.6)
    assert [p["value"] for p in got["probabilities"]] == ["returns", False]
    assert [p["probability"] for p in got["probabilities"]] == pytest.approx([0.25, 0.75])
    got = answer(score, lps)
    assert got["score"] == pytest.approx(0.75) and got["confidence"] == pytest.approx(0.6)
    assert got["probabilities"][1] == {"value": 1, "label": "broken", "probability": pytest.approx(0.75)}
    # far below any float's exp: the softmax is taken relative to the largest
    assert answer(predicate, [-2000.0, -2000.0 + math.log(3)])["probability"] == pytest.approx(0.75)


def test_usage_counts_one_output_token_a_read():
    body = orjson.loads(decisions_body("m", [{"type": "predicate"}] * 3, 100, 40))
    assert body["usage"] == {
        "input_tokens": 100,
        "input_tokens_details": {"cached_tokens": 40},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 103,
    }


def choices(n: int) -> dict:
    return {**CHOICE, "choices": [{"value": str(i)} for i in range(n)]}


REFUSED = [
    ("no input", {"input": None}, "input"),
    ("input a number", {"input": 1}, "input"),
    ("input too long", {"input": "x" * ((10 << 20) + 1)}, "input"),
    ("image", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0]"),
    ("second message's image", {"input": ["x", {"content": [{"type": "input_image"}]}]}, "input[0]"),
    ("message not an object", {"input": ["x"]}, "input[0]"),
    ("system message", {"input": [{"role": "system", "content": "x"}]}, "input[0].role"),
    ("no role", {"input": [{"content": "x"}]}, "input[0].role"),
    (
        "part of another type",
        {"input": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
        "input[0].content[0].type",
    ),
    (
        "part without text",
        {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        "input[0].content[0].text",
    ),
    ("message field", {"input": [{"role": "user", "content": "x", "name": "n"}]}, "input[0].name"),
    ("no questions", {"questions": None}, "questions"),
    ("empty questions", {"questions": []}, "questions"),
    ("over vLLM's bound", {"questions": [PREDICATE] * (MAX_QUESTIONS + 1)}, "questions"),
    ("over the reads' bound", {"questions": [PREDICATE] * (MAX_READ_QUESTIONS + 1)}, "questions"),
    ("question a string", {"questions": ["x"]}, "questions[0].type"),
    ("unknown type", {"questions": [{**PREDICATE, "type": "noul"}]}, "questions[0].type"),
    ("type a list", {"questions": [{**PREDICATE, "type": []}]}, "questions[0].type"),
    ("no instructions", {"questions": [{"type": "predicate"}]}, "questions[0].instructions"),
    ("instructions a list", {"questions": [{**PREDICATE, "instructions": ["x"]}]}, "questions[0].instructions"),
    ("name null", {"questions": [{**PREDICATE, "name": None}]}, "questions[0].name"),
    ("name too long", {"questions": [{**PREDICATE, "name": "x" * ((1 << 20) + 1)}]}, "questions[0].name"),
    ("predicate's choices", {"questions": [{**PREDICATE, "choices": []}]}, "questions[0].choices"),
    ("one choice", {"questions": [choices(1)]}, "questions[0].choices"),
    ("256 choices", {"questions": [choices(256)]}, "questions[0].choices"),
    ("27 choices", {"questions": [choices(len(LABELS) + 1)]}, "questions[0].choices"),
    ("choices an object", {"questions": [{**CHOICE, "choices": {"a": 1}}]}, "questions[0].choices"),
    (
        "choice without value",
        {"questions": [{**CHOICE, "choices": [{"description": "x"}, {"value": "a"}]}]},
        "questions[0].choices[0].value",
    ),
    (
        "choice value a number",
        {"questions": [{**CHOICE, "choices": [{"value": 1}, {"value": "a"}]}]},
        "questions[0].choices[0].value",
    ),
    (
        "choice field",
        {"questions": [{**CHOICE, "choices": [{"value": "a", "label": "A"}, {"value": "b"}]}]},
        "questions[0].choices[0].label",
    ),
    (
        "repeated values",
        {"questions": [{**CHOICE, "choices": [{"value": True}, {"value": True}]}]},
        "questions[0].choices",
    ),
    ("11 levels", {"questions": [{**SCORE, "levels": [{"label": "x"}] * 11}]}, "questions[0].levels"),
    ("level without label", {"questions": [{**SCORE, "levels": [{}, {"label": "x"}]}]}, "questions[0].levels[0].label"),
    (
        "description a number",
        {"questions": [{**SCORE, "levels": [{"label": "a", "description": 1}, {"label": "b"}]}]},
        "questions[0].levels[0].description",
    ),
    ("unknown field", {"temperature": 0}, "temperature"),
    ("null unknown field", {"instructions": None}, "instructions"),
    ("model a number", {"model": 1}, "model"),
    ("joint", {"joint": True}, "joint"),
    ("joint a string", {"joint": "true"}, "joint"),
    ("cache_salt", {"cache_salt": "salt"}, "cache_salt"),
    ("safety_identifier a number", {"safety_identifier": 1}, "safety_identifier"),
    ("safety_identifier too long", {"safety_identifier": "x" * 129}, "safety_identifier"),
]


@pytest.mark.parametrize(("changes", "param"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refusals_name_the_field(changes, param):
    assert refused(**changes).param == param


def test_an_image_is_refused_in_vllms_words():
    image = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}
    assert "text input only" in refused(**image).message


def test_what_asks_nothing_is_taken():
    assert parse(cache_salt=None, joint=False, safety_identifier="user-1", model=None).model is None
    assert len(parse(questions=[PREDICATE] * MAX_READ_QUESTIONS).questions) == MAX_READ_QUESTIONS
    assert len(parse(questions=[choices(len(LABELS))]).questions[0].labels) == len(LABELS)


class _Tokens:
    """The TokenizerManager's encode and decode, on a tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))


def test_each_label_is_one_token_after_the_generation_prompt(tokenizer):
    tm = _Tokens(tokenizer)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(chat, add_special_tokens=False)
    known: dict = {}
    got = asyncio.run(_reply_label_ids(tm, ids, known))
    assert got == tokenizer.convert_tokens_to_ids(list(LABELS))
    assert len(known) == 1  # the tail after <|im_start|>: "assistant\n"
    # ending in a space, the prompt's last token is the space, and " A" one token with it: no label
    spaced = tokenizer.encode(chat + "Answer: ", add_special_tokens=False)
    assert asyncio.run(_reply_label_ids(tm, spaced, known)) == [None] * len(LABELS)


def test_the_openapi_document_closes_the_body():
    """The document says what the parser takes: input and questions required, no other field."""
    op = OPERATIONS["/v1/decisions"]["POST"]
    schema = body_schema(op.parse, op.examples, op.closed)
    assert schema["required"] == ["input", "questions"] and schema["additionalProperties"] is False
    assert set(schema["properties"]) == {"model", "input", "questions", "safety_identifier", "joint", "cache_salt"}
