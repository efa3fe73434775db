"""vLLM's Decisions API (POST /v1/decisions) on a real server of the default model: vLLM's own
e2e checks (answers' shape, usage), each answer against a direct read of the same prompt's label
logprobs through /v1/chat/completions (logprob_token_ids), and the refusals: each a 400 naming
the field, before any work, never a 500."""

from __future__ import annotations

import math

import httpx
import orjson
import pytest
from bad_requests import API_KEY, MODEL

from httpapi.decisions import LABELS, parse_decisions, question_prompt

AUTH = {"authorization": f"Bearer {API_KEY}"}
INPUT = "The package arrived with a broken screen."
QUESTIONS = [
    {"type": "predicate", "instructions": "Is the screen broken?"},
    {
        "type": "choice",
        "name": "department",
        "instructions": "Which department should handle this?",
        "choices": [{"value": "returns"}, {"value": "billing", "description": "payments"}, {"value": True}],
    },
    {
        "type": "score",
        "name": "damage",
        "instructions": "Rate the damage.",
        "levels": [{"label": "undamaged"}, {"label": "scratched"}, {"label": "broken"}],
    },
]
BODY = {"model": MODEL, "input": INPUT, "questions": QUESTIONS}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.granian,
        workers=1,
        api_key=API_KEY,
        log_level="warning",
        max_total_tokens=16384,
        max_running_requests=16,
    )


def decide(server, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url("/v1/decisions"), json=body, headers=AUTH if headers is None else headers, timeout=120)


def test_answers_have_vllms_shape(server):
    r = decide(server, BODY)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"model", "answers", "usage"} and body["model"] == MODEL
    predicate, choice, score = body["answers"]
    assert predicate["type"] == "predicate" and predicate["name"] is None
    assert 0 <= predicate["probability"] <= 1
    assert choice["type"] == "choice" and choice["name"] == "department"
    assert [p["value"] for p in choice["probabilities"]] == ["returns", "billing", True]
    assert sum(p["probability"] for p in choice["probabilities"]) == pytest.approx(1)
    assert choice["choice"] == max(choice["probabilities"], key=lambda p: p["probability"])["value"]
    assert 0 < choice["confidence"] <= max(p["probability"] for p in choice["probabilities"])
    assert score["type"] == "score" and score["name"] == "damage"
    assert [p["label"] for p in score["probabilities"]] == ["undamaged", "scratched", "broken"]
    assert [p["value"] for p in score["probabilities"]] == [0, 1, 2]
    assert sum(p["probability"] for p in score["probabilities"]) == pytest.approx(1)
    assert score["score"] == pytest.approx(sum(p["value"] * p["probability"] for p in score["probabilities"]))
    usage = body["usage"]
    assert usage["output_tokens"] == 3
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert 0 <= usage["input_tokens_details"]["cached_tokens"] <= usage["input_tokens"]


def test_messages_input_reads_as_its_joined_text(server):
    """User messages with string content or input_text parts: their texts joined (a message's
    parts by a newline, the messages by a blank line) read as that text given as a string."""
    messages = [
        {"role": "user", "content": [{"type": "input_text", "text": "The package arrived"}]},
        {"type": "message", "role": "user", "content": "with a broken screen."},
    ]
    as_messages = decide(server, {**BODY, "input": messages}).json()
    as_text = decide(server, {**BODY, "input": "The package arrived\n\nwith a broken screen."}).json()
    assert probabilities(as_messages) == pytest.approx(probabilities(as_text), abs=1e-6)
    assert as_messages["usage"]["input_tokens"] == as_text["usage"]["input_tokens"]


def probabilities(body: dict) -> list[float]:
    """Every probability of a decision's answers, in order."""
    return [
        p
        for a in body["answers"]
        for p in ([a["probability"]] if "probability" in a else [x["probability"] for x in a["probabilities"]])
    ]


