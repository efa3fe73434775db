"""OpenAI's Responses API: POST /v1/responses (whole, streamed or in the background), and a
stored response's GET, DELETE, POST .../cancel and GET .../input_items.

A response runs as a chat request does (the same template, sampling, grammars, tool-call and
reasoning parsers: routes.chat_output); what differs is its input (items, instructions, a
stored conversation it continues) and its output (items and typed events:
httpapi/responses_output.py). Stored responses live in the server's ResponseStore, which
every worker shares."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import parse_qs

import orjson
from starlette.requests import Request
from starlette.responses import Response

from httpapi.chat_output import ChatDeltas, ChatOutput
from httpapi.errors import APIError, bad_request
from httpapi.info import check_model
from httpapi.responses import new_request_id, usage_of
from httpapi.responses_output import (
    ResponseEvents,
    ResponseHead,
    ResponseUsage,
    output_items,
    raw_messages,
    response_logprobs,
    status_of,
)
from httpapi.responses_request import ResponsesRequest, chat_messages, parse_responses_create, template_args
from httpapi.sampling import check_request_size
from runtime.http_worker.asgi import Handler, Reply, api_route, client_request_id, json_response, read_body
from runtime.http_worker.req_state import ReqGroup, ReqState
from runtime.http_worker.response_store import RUNNING, StoredResponse, owner_of
from runtime.http_worker.routes import chat_output, check_api, finished, with_thinking_budget
from runtime.http_worker.streaming import EventStream, sse_events

logger = logging.getLogger("ringserve.responses")

RESPONSES_PATH = "/v1/responses"
MAX_LISTED_ITEMS = 100  # input_items' limit, as OpenAI's


class Prepared:
    """A response about to run: its head (id, echoed fields), the conversation it answers, how
    its text is read and, for enable_response_messages, its prompt's token ids."""

    def __init__(
        self,
        head: ResponseHead,
        history: list[dict],
        output: ChatOutput,
        vocab,
        owner: bytes,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.head, self.history, self.output, self.vocab, self.owner = head, history, output, vocab, owner
        self.prompt_ids = prompt_ids

    def raw(self, worker, text: str, state: ReqState) -> dict | None:
        """vLLM's input_messages and output_messages, when asked: the prompt's text is its ids
        decoded as the model read them (special tokens and all)."""
        if self.prompt_ids is None:
            return None
        prompt = worker.tm.tokenizer.decode(self.prompt_ids, skip_special_tokens=False)
        return raw_messages(prompt, self.prompt_ids, text, state.output_ids)


@api_route
async def create_response(worker, request: Request) -> Reply:
    check_api(worker, "Responses")
    req = parse_responses_create(await read_body(request))
    check_model(req.model, worker.served_names)
    await worker.grammar_checks.check([req.sampling])
    history, owner = req.items, owner_of(request.headers.get("authorization"))
    if req.previous_response_id is not None:
        previous = worker.responses.get(req.previous_response_id, owner)
        if previous is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        history = previous.conversation + req.items
    ids = await prompt_ids(worker, req, history)
    if req.truncation == "auto" and not fits(worker, req, ids):
        ids = await truncated_prompt_ids(worker, req, history)
    params = worker.sampling_params(req.sampling, ids)
    if req.thinking_budget >= 0:
        params = with_thinking_budget(worker, params, req.thinking_budget)
    check_request_size([len(ids)], [params], 1, "input", max_tokens=worker.kv_tokens)
    response_id = "resp_" + (client_request_id(request, req.request_id) or new_request_id("x")[2:])
    echo = {**req.echo, "temperature": params.temperature, "top_p": params.top_p}
    echo["max_output_tokens"] = req.sampling.max_tokens
    head = ResponseHead(response_id, worker.model.served_name, echo, call_names=req.call_names)
    max_calls = 1 if not req.parallel_tool_calls else req.max_tool_calls
    output = chat_output(worker, response_id, req.tools, req.tool_choice, max_calls)
    vocab = worker.vocab if req.include_logprobs else None
    run = Prepared(head, history, output, vocab, owner, ids if req.raw_messages else None)
    group = await worker.submit("responses", [ids], [params], 1, [response_id], req.stream)
    group.grammar_param = req.sampling.grammar_param
    if req.background:
        queued = head.response("queued", [])
        worker.responses.put(queued, history, True, owner)
        task = asyncio.create_task(run_in_background(worker, group, run), name=f"response-{response_id}")
        worker.background.add(task)
        task.add_done_callback(worker.background.discard)
        return json_response(orjson.dumps(queued))
    if req.stream:
        events = ResponseEvents(head, run.vocab, req.include_logprobs)
        return EventStream(
            response_events(worker, group, run, events, req.store), lambda: worker.tm.abort(group), worker.watches
        )
    states = await finished(worker, request, group)
    response = whole_response(worker, states[0], run)
    if req.store:
        worker.responses.put(response, history, False, owner)
    return json_response(orjson.dumps(response))


async def prompt_ids(worker, req: ResponsesRequest, items: list[dict]) -> list[int]:
    """The conversation's prompt: instructions and items through the chat template."""
    messages, rich = chat_messages(req.instructions, items)
    try:
        return await worker.tm.chat_ids(messages, template_args(req.tools, req.chat_template_kwargs, rich))
    except APIError as err:  # the chat's checks name its messages: here they are the input
        if err.param == "messages":
            err.param, err.message = "input", err.message.replace("messages", "input")
        raise


def fits(worker, req: ResponsesRequest, ids: list[int]) -> bool:
    """Whether the prompt leaves the context room for max_output_tokens (at least one token)."""
    room = min(worker.model.context_length, worker.kv_tokens or worker.model.context_length) - len(ids)
    return room >= (req.sampling.max_tokens or 1)


async def truncated_prompt_ids(worker, req: ResponsesRequest, history: list[dict]) -> list[int]:
    """truncation "auto", as OpenAI's: the conversation loses its oldest items, whole turns from
    a message of the client's on (a tool call never loses its call), the fewest that make it fit
    (a binary search: a handful of renders); instructions stay. A last turn that cannot fit
    alone is the 400 an over-long input gets."""
    starts = [
        i for i, item in enumerate(history) if i > 0 and item["type"] == "message" and item["role"] != "assistant"
    ]
    lo, hi, best = 0, len(starts) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            ids = await prompt_ids(worker, req, history[starts[mid] :])
        except APIError:  # too long to render at all
            ids = None
        if ids is not None and fits(worker, req, ids):
            best, hi = ids, mid - 1
        else:
            lo = mid + 1
    return best if best is not None else await prompt_ids(worker, req, history[starts[-1] if starts else 0 :])


def whole_response(worker, state: ReqState, run: Prepared) -> dict:
    """A finished response's object, from its one choice."""
    text, lp, finish = state.take()
    items, reasoning = output_items(run.head, text, finish, run.output, response_logprobs(lp, run.vocab))
    status, reason = status_of(finish)
    usage = response_usage(worker, state, reasoning)
    return run.head.response(status, items, usage, reason, raw=run.raw(worker, text, state))


def response_usage(worker, state: ReqState, reasoning: str) -> ResponseUsage:
    """Its usage; reasoning_tokens counts the reasoning's text as the tokenizer splits it."""
    usage = usage_of(state)
    reasoning_tokens = len(worker.tm.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return ResponseUsage(
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.cached_tokens,
        min(reasoning_tokens, usage.completion_tokens),
    )


def response_events(worker, group: ReqGroup, run: Prepared, events: ResponseEvents, store: bool):
    """The stream: response.created and .in_progress, each item's events as its text comes,
    then response.completed (or .incomplete, .failed) with the whole response, which is stored."""
    deltas = ChatDeltas(run.output)
    finish_reason: str | None = None
    texts: list[str] = []  # the raw output, for enable_response_messages

    def render(state: ReqState) -> bytes | None:
        nonlocal finish_reason
        text, lp, finish = state.take()
        if run.prompt_ids is not None:
            texts.append(text)
        out = deltas.feed(text) if text else []
        if finish is not None:
            tail, _ = deltas.finish(finish)
            out += tail
            finish_reason = finish
        return events.feed(out, lp) or None

    def tail() -> bytes:
        state = group.states[0]
        usage = response_usage(worker, state, events.reasoning)
        last, response = events.finish(finish_reason, usage, raw=run.raw(worker, "".join(texts), state))
        if store:
            worker.responses.put(response, run.history, False, run.owner)
        return last

    return sse_events(worker, group, render, events.start(), tail)


async def run_in_background(worker, group: ReqGroup, run: Prepared) -> None:
    """A background response: stored as in_progress, then as it ended, unless it was cancelled
    (through any worker) meanwhile."""
    store, head = worker.responses, run.head
    store.update_running(head.response("in_progress", []), run.owner)
    try:
        states = await group.finished()
        response = whole_response(worker, states[0], run)
    except APIError as err:
        response = head.response("failed", [], error=err)
    except Exception as err:  # a bug: the response says it failed rather than staying in progress
        logger.exception("background response %s failed", head.id)
        response = head.response("failed", [], error=APIError(500, repr(err), code="internal_error"))
    finally:
        worker.observe(group)
    if response["status"] == "cancelled":  # aborted: /v1/responses/{id}/cancel marked it already
        return
    store.update_running(response, run.owner)


# ---------------------------------------------------------------- stored responses


def not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"Response with id '{response_id[:80]}' not found.", param)


def _target(request: Request) -> str:
    """The response id of /v1/responses/<id>[/cancel | /input_items] (the App routed it: not empty)."""
    return request.url.path[len(RESPONSES_PATH) + 1 :].partition("/")[0]


def _stored(worker, request: Request, response_id: str) -> StoredResponse:
    stored = worker.responses.get(response_id, owner_of(request.headers.get("authorization")))
    if stored is None:
        raise not_found(response_id)
    return stored


@api_route
async def get_response(worker, request: Request) -> Response:
    query = parse_qs(request.url.query)
    if query.get("stream", ["false"])[0] == "true":
        raise bad_request("stream: resuming a response's stream is not supported; retrieve it whole", "stream")
    return json_response(orjson.dumps(_stored(worker, request, _target(request)).response))


@api_route
async def list_input_items(worker, request: Request) -> Response:
    return json_response(orjson.dumps(input_items(_stored(worker, request, _target(request)), request)))


def input_items(stored: StoredResponse, request: Request) -> dict:
    """OpenAI's list of a response's input items (newest first unless order=asc), paged by
    limit (1-100, default 20) and after (an item id)."""
    query = parse_qs(request.url.query)
    order = query.get("order", ["desc"])[0]
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be 'asc' or 'desc', not {order[:20]!r}", "order")
    try:
        limit = int(query.get("limit", ["20"])[0])
    except ValueError:
        raise bad_request("limit must be an integer", "limit") from None
    if not 1 <= limit <= MAX_LISTED_ITEMS:
        raise bad_request(f"limit must be between 1 and {MAX_LISTED_ITEMS}", "limit")
    items = stored.history if order == "asc" else stored.history[::-1]
    after = query.get("after", [None])[0]
    if after is not None:
        at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
        if at is None:
            raise bad_request(f"after: no input item {after[:80]!r} in this response", "after")
        items = items[at + 1 :]
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


@api_route
async def delete_response(worker, request: Request) -> Response:
    response_id = _target(request)
    stored = _stored(worker, request, response_id)
    if stored.status in RUNNING:
        worker.tm.abort_rid(response_id)
    worker.responses.delete(response_id, owner_of(request.headers.get("authorization")))
    return json_response(orjson.dumps({"id": response_id, "object": "response", "deleted": True}))


@api_route
async def cancel_response(worker, request: Request) -> Response:
    """Cancels a background response that is still running (through whichever worker runs it:
    its rid is aborted server-wide); one that ended is returned as it is."""
    response_id = _target(request)
    stored = worker.responses.cancel(response_id, owner_of(request.headers.get("authorization")))
    if stored is None:
        raise not_found(response_id)
    if not stored.background:
        raise bad_request("Cannot cancel a synchronous response.", "response_id")
    if stored.status == "cancelled":
        worker.tm.abort_rid(response_id)
    return json_response(orjson.dumps(stored.response))


RESPONSES_ROUTES: dict[str, dict[str, Handler]] = {RESPONSES_PATH: {"POST": create_response}}
# /v1/responses/<id>[/cancel | /input_items]: what follows the id -> its routes
RESPONSE_ITEM_ROUTES: dict[str, dict[str, Handler]] = {
    "": {"GET": get_response, "DELETE": delete_response},
    "/cancel": {"POST": cancel_response},
    "/input_items": {"GET": list_input_items},
}
