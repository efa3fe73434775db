"""The routes: OpenAI's, SGLang's native ones, health and metrics. Each stays thin: httpapi/
does the protocol (parsing, validation, bodies, SSE templates), the TokenizerManager the
engine side, the HTTPWorkerProcess the state they share."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import time
from collections.abc import AsyncIterator, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from httpapi.chat_output import ChatDeltas, ChatOutput
from httpapi.chat_request import ChatCompletionRequest, parse_batch_chat_completion, parse_chat_completion
from httpapi.errors import APIError, bad_request, engine_unavailable, model_not_found
from httpapi.fields import load_object
from httpapi.info import (
    adapter_card,
    check_adapter,
    check_model,
    model_card,
    model_info_body,
    models_body,
    server_info_body,
    server_version,
)
from httpapi.logprobs import LogprobVocab
from httpapi.openapi import openapi_document
from httpapi.openapi_page import docs_page
from httpapi.request_fields import check_beam_search
from httpapi.requests import (
    CompletionRequest,
    parse_abort,
    parse_completion,
    parse_detokenize,
    parse_generate,
    parse_tokenize,
)
from httpapi.responses import (
    ChoiceResult,
    Usage,
    chat_completion_body,
    choice_results,
    completion_body,
    e2e_latency,
    generate_body,
    new_request_id,
    now,
    output_ids_of,
    per_request_metrics,
    usage_of,
)
from httpapi.sampling import check_prompt_chars, check_request_size, check_token_ids, validated
from httpapi.sse import (
    DONE,
    ChatStream,
    CompletionStream,
    GenerateStream,
    with_choice_field,
    with_field,
    with_matched_stop,
    with_usage,
)
from protocol.records import PAUSE_MODES
from protocol.sampling_params import SamplingParams
from runtime.config import ServerArgs
from runtime.engine_stats import used_kv_pages
from runtime.http_worker.asgi import (
    MODEL_PATH,
    Handler,
    Reply,
    api_route,
    client_request_id,
    error_response,
    json_response,
    orjson_dumps,
    probe_route,
    read_body,
)
from runtime.http_worker.beam_search import beam_choices, beam_search
from runtime.http_worker.process_memory import server_processes
from runtime.http_worker.req_state import ReqGroup, ReqState
from runtime.http_worker.stop_regex import RegexStops
from runtime.http_worker.streaming import EventStream, sse_events
from structured.reasoning import THINK_END, THINK_START
from structured.tool_parsers import PARSERS, make_parser
from structured.tools import HERMES_TEMPLATE, Tool, ToolChoice

HEALTH_GENERATE_TIMEOUT_S = 30.0


async def finished(worker, request: Request, group: ReqGroup, stops: RegexStops | None = None) -> list[ReqState]:
    """A non-streamed request's choices, all finished; aborted if the client leaves first.
    `stops`: its choices' text is checked as it comes (the group was submitted as a stream's).
    The request is observed (metrics) once it ended, whichever way."""
    watch = worker.watches.watch(request.receive, lambda: worker.tm.abort(group))
    try:
        while stops is not None and group.unfinished:
            for state in await group.next_news():
                stops.check(state)
        return await group.finished()
    finally:
        watch.close()
        worker.observe(group)


# ---------------------------------------------------------------- OpenAI


def check_api(worker, api: str, pooling: bool = False) -> None:
    """vLLM's 400 for an API this server's mode does not serve: a server started for embeddings
    (--is-embedding) generates nothing, and a generation model pools nothing."""
    if worker.args.is_embedding != pooling:
        raise APIError(400, f"The model does not support {api} API", None, "BadRequestError")


@api_route
async def chat_completions(worker, request: Request) -> Reply:
    check_api(worker, "Chat Completions")
    received_ns = time.monotonic_ns()
    req = parse_chat_completion(await read_body(request))
    lora = check_model(req.model, worker.served_names, worker.adapters)
    await worker.grammar_checks.check([req.sampling])
    ids = list(req.prompt_ids) if req.prompt_ids is not None else await worker.tm.chat_ids(req.messages, req.template)
    if req.truncation is not None:
        ids = req.truncation.apply(ids, worker.model.context_length)
    params = worker.sampling_params(req.sampling, ids, lora)
    if req.thinking_budget >= 0:
        params = with_thinking_budget(worker, params, req.thinking_budget)
    check_request_size([len(ids)], [params], req.n, "messages", max_tokens=worker.kv_tokens)
    request_id, created = response_id("chatcmpl", client_request_id(request, req.request_id)), now()
    output = chat_output(
        worker,
        request_id,
        req.tools,
        req.tool_choice,
        None if req.parallel_tool_calls else 1,
        req.include_reasoning,
        req.separate_reasoning,
    )
    if req.beam is not None:
        check_beam_search(params, req.sampling.names, echo=bool(req.echo), stop_regex=bool(req.stop_regex))
        wait = functools.partial(finished, worker, request)
        beams = await beam_search(worker, ids, params, req.beam, request_id, wait)
        choices = await beam_choices(worker, beams, params, len(ids), 0)
        token_ids = ids if req.return_token_ids else None
        name = worker.model.served_name
        return json_response(chat_completion_body(request_id, created, name, choices, req.n, None, output, token_ids))
    group = await worker.submit("chat", [ids], [params], req.n, [request_id], req.stream or bool(req.stop_regex))
    group.grammar_param = req.sampling.grammar_param
    stops = RegexStops(req.stop_regex, worker.tm, len(group.states)) if req.stop_regex else None
    vocab = logprob_vocab(worker, params.logprobs or params.prompt_logprobs >= 0, req.tokens_as_ids)
    if req.stream:
        stream = ChatStream(request_id, created, worker.model.served_name, req.n, vocab)
        timed = metrics_from(worker, received_ns, req.n)
        extras = ChunkExtras(*usage_asked(req, worker.args), req.return_token_ids, metrics_from=timed)
        head = stream.start([usage_of(s) for s in group.states] if extras.continuous_usage else None)
        if req.return_token_ids:  # vLLM's: the prompt's ids on the stream's first write
            head = with_field(head, "prompt_token_ids", ids)
        if output.plain:
            if req.echo:
                head += b"".join(stream.delta(i, req.echo) for i in range(len(group.states)))
            events = openai_events(worker, group, stream, req.n, extras, head, stops=stops)
        else:
            events = chat_events(worker, group, stream, req.n, extras, head, output, req.echo, stops)
        return EventStream(events, lambda: worker.tm.abort(group), worker.watches)
    states = await finished(worker, request, group, stops)
    body = chat_completion_body(
        request_id,
        created,
        worker.model.served_name,
        choice_results(states, [req.echo] * len(states) if req.echo else None),
        req.n,
        vocab,
        output,
        ids if req.return_token_ids else None,
    )
    return json_response(with_metrics(worker, body, received_ns, group))


def with_thinking_budget(worker, params: SamplingParams, budget: int) -> SamplingParams:
    """`params` with vLLM's thinking_token_budget: the reasoning's markers as this tokenizer
    writes them (no start marker when the server's reasoning parser starts in the reasoning)."""
    reasoning = worker.reasoning
    if reasoning is None:
        raise bad_request(
            "thinking_token_budget needs a server started with --reasoning-parser (its end marker is what "
            "the budget forces)",
            "thinking_token_budget",
        )
    tokenizer = worker.tm.tokenizer
    start = () if reasoning.starts_in_reasoning else tuple(tokenizer.encode(THINK_START, add_special_tokens=False))
    end = tuple(tokenizer.encode(THINK_END, add_special_tokens=False))
    budgeted = dataclasses.replace(params, thinking_budget=budget, think_start_ids=start, think_end_ids=end)
    return validated(budgeted, {"thinking_budget": "thinking_token_budget"}, worker.model.vocab_size)


def chat_output(
    worker,
    request_id: str,
    tools: tuple[Tool, ...],
    choice: ToolChoice,
    max_calls: int | None,
    include_reasoning: bool = True,
    separate_reasoning: bool = True,
) -> ChatOutput:
    """How a chat request's choices are read (reasoning, tool calls; the Responses API's too);
    400 when its tools cannot be served: the chat template does not render them, or no parser
    reads "auto" calls."""
    if tools and choice.mode != "none" and not worker.template_renders_tools:
        raise bad_request(
            "tools: this model's chat template does not render tools; start the server with a --chat-template "
            f"that does (for a ChatML model: {HERMES_TEMPLATE.relative_to(HERMES_TEMPLATE.parents[2])})",
            "tools",
        )
    parser = None
    if tools and choice.mode == "auto":
        if worker.tool_call_parser is None:
            raise bad_request(
                'tool_choice "auto" needs a tool-call parser, and this model\'s chat template shows no call '
                f"format: start the server with --tool-call-parser (one of {', '.join(PARSERS)}), or send "
                'tool_choice "required" or a named function',
                "tool_choice",
            )
        parser = make_parser(worker.tool_call_parser, [t.name for t in tools])
    forced = choice if choice.mode in ("required", "function") else None
    return ChatOutput(
        request_id,
        reasoning=worker.reasoning if separate_reasoning else None,
        tool_parser=parser,
        tools=tools,
        forced=forced,
        max_calls=max_calls,
        include_reasoning=include_reasoning,
    )


def chat_events(
    worker,
    group: ReqGroup,
    stream: ChatStream,
    n: int,
    extras: ChunkExtras,
    head: bytes,
    output: ChatOutput,
    echo: str = "",
    stops: RegexStops | None = None,
) -> AsyncIterator[bytes]:
    """A chat stream whose text is parsed (reasoning, tool calls) into delta objects as it comes;
    `echo` (vLLM's) starts each choice's text, parsed as the whole answer parses it; `stops`
    checks each choice's new text first (SGLang's stop_regex)."""
    parsers = [ChatDeltas(output) for _ in group.states]
    if echo:
        head += b"".join(stream.event(i, d) for i, parser in enumerate(parsers) for d in parser.feed(echo))

    def render(state: ReqState) -> bytes | None:
        events, finish = _render(state)
        return extras.on_each(events, state, finish)

    def _render(state: ReqState) -> tuple[list[bytes], str | None]:
        text, lp, finish = state.take()
        plp = state.take_prompt_logprobs()  # vLLM's prompt_logprobs: on the choice's first event
        deltas = parsers[state.index].feed(text) if text else []
        if finish is not None:
            tail, finish = parsers[state.index].finish(finish)
            deltas += tail
        if not deltas:
            if finish or lp is not None or plp is not None:
                event = with_matched_stop(stream.event(state.index, {}, finish, lp), finish, state.matched_stop)
                return [stream.with_prompt_logprobs(event, plp)], finish
            return [], finish
        last = len(deltas) - 1
        events = [
            stream.event(state.index, d, finish if i == last else None, lp if i == 0 else None)
            for i, d in enumerate(deltas)
        ]
        events[last] = with_matched_stop(events[last], finish, state.matched_stop)
        events[0] = stream.with_prompt_logprobs(events[0], plp)
        return events, finish

    checked = render if stops is None else stops.around(render)
    return sse_events(worker, group, checked, head, usage_tail(group, stream, n, extras))


@api_route
async def batch_chat_completions(worker, request: Request) -> Reply:
    """vLLM's /v1/chat/completions/batch: N conversations in one request, run as one group (as
    a completions batch runs its prompts), answered as one chat completion whose choice i
    answers conversation i; usage sums them."""
    check_api(worker, "Chat Completions")
    reqs = parse_batch_chat_completion(await read_body(request))
    first = reqs[0]
    lora = check_model(first.model, worker.served_names, worker.adapters)
    await worker.grammar_checks.check([first.sampling])  # shared by every conversation
    prompt_ids = [await worker.tm.chat_ids(req.messages, req.template) for req in reqs]
    if first.truncation is not None:
        prompt_ids = [first.truncation.apply(ids, worker.model.context_length) for ids in prompt_ids]
    params = [worker.sampling_params(first.sampling, ids, lora) for ids in prompt_ids]
    if first.thinking_budget >= 0:
        params = [with_thinking_budget(worker, p, first.thinking_budget) for p in params]
    check_request_size([len(ids) for ids in prompt_ids], params, 1, "messages", max_tokens=worker.kv_tokens)
    request_id, created = response_id("chatcmpl", client_request_id(request, first.request_id)), now()
    reasoning = (first.include_reasoning, first.separate_reasoning)
    output = chat_output(worker, request_id, (), first.tool_choice, None, *reasoning)
    group = await worker.submit("chat", prompt_ids, params, 1, [request_id], False)
    group.grammar_param = first.sampling.grammar_param
    vocab = logprob_vocab(worker, params[0].logprobs or params[0].prompt_logprobs >= 0, first.tokens_as_ids)
    states = await finished(worker, request, group)
    echoes = [req.echo for req in reqs] if first.echo else None
    results = choice_results(states, echoes)
    return json_response(chat_completion_body(request_id, created, worker.model.served_name, results, 1, vocab, output))


@api_route
async def invocations(worker, request: Request) -> Reply:
    """SageMaker's /invocations (vLLM serves it): the body's shape picks the route, a chat's
    (`messages`) or a completion's (`prompt`), which then serves it as its own."""
    body = await read_body(request)
    obj = load_object(body)
    handler = chat_completions if "messages" in obj else completions if "prompt" in obj else None
    if handler is None:
        raise bad_request("/invocations takes a chat request (messages) or a completions request (prompt)", None)
    sent = False

    async def receive() -> Message:  # the body once more, then the client's own messages (a disconnect)
        nonlocal sent
        if sent:
            return await request.receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return await inspect.unwrap(handler)(worker, Request(request.scope, receive))  # api_route's checks: done


@api_route
async def completions(worker, request: Request) -> Reply:
    check_api(worker, "Completions")
    received_ns = time.monotonic_ns()
    req = parse_completion(await read_body(request))
    lora = check_model(req.model, worker.served_names, worker.adapters)
    await worker.grammar_checks.check([req.sampling])
    prompt_ids = [await prompt_tokens(worker, p, "prompt", req.add_special_tokens) for p in req.prompts]
    if req.truncation is not None:
        prompt_ids = [req.truncation.apply(ids, worker.model.context_length) for ids in prompt_ids]
    params = [worker.sampling_params(req.sampling, ids, lora) for ids in prompt_ids]
    n = req.n
    check_request_size([len(ids) for ids in prompt_ids], params, n, "prompt", max_tokens=worker.kv_tokens)
    request_id, created = response_id("cmpl", client_request_id(request, req.request_id)), now()
    if req.beam is not None:
        check_beam_search(params[0], req.sampling.names, echo=req.echo, stop_regex=bool(req.stop_regex))
        wait = functools.partial(finished, worker, request)
        searches = [  # each prompt's at once, under an id of its own (two groups in flight never share one)
            beam_search(worker, ids, p, req.beam, f"{request_id}-{i}", wait)
            for i, (ids, p) in enumerate(zip(prompt_ids, params))
        ]
        choices: list[ChoiceResult] = []
        for ids, p, beams in zip(prompt_ids, params, await asyncio.gather(*searches)):
            choices += await beam_choices(worker, beams, p, len(ids), len(choices))
        token_ids = prompt_ids if req.return_token_ids else None
        name = worker.model.served_name
        return json_response(completion_body(request_id, created, name, choices, n, None, False, token_ids))
    group = await worker.submit("completions", prompt_ids, params, n, [request_id], req.stream or bool(req.stop_regex))
    group.grammar_param = req.sampling.grammar_param
    stops = RegexStops(req.stop_regex, worker.tm, len(group.states)) if req.stop_regex else None
    echoes = None
    if req.echo:
        echoes = [p if isinstance(p, str) else await worker.tm.decode(p) for p in req.prompts for _ in range(n)]
    with_prompt = params[0].prompt_logprobs >= 0  # echo with logprobs, or vLLM's prompt_logprobs
    vocab = logprob_vocab(worker, params[0].logprobs or with_prompt, req.tokens_as_ids)
    if req.stream:
        stream = CompletionStream(request_id, created, worker.model.served_name, len(group.states), vocab)
        # vLLM's return_token_ids: each choice's prompt ids on its first chunk
        choice_prompts = [prompt_ids[i // n] for i in range(len(group.states))] if req.return_token_ids else None
        timed = metrics_from(worker, received_ns, len(group.states))
        extras = ChunkExtras(*usage_asked(req, worker.args), req.return_token_ids, choice_prompts, timed)
        if with_prompt:  # each choice's echo waits for its prompt's logprobs: its first delta carries both
            stream.echo_logprobs = bool(echoes) and params[0].logprobs
            events = openai_events(worker, group, stream, n, extras, b"", echoes, stops)
        else:
            first = b"".join(
                extras.on_each([stream.delta(i, text)], state, None) or b""
                for i, (text, state) in enumerate(zip(echoes or [], group.states))
            )
            events = openai_events(worker, group, stream, n, extras, first, stops=stops)
        return EventStream(events, lambda: worker.tm.abort(group), worker.watches)
    states = await finished(worker, request, group, stops)
    body = completion_body(
        request_id,
        created,
        worker.model.served_name,
        choice_results(states, echoes),
        n,
        vocab,
        bool(echoes),
        prompt_ids if req.return_token_ids else None,
    )
    return json_response(with_metrics(worker, body, received_ns, group))


def logprob_vocab(worker, needed: bool, tokens_as_ids: bool | None) -> LogprobVocab | None:
    """The vocabulary a response's logprobs show, if it has any: tokens as their text, or as
    "token_id:<id>" (vLLM's return_tokens_as_token_ids; unset: --return-tokens-as-token-ids)."""
    if not needed:
        return None
    as_ids = worker.args.return_tokens_as_token_ids if tokens_as_ids is None else tokens_as_ids
    return worker.vocab.as_token_ids if as_ids else worker.vocab


def openai_events(
    worker,
    group: ReqGroup,
    stream: ChatStream | CompletionStream,
    n: int,
    extras: ChunkExtras,
    head: bytes,
    echoes: list[str] | None = None,
    stops: RegexStops | None = None,
) -> AsyncIterator[bytes]:
    """`echoes`: each choice's prompt text, sent with its first delta (with its prompt logprobs);
    `stops` checks each choice's new text first (SGLang's stop_regex)."""
    texts = echoes or []
    unechoed = set(range(len(texts)))

    def render(state: ReqState) -> bytes | None:
        text, lp, finish = state.take()
        plp = state.take_prompt_logprobs()
        echo = None
        if unechoed and state.index in unechoed:
            unechoed.discard(state.index)
            echo = texts[state.index]
        if plp is not None or echo is not None:
            first = stream.prompt_delta(state.index, text, finish, lp, plp, echo, state.matched_stop)
            return extras.on_each([first], state, finish)
        if text or finish or lp is not None:
            event = with_matched_stop(stream.delta(state.index, text, finish, lp), finish, state.matched_stop)
            return extras.on_each([event], state, finish)
        return None

    checked = render if stops is None else stops.around(render)
    return sse_events(worker, group, checked, head, usage_tail(group, stream, n, extras))


def metrics_from(worker, received_ns: int, choices: int) -> int | None:
    """The arrival time per-request metrics count from, when they are served
    (--enable-per-request-metrics) and the request has one choice: vLLM's leave out a request
    of several, whose times are no one choice's."""
    return received_ns if worker.args.enable_per_request_metrics and choices == 1 else None


def with_metrics(worker, body: bytes, received_ns: int, group: ReqGroup) -> bytes:
    """A finished answer's body (a JSON object) with vLLM's per-request metrics, when it carries them."""
    if metrics_from(worker, received_ns, len(group.states)) is None:
        return body
    return body[:-1] + b',"metrics":' + orjson.dumps(metrics_of(received_ns, group)) + b"}"


def metrics_of(received_ns: int, group: ReqGroup) -> dict:
    """The one choice's per-request metrics, ending now."""
    state = group.states[0]
    end_ns = time.monotonic_ns()
    return per_request_metrics(received_ns, group.arrival_ns, state.first_ns, end_ns, state.completion_tokens)


def usage_asked(req: ChatCompletionRequest | CompletionRequest, args: ServerArgs) -> tuple[bool, bool]:
    """(a usage chunk before DONE, usage on every chunk) for a stream: as the request's
    stream_options ask, or both with vLLM's --enable-force-include-usage (vLLM's
    should_include_usage)."""
    forced = args.enable_force_include_usage
    return req.include_usage or forced, req.continuous_usage or forced


class ChunkExtras:
    """What a stream's chunks carry beside their deltas, as asked: `final_usage`, a usage chunk
    before DONE (stream_options.include_usage); `continuous_usage`, each chunk's own usage too
    (vLLM's continuous_usage_stats: its choice's completion tokens so far); `token_ids`, vLLM's
    return_token_ids: each choice's token ids not sent before on its next chunk, and
    `choice_prompts`' prompt ids on a completion choice's first; `metrics_from`, vLLM's
    per-request metrics on the usage chunk, from that arrival time."""

    def __init__(
        self,
        final_usage: bool,
        continuous_usage: bool,
        token_ids: bool = False,
        choice_prompts: list[list[int]] | None = None,
        metrics_from: int | None = None,
    ) -> None:
        self.final_usage, self.continuous_usage, self.token_ids = final_usage, continuous_usage, token_ids
        self.choice_prompts = choice_prompts
        self.metrics_from = metrics_from  # the request's arrival, when the usage chunk carries vLLM's metrics
        self.sent: dict[int, int] = {}  # choice index -> its token ids sent

    def on_each(self, events: list[bytes], state: ReqState, finish: str | None) -> bytes | None:
        """One render's events of `state` (the last one finishing the choice when `finish`) as one write."""
        if not events:
            return None
        if self.token_ids:
            events[0] = self._with_ids(events[0], state, finish if len(events) == 1 else None)
        if self.continuous_usage:
            usage = usage_of(state)
            events = [with_usage(e, usage) for e in events]
        return events[0] if len(events) == 1 else b"".join(events)

    def _with_ids(self, event: bytes, state: ReqState, finish: str | None) -> bytes:
        first = state.index not in self.sent
        if first and self.choice_prompts is not None:
            event = with_choice_field(event, finish, "prompt_token_ids", self.choice_prompts[state.index])
        sent = self.sent.get(state.index, 0)
        self.sent[state.index] = len(state.output_ids)
        return with_choice_field(event, finish, "token_ids", state.output_ids[sent:])


def usage_tail(
    group: ReqGroup, stream: ChatStream | CompletionStream, n: int, extras: ChunkExtras
) -> Callable[[], bytes]:
    """An OpenAI stream's last write: the usage chunk (stream_options.include_usage), with vLLM's
    per-request metrics when `extras` asks, then [DONE]."""

    def tail() -> bytes:
        if not extras.final_usage:
            return DONE
        chunk = stream.usage(Usage.combine([usage_of(s) for s in group.states], n))
        if extras.metrics_from is not None:
            chunk = with_field(chunk, "metrics", metrics_of(extras.metrics_from, group))
        return chunk + DONE

    return tail


async def prompt_tokens(worker, prompt: str | list[int], param: str, add_special_tokens: bool = True) -> list[int]:
    """A prompt's token ids; a text too long for the context is refused before it is tokenized."""
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), worker.tm.max_prompt_chars, param)
        return await worker.tm.encode(prompt, add_special_tokens)
    return prompt


def response_id(prefix: str, client_id: str | None) -> str:
    """The response's id (and the rid /abort_request takes): vLLM's <prefix>-<request_id> when
    the client names the request (its x-request-id header, else its body's request_id), else a
    new one."""
    return f"{prefix}-{client_id}" if client_id is not None else new_request_id(prefix)


@api_route
async def models(worker, request: Request) -> Response:
    m = worker.model
    adapters = tuple(worker.adapters or ())
    return json_response(models_body(worker.served_names, worker.started, m.context_length, adapters))


@api_route
async def retrieve_model(worker, request: Request) -> Response:
    """GET /v1/models/{id}: routed at start-up for each served name; asked for any other id, the
    card of the LoRA adapter of that name, else a 404."""
    m = worker.model
    name = request.url.path[len(MODEL_PATH) :]
    base = worker.served_names[0]
    if name in worker.served_names:
        card = model_card(name, worker.started, m.context_length, base)
    elif name in (worker.adapters or ()):
        card = adapter_card(name, worker.started, m.context_length, base)
    else:
        raise model_not_found(name)
    return json_response(orjson_dumps(card))


# ---------------------------------------------------------------- SGLang native


@api_route
async def generate(worker, request: Request) -> Reply:
    check_api(worker, "Generate")
    req = parse_generate(await read_body(request))
    loras = [check_adapter(name, worker.adapters) for name in req.lora_paths] or [0] * len(req.prompts)
    await worker.grammar_checks.check(req.samplings)
    prompt_param = req.samplings[0].prompt_param
    prompt_ids = [await prompt_tokens(worker, p, prompt_param) for p in req.prompts]
    params = [worker.sampling_params(spec, ids, lora) for spec, ids, lora in zip(req.samplings, prompt_ids, loras)]
    n = req.n
    check_request_size(
        [len(ids) for ids in prompt_ids],
        params,
        n,
        prompt_param,
        "sampling_params.n",
        "sampling_params.stop",
        max_tokens=worker.kv_tokens,
    )
    header_rid = client_request_id(request, None) if len(req.rids) == 1 else None  # x-request-id
    rids = [rid or header_rid or new_request_id("gen") for rid in req.rids]
    choice_rids = [rid if n == 1 else f"{rid}-{j}" for rid in rids for j in range(n)]
    group = await worker.submit("generate", prompt_ids, params, n, rids, req.stream)
    group.grammar_param = req.samplings[0].grammar_param
    vocab = worker.vocab if req.return_logprob or params[0].prompt_logprobs >= 0 else None
    if req.stream:
        stream = GenerateStream(choice_rids, req.batch, vocab, req.return_text_in_logprobs)
        return EventStream(generate_events(worker, group, stream), lambda: worker.tm.abort(group), worker.watches)
    states = await finished(worker, request, group)
    return json_response(
        generate_body(choice_rids, choice_results(states), req.batch, vocab, req.return_text_in_logprobs)
    )


def generate_events(worker, group: ReqGroup, stream: GenerateStream) -> AsyncIterator[bytes]:
    def render(state: ReqState) -> bytes:
        text, lp, finish = state.take()
        return stream.delta(
            state.index,
            text,
            usage_of(state),
            finish,
            state.matched_stop,
            lp,
            e2e_latency(state) if finish else None,
            output_ids_of(state),
            state.take_prompt_logprobs(),
        )

    return sse_events(worker, group, render, b"", lambda: DONE)


@api_route
async def tokenize(worker, request: Request) -> Response:
    req = parse_tokenize(await read_body(request))
    check_model(req.model, worker.served_names)
    if req.messages is not None:
        tokens = [await worker.tm.chat_ids(req.messages, req.template)]
    else:
        tokens = [await worker.tm.encode(p, req.add_special_tokens) for p in req.prompts]
    body = (
        {"tokens": tokens, "count": [len(t) for t in tokens]}
        if req.batch
        else {"tokens": tokens[0], "count": len(tokens[0])}
    )
    return json_response(orjson_dumps({**body, "max_model_len": worker.model.context_length}))


@api_route
async def detokenize(worker, request: Request) -> Response:
    req = parse_detokenize(await read_body(request))
    check_model(req.model, worker.served_names)
    for ids in req.token_ids:
        check_token_ids(ids, worker.model.vocab_size, "tokens")
    texts = [await worker.tm.decode(ids, req.skip_special_tokens) for ids in req.token_ids]
    return json_response(orjson_dumps({"text": texts if req.batch else texts[0]}))


@api_route
async def get_model_info(worker, request: Request) -> Response:
    m = worker.model
    return json_response(
        model_info_body(
            m.served_name, m.model_dir, m.context_length, m.vocab_size, m.architecture, worker.args.tokenizer_path
        )
    )


@api_route
async def get_server_info(worker, request: Request) -> Response:
    # The model as served, not the settings' None for the default: sglang-router reads
    # model_path and served_model_name here to name the worker's model (else "unknown").
    m = worker.model
    served = {"model_path": m.model_dir, "served_model_name": m.served_name}
    return json_response(server_info_body(dataclasses.asdict(worker.args), **served, **worker.engine_state()))


@api_route
async def flush_cache(worker, request: Request) -> Response:
    worker.check_alive()
    worker.tm.flush_cache()
    return Response("Cache flushed.\n", media_type="text/plain")


@api_route
async def abort_request(worker, request: Request) -> Response:
    req = parse_abort(await read_body(request))
    aborted = worker.tm.abort_rid(None if req.abort_all else req.rid)
    return json_response(orjson_dumps({"aborted": aborted}))


@api_route
async def get_load(worker, request: Request) -> Response:
    """SGLang's load, one entry per data-parallel rank (here one): sglang-router's
    power_of_two policy polls it and compares num_tokens (KV tokens held by requests)."""
    worker.check_alive()
    e = worker.engine_stats()
    running = queued = used_tokens = 0
    if e is not None:
        running, queued, used_tokens = e["running"], e["queued"], used_kv_pages(e) * e["page_size"]
    load = {"dp_rank": 0, "num_reqs": running + queued, "num_waiting_reqs": queued, "num_tokens": used_tokens}
    return json_response(orjson_dumps([load]))


# ---------------------------------------------------------------- health and metrics


async def health(request: Request) -> Response:
    worker = request.app.worker
    problem = worker.health_problem()
    if problem:
        return error_response(engine_unavailable(problem))
    return paused_health(worker) or Response(b"", 200)


def paused_health(worker) -> Response | None:
    """While /pause_generation holds the engine: 200 saying so (alive, and generation will go on)."""
    stats = worker.engine_stats()
    if not stats or not stats["paused"]:
        return None
    return json_response(orjson_dumps({"status": "paused", "mode": PAUSE_MODES[stats["paused"] - 1]}))


@probe_route
async def health_generate(worker, request: Request) -> Response:
    """Runs one greedy token through the whole engine (none while it is paused: /health's answer)."""
    worker.check_alive()
    paused = paused_health(worker)
    if paused is not None:
        return paused
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    group = await worker.tm.submit([[worker.health_token]], [params])
    try:
        await asyncio.wait_for(group.finished(), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        worker.tm.abort(group)
        raise engine_unavailable(
            f"a 1-token generation did not finish within {HEALTH_GENERATE_TIMEOUT_S:g} s"
        ) from None
    return Response(b"", 200)


@probe_route
async def metrics(worker, request: Request) -> Response:
    body, content_type = worker.metrics.render(
        worker.engine_stats(),
        {
            "dead": worker.tm.dead is not None,
            "index": worker.link.worker,
            "rings": worker.ring_depths(),
            "processes": server_processes(worker.files.server_pid, worker.link.procs),
            "lora": worker.lora_counters(),
        },
    )
    return Response(body, media_type=content_type)


# ---------------------------------------------------------------- the API's description


# Public, as vLLM's: a client reads what the API takes before it holds a key, and the document
# tells nothing the routes do not (whether a key is needed, but not the key).
@probe_route
async def openapi_json(worker, request: Request) -> Response:
    return json_response(served_document(request, worker)[0])


@probe_route
async def docs(worker, request: Request) -> Response:
    return Response(served_document(request, worker)[1], media_type="text/html")


def served_document(request: Request, worker) -> tuple[bytes, bytes]:
    """(/openapi.json, /docs) of the routes this worker's App answers, as it answers them."""
    app = request.app
    routes = tuple((path, tuple(methods)) for path, methods in app.routes.items())
    prefixes = tuple(
        (prefix, tuple((tail, tuple(methods)) for tail, methods in tails.items()))
        for prefix, tails in app.prefixes.items()
    )
    return _document(routes, prefixes, worker.args.root_path or "", worker.args.api_key is not None)


Routes = tuple[tuple[str, tuple[str, ...]], ...]  # path -> methods, hashable


@functools.lru_cache(maxsize=1)  # the routes are fixed once the worker started: one build
def _document(
    routes: Routes, prefixes: tuple[tuple[str, Routes], ...], root_path: str, api_key: bool
) -> tuple[bytes, bytes]:
    names = [path[len(MODEL_PATH) :] for path, _ in routes if path.startswith(MODEL_PATH)]
    by_prefix = {prefix: dict(tails) for prefix, tails in prefixes}
    document = openapi_document(dict(routes), by_prefix, names, root_path, api_key, server_version())
    return orjson_dumps(document), docs_page(document, root_path + "/openapi.json")


ROUTES: dict[str, dict[str, Handler]] = {
    "/v1/chat/completions": {"POST": chat_completions},
    "/v1/chat/completions/batch": {"POST": batch_chat_completions},
    "/invocations": {"POST": invocations},
    "/v1/completions": {"POST": completions},
    "/v1/models": {"GET": models},
    "/generate": {"POST": generate, "PUT": generate},
    "/tokenize": {"POST": tokenize},
    "/detokenize": {"POST": detokenize},
    "/v1/tokenize": {"POST": tokenize},
    "/v1/detokenize": {"POST": detokenize},
    "/get_model_info": {"GET": get_model_info},
    "/get_server_info": {"GET": get_server_info},
    "/model_info": {"GET": get_model_info},  # SGLang's newer names, which sglang-router asks first
    "/server_info": {"GET": get_server_info},
    "/flush_cache": {"POST": flush_cache, "GET": flush_cache},
    "/abort_request": {"POST": abort_request},
    "/get_load": {"GET": get_load},
    "/health": {"GET": health},
    "/health_generate": {"GET": health_generate},
    "/metrics": {"GET": metrics},
    "/openapi.json": {"GET": openapi_json},
    "/docs": {"GET": docs},
}