def direct_probabilities(server, tokenizer, question) -> tuple[list[float], int]:
    """The softmax of the question's label logprobs as the first token of a chat reply to its
    prompt, read through /v1/chat/completions' logprob_token_ids; and the prompt's tokens."""
    label_ids = tokenizer.convert_tokens_to_ids(list(question.labels))  # SmolLM2 has each capital letter
    r = httpx.post(
        server.url("/v1/chat/completions"),
        headers=AUTH,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": question_prompt(INPUT, question)}],
            "chat_template_kwargs": {"enable_thinking": False},
            "max_tokens": 1,
            "temperature": 0,
            "logprobs": True,
            "logprob_token_ids": label_ids,
            "return_tokens_as_token_ids": True,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    top = r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    by_id = {int(t["token"].removeprefix("token_id:")): t["logprob"] for t in top}
    logprobs = [by_id[i] for i in label_ids]
    weights = [math.exp(lp - max(logprobs)) for lp in logprobs]
    return [w / sum(weights) for w in weights], r.json()["usage"]["prompt_tokens"]


def test_probabilities_are_the_softmax_of_the_label_logprobs(server, tokenizer):
    body = decide(server, BODY).json()
    questions = parse_decisions(orjson.dumps(BODY)).questions
    input_tokens = 0
    for question, got in zip(questions, body["answers"]):
        want, prompt_tokens = direct_probabilities(server, tokenizer, question)
        input_tokens += prompt_tokens
        if question.kind == "predicate":
            assert got["probability"] == pytest.approx(want[1], abs=1e-5)
        else:
            assert [p["probability"] for p in got["probabilities"]] == pytest.approx(want, abs=1e-5)
        if question.kind == "score":
            assert got["score"] == pytest.approx(sum(i * p for i, p in enumerate(want)), abs=1e-5)
    assert body["usage"]["input_tokens"] == input_tokens


def test_a_question_of_26_choices_reads_every_label(server):
    choices = [{"value": f"option {i}"} for i in range(len(LABELS))]
    body = {**BODY, "questions": [{"type": "choice", "instructions": "Pick one.", "choices": choices}]}
    r = decide(server, body)
    assert r.status_code == 200, r.text
    assert len(r.json()["answers"][0]["probabilities"]) == len(LABELS)


def _question(**changes) -> dict:
    return {**QUESTIONS[1], **changes}


REFUSED = [
    (
        "image",
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
        "input[0]",
    ),
    ("joint", {"joint": True}, "joint"),
    ("too many questions", {"questions": [QUESTIONS[0]] * 201}, "questions"),
    ("more questions than this model reads", {"questions": [QUESTIONS[0]] * 65}, "questions"),
    ("no questions", {"questions": []}, "questions"),
    ("questions not a list", {"questions": {"a": QUESTIONS[0]}}, "questions"),
    ("unknown field", {"temperature": 0.5}, "temperature"),
    ("unknown question field", {"questions": [{**QUESTIONS[0], "criteria": None}]}, "questions[0].criteria"),
    (
        "too many choices",
        {"questions": [_question(choices=[{"value": str(i)} for i in range(256)])]},
        "questions[0].choices",
    ),
    (
        "more choices than labels",
        {"questions": [_question(choices=[{"value": str(i)} for i in range(27)])]},
        "questions[0].choices",
    ),
    ("one choice", {"questions": [_question(choices=[{"value": "a"}])]}, "questions[0].choices"),
    ("repeated choices", {"questions": [_question(choices=[{"value": "a"}, {"value": "a"}])]}, "questions[0].choices"),
    (
        "choice value a number",
        {"questions": [_question(choices=[{"value": 1}, {"value": "a"}])]},
        "questions[0].choices[0].value",
    ),
    ("too many levels", {"questions": [{**QUESTIONS[2], "levels": [{"label": "x"}] * 11}]}, "questions[0].levels"),
    ("instructions a number", {"questions": [_question(instructions=3)]}, "questions[0].instructions"),
    ("no instructions", {"questions": [{"type": "predicate"}]}, "questions[0].instructions"),
    ("unknown type", {"questions": [{"type": "noul", "instructions": "x"}]}, "questions[0].type"),
    ("input a number", {"input": 3}, "input"),
    ("assistant message", {"input": [{"role": "assistant", "content": "x"}]}, "input[0].role"),
    ("joint a string", {"joint": "yes"}, "joint"),
    ("cache_salt", {"cache_salt": "salt"}, "cache_salt"),
    ("safety_identifier too long", {"safety_identifier": "x" * 129}, "safety_identifier"),
    ("model a number", {"model": 1}, "model"),
]


@pytest.mark.parametrize(("changes", "param"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refusals_name_the_field(server, changes, param):
    r = decide(server, {**BODY, **changes})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_an_image_is_refused_as_vllm_words_it(server):
    """vLLM's e2e test: "text input only" in the message."""
    r = decide(server, {**BODY, **REFUSED[0][1]})
    assert r.status_code == 400 and "text input only" in r.json()["error"]["message"]


# a generation prompt that ends in a space: a label after it joins the space's token (" A")
WORD_ENDED_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\nAnswer: "
)


def test_a_label_that_is_not_one_token_names_the_question(start_server):
    """Where the labels do not each add one token after the chat prompt, the read cannot be
    made: a 400 naming the question (vLLM's words), no engine request."""
    server = start_server(
        start_server.Server.granian,
        workers=1,
        api_key=API_KEY,
        log_level="warning",
        chat_template=WORD_ENDED_TEMPLATE,
    )
    r = decide(server, BODY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "questions[0]", r.text
    assert "is not one distinct token after this model's chat prompt" in r.json()["error"]["message"]


def test_model_and_key_are_checked_as_elsewhere(server):
    assert decide(server, {**BODY, "model": "other"}).status_code == 404
    assert decide(server, {k: v for k, v in BODY.items() if k != "model"}).status_code == 200
    assert decide(server, BODY, headers={}).status_code == 401
    for nothing in ({"cache_salt": None}, {"safety_identifier": "user-1"}, {"joint": False}):
        assert decide(server, {**BODY, **nothing}).status_code == 200
