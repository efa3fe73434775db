"""vLLM's Decisions API, POST /v1/decisions (docs/decisions.md): each question is one read of
its labels' log-probabilities as the first token of the reply to its chat prompt, through the
label pooling /v1/score uses (pooling_routes.label_logprobs); httpapi/decisions.py parses the
body, writes each question's user turn and builds the answers."""

from __future__ import annotations

import functools
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from httpapi.chat_request import ChatTemplateArgs
from httpapi.decisions import LABELS, answer, decisions_body, parse_decisions, question_prompt
from httpapi.errors import bad_request
from httpapi.info import check_model
from runtime.http_worker.asgi import Handler, api_route, json_response, read_body
from runtime.http_worker.core import TokenizerManager
from runtime.http_worker.pooling_routes import label_logprobs, prompt_ids
from runtime.http_worker.routes import check_api

# vLLM's read: the chat prompt up to the generation prompt, thinking off, so that the label is
# the reply's first token
READ_TEMPLATE = ChatTemplateArgs(kwargs={"enable_thinking": False})


@functools.lru_cache(maxsize=4)
def _added_ids(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's added (special) tokens: a prompt's text is cut at them before BPE."""
    return frozenset(tokenizer.get_added_vocab().values())


async def _reply_label_ids(
    tm: TokenizerManager, ids: list[int], known: dict[tuple[int, ...], list[int | None]]
) -> list[int | None]:
    """The token each of LABELS adds as the reply's first, after the prompt `ids`: its ids after
    its last added token (the generation prompt's tail), decoded, with the label appended and
    encoded again, must be that tail and one more token, a different one for each label; None
    for a label that is not. `known`: the tails read before (every question shares one)."""
    added = _added_ids(tm.tokenizer)
    start = max((i + 1 for i, t in enumerate(ids) if t in added), default=0)
    tail = tuple(ids[start:])
    found = known.get(tail)
    if found is None:
        text = await tm.decode(tail)
        found = []
        for label in LABELS:
            extended = await tm.encode(text + label, add_special_tokens=False)
            token = extended[-1] if len(extended) == len(tail) + 1 and tuple(extended[:-1]) == tail else None
            found.append(None if token in found else token)
        known[tail] = found
    return found


@api_route
async def decisions(worker, request: Request) -> Response:
    """vLLM's /v1/decisions (its NextTokenStrategy): one label read per question, in order."""
    check_api(worker, "Decisions")
    req = parse_decisions(await read_body(request))
    check_model(req.model, worker.served_names)
    prompts: list[list[int]] = []
    labels: list[tuple[int, ...]] = []
    known: dict[tuple[int, ...], list[int | None]] = {}
    for i, question in enumerate(req.questions):
        message = {"role": "user", "content": question_prompt(req.text, question)}
        ids = await prompt_ids(worker, await worker.tm.chat_ids([message], READ_TEMPLATE), "input")
        label_ids: list[int] = []
        for label, token in zip(question.labels, await _reply_label_ids(worker.tm, ids, known)):
            if token is None:
                raise bad_request(
                    f"questions[{i}]: label {label!r} is not one distinct token after this model's chat prompt",
                    f"questions[{i}]",
                )
            label_ids.append(token)
        prompts.append(ids)
        labels.append(tuple(label_ids))
    reads, states = await label_logprobs(worker, request, "decisions", prompts, labels, "input")
    answers = [answer(q, lps.tolist()) for q, lps in zip(req.questions, reads)]
    input_tokens = sum(s.prompt_tokens for s in states)
    cached = sum(s.cached_tokens for s in states)
    return json_response(decisions_body(worker.model.served_name, answers, input_tokens, cached))


DECISIONS_ROUTES: dict[str, dict[str, Handler]] = {"/v1/decisions": {"POST": decisions}}
