"""vLLM's Decisions API (POST /v1/decisions, vLLM 0.33's NextTokenStrategy): the request body,
each question's prompt and labels, and the answer built from its labels' log-probabilities.

A question is one read: the user turn is the input, then the question with one labelled line
per option (A, B, ...), and the read is the log-probability of each label as the reply's first
token (runtime/http_worker/decisions_routes.py). The labels' softmax is the answer's
probabilities. The body is checked as vLLM's schema checks it (its bounds, strict types, no
unknown fields), every list and text bounded before any tokenizing; docs/decisions.md says
what each answer field means."""

from __future__ import annotations

import json
import math
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from httpapi.errors import bad_request
from httpapi.fields import Fields, load_object
from httpapi.request_fields import REFUSED_OPENAI, refuse_unserved

# vLLM's schema bounds (protocol.py)
MAX_QUESTIONS = 200
MAX_CHOICES = 255
MIN_OPTIONS = 2
MAX_LEVELS = 10
SHORT_TEXT_CHARS = 1 << 20  # instructions, names, descriptions, labels, choice values, model
INPUT_TEXT_CHARS = 10 << 20  # the input, and each of its texts
MAX_INPUT_MESSAGES = 131072
MAX_MESSAGE_PARTS = 16384
SAFETY_IDENTIFIER_CHARS = 128
# A choice labels its options A to Z, so a question has at most 26 options, and a request at
# most 64 reads: vLLM's NextTokenStrategy limits, which it answers with a 400 past them.
LABELS = tuple(string.ascii_uppercase)
MAX_READ_QUESTIONS = 64
REPLY_INSTRUCTION = "Answer with the letter of one option only."
IMAGES_REFUSED = "Decisions supports text input only; images are not supported"

_REQUEST_FIELDS = frozenset({"model", "input", "questions", "safety_identifier", "joint", "cache_salt"})
_QUESTION_FIELDS = {
    "predicate": frozenset({"type", "instructions", "name"}),
    "choice": frozenset({"type", "instructions", "name", "choices"}),
    "score": frozenset({"type", "instructions", "name", "levels"}),
}
_CHOICE_FIELDS = frozenset({"value", "description"})
_LEVEL_FIELDS = frozenset({"label", "description"})
_MESSAGE_FIELDS = frozenset({"role", "content", "type"})
_PART_FIELDS = frozenset({"type", "text"})


@dataclass(frozen=True)
class Option:
    """One labelled line of a question's prompt: `text`, then ` - description` if any."""

    text: str
    description: str = ""


@dataclass(frozen=True)
class Question:
    kind: str  # predicate, choice or score
    name: str | None
    instructions: str
    options: tuple[Option, ...]
    values: tuple[str | bool, ...]  # a choice's values, a score's level labels (a predicate: none)

    @property
    def labels(self) -> tuple[str, ...]:
        return LABELS[: len(self.options)]


@dataclass(frozen=True)
class DecisionRequest:
    model: str | None
    text: str  # the input, its messages' texts joined
    questions: tuple[Question, ...]


def parse_decisions(body: bytes) -> DecisionRequest:
    """vLLM's DecisionRequest: model, input, questions, and safety_identifier, joint and
    cache_salt. Any other field is a 400 naming it, as vLLM's schema forbids extras."""
    f = Fields(load_object(body))
    _refuse_unknown(f, _REQUEST_FIELDS)
    model = _short(f, "model")
    text = _input(f.raw("input"))
    raw = f.raw("questions")
    if type(raw) is not list or not raw:
        raise bad_request("questions must be a non-empty list of questions", "questions")
    if len(raw) > MAX_QUESTIONS:
        raise bad_request(f"questions has {len(raw)} questions; at most {MAX_QUESTIONS} are taken", "questions")
    if len(raw) > MAX_READ_QUESTIONS:
        raise bad_request(f"questions: at most {MAX_READ_QUESTIONS} for this model", "questions")
    questions = tuple(_question(item, f"questions[{i}]") for i, item in enumerate(raw))
    safety_identifier = f.get_str("safety_identifier")  # the caller's metadata: it changes no answer
    if safety_identifier is not None and len(safety_identifier) > SAFETY_IDENTIFIER_CHARS:
        raise bad_request(
            f"safety_identifier must be at most {SAFETY_IDENTIFIER_CHARS} characters", "safety_identifier"
        )
    if f.get_bool("joint", False):
        raise bad_request(
            "joint: this model reads each question on its own; joint reads need a diffusion model", "joint"
        )
    refuse_unserved(f, {"cache_salt": REFUSED_OPENAI["cache_salt"]})
    return DecisionRequest(model, text, questions)


def _refuse_unknown(f: Fields, known: frozenset[str]) -> None:
    for key in f.obj:
        if key not in known:
            raise bad_request(f"{f.param(key)} is not a field of this object", f.param(key))


def _short(f: Fields, key: str, default: str | None = None, limit: int = SHORT_TEXT_CHARS) -> str | None:
    value = f.get_str(key, default)
    if value is not None and len(value) > limit:
        raise bad_request(f"{f.param(key)} must be at most {limit} characters", f.param(key))
    return value


def _object(value: Any, param: str, known: frozenset[str]) -> Fields:
    if type(value) is not dict:
        raise bad_request(f"{param} must be an object", param)
    f = Fields(value, param + ".")
    _refuse_unknown(f, known)
    return f


def _input(value: Any) -> str:
    """A string, or user messages whose content is a string or input_text parts: their texts,
    a message's parts joined by a newline and the messages by a blank line (vLLM's)."""
    if type(value) is str:
        if len(value) > INPUT_TEXT_CHARS:
            raise bad_request(f"input must be at most {INPUT_TEXT_CHARS} characters", "input")
        return value
    if type(value) is not list:
        raise bad_request("input must be a string or a list of user messages", "input")
    if len(value) > MAX_INPUT_MESSAGES:
        raise bad_request(f"input has {len(value)} messages; at most {MAX_INPUT_MESSAGES} are taken", "input")
    texts, chars = [], 0
    for i, message in enumerate(value):
        param = f"input[{i}]"
        content = message.get("content") if type(message) is dict else None
        if type(content) is list and any(type(p) is dict and p.get("type") == "input_image" for p in content):
            raise bad_request(IMAGES_REFUSED, param)
        m = _object(message, param, _MESSAGE_FIELDS)
        if m.get_str("role", choices=("user",)) is None:
            raise bad_request(f"{param}.role is required: user", f"{param}.role")
        m.get_str("type", "message", choices=("message",))
        text = _content(content, f"{param}.content")
        chars += len(text)
        if chars > INPUT_TEXT_CHARS:
            raise bad_request(f"input's texts must be at most {INPUT_TEXT_CHARS} characters in all", "input")
        texts.append(text)
    return "\n\n".join(texts)


def _content(value: Any, param: str) -> str:
    if type(value) is str:
        return value
    if type(value) is not list:
        raise bad_request(f"{param} must be a string or a list of input_text parts", param)
    if len(value) > MAX_MESSAGE_PARTS:
        raise bad_request(f"{param} has {len(value)} parts; at most {MAX_MESSAGE_PARTS} are taken", param)
    texts = []
    for j, part in enumerate(value):
        p = _object(part, f"{param}[{j}]", _PART_FIELDS)
        if p.get_str("type", choices=("input_text",)) is None:
            raise bad_request(f"{param}[{j}].type is required: input_text", f"{param}[{j}].type")
        text = p.get_str("text")
        if text is None:
            raise bad_request(f"{param}[{j}].text is required", f"{param}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def _question(value: Any, param: str) -> Question:
    kind = value.get("type") if type(value) is dict else None
    if type(kind) is not str or kind not in _QUESTION_FIELDS:
        raise bad_request(f"{param}.type must be one of {list(_QUESTION_FIELDS)}", f"{param}.type")
    q = _object(value, param, _QUESTION_FIELDS[kind])
    instructions = _short(q, "instructions")
    if instructions is None:
        raise bad_request(f"{param}.instructions is required", f"{param}.instructions")
    if "name" in value and value["name"] is None:
        raise bad_request(f"{param}.name must be a string when provided", f"{param}.name")
    name = _short(q, "name")
    if kind == "predicate":
        return Question(kind, name, instructions, (Option("false"), Option("true")), ())
    key, bound, known = (
        ("choices", MAX_CHOICES, _CHOICE_FIELDS) if kind == "choice" else ("levels", MAX_LEVELS, _LEVEL_FIELDS)
    )
    items = value.get(key)
    if type(items) is not list or not MIN_OPTIONS <= len(items) <= bound:
        raise bad_request(f"{param}.{key} must be a list of {MIN_OPTIONS} to {bound} items", f"{param}.{key}")
    if len(items) > len(LABELS):
        raise bad_request(
            f"{param}.{key}: this model supports at most {len(LABELS)} choices per question", f"{param}.{key}"
        )
    options, values = [], []
    for j, item in enumerate(items):
        o = _object(item, f"{param}.{key}[{j}]", known)
        description = _short(o, "description") or ""
        value_of = _choice_value(o) if kind == "choice" else _short(o, "label")
        if value_of is None:
            field = "value" if kind == "choice" else "label"
            raise bad_request(f"{o.param(field)} is required", o.param(field))
        text = json.dumps(value_of, ensure_ascii=False) if kind == "choice" else str(value_of)
        options.append(Option(text, description))
        values.append(value_of)
    if kind == "choice" and len({(type(v), v) for v in values}) != len(values):
        raise bad_request(f"{param}.choices: choice values must be distinct", f"{param}.choices")
    return Question(kind, name, instructions, tuple(options), tuple(values))


def _choice_value(o: Fields) -> str | bool | None:
    """A choice's value: a string or a boolean, kept as given (the answer echoes it)."""
    value = o.raw("value")
    if value is None or type(value) is bool:
        return value
    if type(value) is not str:
        raise bad_request(f"{o.param('value')} must be a string or a boolean", o.param("value"))
    if len(value) > SHORT_TEXT_CHARS:
        raise bad_request(f"{o.param('value')} must be at most {SHORT_TEXT_CHARS} characters", o.param("value"))
    return value


def question_prompt(text: str, question: Question) -> str:
    """The user turn of a question's read: the input, a blank line, the question, one line per
    option under its label, and the reply instruction (vLLM's, word for word)."""
    lines = [
        f"{label}: {o.text} - {o.description}" if o.description else f"{label}: {o.text}"
        for label, o in zip(question.labels, question.options)
    ]
    lines.append(REPLY_INSTRUCTION)
    body = "\n".join(lines)
    return f"{text}\n\n" + (f"Question: {question.instructions}\n{body}" if question.instructions else body)


def answer(question: Question, logprobs: Sequence[float]) -> dict[str, Any]:
    """The answer from the labels' log-probabilities over the whole vocabulary: their softmax
    is the probabilities; `confidence` is the top label's probability over the vocabulary (its
    share of the labels times the labels' mass), low when the reply wanted another token."""
    top_lp = max(logprobs)
    weights = [math.exp(lp - top_lp) for lp in logprobs]
    total = sum(weights)
    probs = [w / total for w in weights]
    if question.kind == "predicate":
        return {"type": "predicate", "name": question.name, "probability": probs[1]}
    top = max(range(len(probs)), key=probs.__getitem__)
    confidence = probs[top] * sum(math.exp(lp) for lp in logprobs)
    if question.kind == "choice":
        return {
            "type": "choice",
            "name": question.name,
            "choice": question.values[top],
            "probabilities": [{"value": v, "probability": p} for v, p in zip(question.values, probs)],
            "confidence": confidence,
        }
    return {
        "type": "score",
        "name": question.name,
        "score": sum(i * p for i, p in enumerate(probs)),  # the expected level, 0-indexed
        "probabilities": [
            {"value": i, "label": label, "probability": p} for i, (label, p) in enumerate(zip(question.values, probs))
        ],
        "confidence": confidence,
    }


def decisions_body(model: str, answers: list[dict[str, Any]], input_tokens: int, cached_tokens: int) -> bytes:
    """vLLM's DecisionResponse. A read is one output token: the reply's first, never sampled on."""
    output_tokens = len(answers)
    usage = {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }
    return orjson.dumps({"model": model, "answers": answers, "usage": usage})
