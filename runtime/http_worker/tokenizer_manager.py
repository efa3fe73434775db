"""The TokenizerManager: one per HTTP worker, on the worker's event loop.

    tm = TokenizerManager(worker, request_ch, text_ch, waker, tokenizer, model, request_timeout, stream_interval)
    tm.start()                                   # the reader, the sender, the timeout sweeper
    ids = await tm.encode(text) / await tm.chat_ids(messages)
    group = await tm.submit(prompts, params, stream=True)  # one ReqState per choice, records pushed
    while not group.done:                        # streaming
        for state in await group.next_news(): text, logprobs, finish = state.take()
    states = await group.finished()              # non-streaming: every choice done
    tm.abort(group)                              # client gone: ABORT records, slots freed

A request is named on the token path by (worker, slot, gen): `slot` indexes this TM's
table, `gen` is unique in this process (a random start, so a respawned worker's
requests never match its dead predecessor's). One reader task pops the TEXT_OUT
channel for the whole worker, drops stale records with one vectorised gen check, and
appends each record's delta bytes to its request's ReqState; the request's
coroutine is woken with one future per wait, never a queue of per-token objects.
A coroutine that was busy (its client is slow) finds several deltas pending and
sends them as one SSE event. A streamed choice wakes its coroutine at its first token
and then once every `stream_interval` tokens (SGLang's --stream-interval), and at its
end; a non-streamed one only at its end.

Stop strings end a request in the detokenizer, and so does its refusal of a request
past its open limit; the scheduler does not see them, so the TM sends an ABORT for
such a request to free its KV pages. Every other end
(eos, length, abort) comes from the scheduler, which has freed the pages already.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from httpapi.errors import APIError, bad_request, engine_unavailable
from httpapi.logprobs import PromptLogprobs, TokenLogprobs
from httpapi.requests import ChatTemplateArgs
from httpapi.sampling import check_prompt_chars
from protocol.payloads import unpack_logprobs, unpack_prompt_logprobs
from protocol.record_bytes import concat_records, record_fields, take_records
from protocol.records import MAX_REQUEST_PAYLOAD_BYTES, ErrorCode, Finish, RequestKind, TextKind
from protocol.request_records import pack_control, pack_request, rid_hash
from protocol.sampling_params import SamplingParams
from runtime.http_worker.prompt_encoder import PromptEncoder
from runtime.ttft_trace import TtftTrace

logger = logging.getLogger("ringserve.tokenizer_manager")

LONG_PROMPT_CHARS = 4096  # longer texts are tokenized off the event loop
LONG_CONVERSATION_MESSAGES = 64  # longer conversations are rendered off the event loop
LONG_DECODE_IDS = 4096  # longer id lists are decoded off the event loop
NEVER = 1 << 62  # a non-streamed choice's wake_at: only its end wakes it
_PROMPT_LOGPROBS = int(TextKind.PROMPT_LOGPROBS)
TIMEOUT_SWEEP_S = 1.0
MIN_TOKEN_CHARS = 16  # the characters a token may hold, at least (longest_token_chars)


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP layer needs to know about the served model."""

    model_dir: str
    served_name: str
    architecture: str
    context_length: int
    vocab_size: int


def prompt_of(choice: int, n_choices: int, n_prompts: int) -> int:
    """The prompt a choice belongs to: a group's choices are prompt-major (n of each prompt)."""
    return choice * n_prompts // n_choices


def read_chat_template(value: str) -> str:
    """--chat-template's template (a file's text, or the value itself), compiled once as the
    tokenizer's own is: raises ValueError saying why it does not compile."""
    text = Path(value).read_text() if os.path.isfile(value) else value
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: a broken template then fails each chat request (400)
        return text
    try:
        _compile_jinja_template(text)
    except Exception as e:  # jinja2's TemplateSyntaxError and the like
        raise ValueError(f"--chat-template does not compile: {e}") from None
    return text


def longest_token_chars(tokenizer: Any) -> int:
    """Twice the characters of the vocabulary's longest token as the tokenizer spells it (a
    byte-level BPE's token is spelled a character a byte, so it bounds the token's text): a text
    longer than that times the context cannot fit the context, however it tokenizes."""
    try:
        longest = max(map(len, tokenizer.get_vocab()), default=0)
    except Exception:  # a tokenizer without a vocabulary to list
        longest = 64
    return 2 * max(MIN_TOKEN_CHARS, longest)


class ChatTemplate:
    """The tokenizer's chat template, compiled once and rendered directly: a fraction of the
    cost of apply_chat_template, whose per-call conversions plain {"role", "content"}
    messages do not need; and with its variables built once (jinja's render() merges the
    template's globals, a ChainMap, into a new dict every call: most of a short render).
    Used only if it renders a sample conversation exactly as apply_chat_template does;
    otherwise (or on a transformers without the compiler) every render goes through
    apply_chat_template."""

    SAMPLE = (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    )

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._compiled = None
        self._variables: dict[str, Any] = {}  # everything a render sees but the messages
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(tokenizer.chat_template)
            self._variables = dict(
                compiled.globals,
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **getattr(tokenizer, "special_tokens_map", {}),
            )
            sample = [dict(m) for m in self.SAMPLE]
            want = tokenizer.apply_chat_template(sample, add_generation_prompt=True, tokenize=False)
            if self._render(compiled, sample) == want:
                self._compiled = compiled
        except Exception:  # no template, a template that fails the sample, another transformers
            pass

    def _render(self, compiled: Any, messages: list[dict[str, str]]) -> str:
        # the context made as new_context(shared=True) makes it, less the set of the template's
        # globals' names it builds from their ChainMap each time (only imports read it)
        env = compiled.environment
        context = env.context_class(env, {**self._variables, "messages": messages}, compiled.name, compiled.blocks)
        return env.concat(compiled.root_render_func(context))

    @property
    def fast(self) -> bool:
        """Whether renders skip apply_chat_template."""
        return self._compiled is not None

    def render(self, messages: list[dict[str, str]]) -> str:
        if self._compiled is not None:
            return self._render(self._compiled, messages)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


class ClientGone(Exception):
    """The client disconnected; the request was aborted and nothing is left to send."""


class ReqState:
    """One choice in flight: what the reader appended and its coroutine has not taken yet."""

    __slots__ = (
        "group",
        "index",
        "slot",
        "gen",
        "params",
        "parts",
        "logprobs",
        "finish",
        "stop_token",
        "stop_index",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "first_ns",
        "error",
        "in_news",
        "wake_at",
        "sent_tokens",
        "last_ns",
        "output_ids",
        "prompt_logprobs",
    )

    def __init__(
        self, group: ReqGroup, index: int, slot: int, gen: int, params: SamplingParams, prompt_tokens: int
    ) -> None:
        self.group = group
        self.index = index  # the choice's index in the response
        self.slot, self.gen = slot, gen
        self.params = params
        self.parts: list[bytes] = []  # UTF-8 deltas not yet taken
        self.logprobs: list[TokenLogprobs] = []  # their logprobs, when asked
        self.finish = Finish.NONE
        self.stop_token = -1
        self.stop_index = -1
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = prompt_tokens, 0, 0
        self.first_ns = 0  # when its first delta arrived (TTFT)
        self.error: APIError | None = None
        self.in_news = False  # listed in group.news
        self.wake_at = 1 if group.wake_every else NEVER  # completion_tokens that wakes its coroutine
        self.sent_tokens, self.last_ns = 0, 0  # streamed so far, and when (the HTTP layer's)
        self.output_ids: list[int] = []  # every token id so far, when params.return_ids
        self.prompt_logprobs: list[PromptLogprobs] = []  # its PROMPT_LOGPROBS records', not yet taken

    @property
    def finished(self) -> bool:
        return self.finish != Finish.NONE

    def take(self) -> tuple[str, TokenLogprobs | None, str | None]:
        """Every pending delta as one: (text, logprobs or None, finish_reason once finished)."""
        parts, self.parts = self.parts, []
        text = parts[0].decode(errors="replace") if len(parts) == 1 else b"".join(parts).decode(errors="replace")
        lp = None
        if self.logprobs:
            lp = self.logprobs[0] if len(self.logprobs) == 1 else TokenLogprobs.concat(self.logprobs)
            self.logprobs = []
        return text, lp, self.finish.api_name if self.finished else None

    def take_prompt_logprobs(self) -> PromptLogprobs | None:
        """The prompt logprobs received and not taken yet (all of them come before the first token)."""
        if not self.prompt_logprobs:
            return None
        parts, self.prompt_logprobs = self.prompt_logprobs, []
        return PromptLogprobs.concat(parts)

    @property
    def matched_stop(self) -> int | str | None:
        """The stop token id or stop string that ended the request."""
        if self.stop_index >= 0:
            return self.params.stop[self.stop_index]
        return self.stop_token if self.stop_token >= 0 else None


class ReqGroup:
    """The choices of one HTTP request (n x prompts), woken together."""

    __slots__ = (
        "states",
        "rids",
        "arrival_ns",
        "deadline",
        "wake_every",
        "waiter",
        "error",
        "news",
        "unfinished",
        "__weakref__",
    )

    def __init__(self, rids: Sequence[str], arrival_ns: int, deadline: float, wake_every: int) -> None:
        self.states: list[ReqState] = []
        self.rids = rids  # names for /abort_request
        self.arrival_ns = arrival_ns
        self.deadline = deadline  # loop time after which the request is abandoned
        self.wake_every = wake_every  # tokens between wakes of a streamed choice; 0: woken at the end only
        self.waiter: asyncio.Future | None = None
        self.error: BaseException | None = None  # APIError, or ClientGone
        self.news: list[ReqState] = []  # states with something to take, in arrival order
        self.unfinished = 0

    @property
    def done(self) -> bool:
        return self.unfinished == 0 and not self.news

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def next_news(self) -> list[ReqState]:
        """The states that got deltas since the last call (waits for at least one);
        raises the group's error (APIError, ClientGone) if it failed."""
        while not self.news:
            if self.error is not None:
                raise self.error
            if self.unfinished == 0:
                return []
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        if self.error is not None:
            raise self.error
        news, self.news = self.news, []
        for state in news:
            state.in_news = False
        return news

    async def finished(self) -> list[ReqState]:
        """Waits until every choice finished; raises the group's error if it failed."""
        while self.unfinished:
            await self.next_news()
        if self.error is not None:
            raise self.error
        self.news = []
        return self.states


class TokenizerManager:
    def __init__(
        self,
        worker: int,
        request_ch: Any,
        text_ch: Any,
        waker: Any,
        tokenizer: Any,
        model: ModelInfo,
        request_timeout: float,
        stream_interval: int = 1,
    ) -> None:
        self.worker = worker
        self.request_ch, self.text_ch, self.waker = request_ch, text_ch, waker
        self.tokenizer = tokenizer
        self._encoder = PromptEncoder(tokenizer)
        self._chat_template = ChatTemplate(tokenizer)
        self.model = model
        # a prompt text longer than this cannot fit the context: refused before tokenizing it
        self.max_prompt_chars = model.context_length * longest_token_chars(tokenizer)
        self.request_timeout = request_timeout
        self.stream_interval = stream_interval
        self.dead: APIError | None = None  # set when the engine is gone: every request fails with it
        self._gens = np.zeros(256, np.uint32)  # [slots] gen of the request in each slot; 0: free
        self._states: list[ReqState | None] = [None] * 256
        self._free = list(range(255, -1, -1))
        self._next_gen = secrets.randbits(32) or 1
        self._groups: set[ReqGroup] = set()
        self._by_rid: dict[str, ReqGroup] = {}
        self._outbox: list[tuple[np.ndarray, bytes | None]] = []  # REQUEST records waiting for room
        self._outbox_ready: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []

    # ---------------------------------------------------------------- life

    def start(self) -> None:
        self._outbox_ready = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._read_loop(), name="tm-reader"),
            asyncio.create_task(self._send_loop(), name="tm-sender"),
            asyncio.create_task(self._sweep_loop(), name="tm-timeouts"),
        ]

    async def close(self) -> None:
        self.fail_all(engine_unavailable("The server is shutting down."))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def detach_channels(self) -> None:
        """The engine is gone (after fail_all): stops reading and sending on its channels and
        drops what waited to be sent. The channels stay open (an abort still pushes into them,
        harmlessly) until the caller closes them."""
        io = [t for t in self._tasks if t.get_name() in ("tm-reader", "tm-sender")]
        for task in io:
            task.cancel()
        await asyncio.gather(*io, return_exceptions=True)
        self._tasks = [t for t in self._tasks if t not in io]
        self._outbox.clear()

    def attach_channels(self, request_ch: Any, text_ch: Any, waker: Any) -> None:
        """A new engine's channels, after detach_channels: reading and sending resume on them
        and new requests are taken again (the failed ones left no slot behind)."""
        self.request_ch, self.text_ch, self.waker = request_ch, text_ch, waker
        self._outbox_ready = asyncio.Event()
        self._tasks += [
            asyncio.create_task(self._read_loop(), name="tm-reader"),
            asyncio.create_task(self._send_loop(), name="tm-sender"),
        ]
        self.dead = None

    def fail_all(self, err: APIError) -> None:
        """The engine is gone (or the worker stops): every request fails with `err`, new ones too."""
        self.dead = err
        for group in list(self._groups):
            self._fail(group, err, abort=False)

    # ---------------------------------------------------------------- tokenizing

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < LONG_PROMPT_CHARS:
            return self._encoder.encode(text, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(None, self._encoder.encode, text, add_special_tokens)

    async def chat_ids(self, messages: list[dict[str, Any]], template: ChatTemplateArgs | None = None) -> list[int]:
        """The chat template applied and tokenized, as apply_chat_template(tokenize=True) does.
        A conversation that cannot fit the context (more messages than the context has tokens,
        or more text than it can hold) is refused before the template renders it. `template`:
        tools, documents, chat_template_kwargs and the like (None: plain messages, the fast
        render); such a render goes through apply_chat_template, off the event loop (it costs
        milliseconds, and tools and documents may be large)."""
        if len(messages) > self.model.context_length:
            raise bad_request(
                f"messages has {len(messages)} messages, more than this model's context of "
                f"{self.model.context_length} tokens can hold",
                "messages",
                code="context_length_exceeded",
            )
        chars = sum(len(m["content"]) for m in messages)
        check_prompt_chars(chars, self.max_prompt_chars, "messages")
        render = self._chat_template.render
        try:
            if template is not None:
                text = await asyncio.to_thread(
                    self.tokenizer.apply_chat_template, messages, tokenize=False, **template.call_kwargs()
                )
            elif len(messages) > LONG_CONVERSATION_MESSAGES or chars >= LONG_PROMPT_CHARS:
                text = await asyncio.to_thread(render, messages)  # the loop keeps serving the other streams
            else:
                text = render(messages)
        except Exception as e:  # jinja raises for conversations a template refuses (e.g. roles out of order)
            raise bad_request(f"messages: the model's chat template rejected them: {e}", "messages") from None
        check_prompt_chars(len(text), self.max_prompt_chars, "messages")
        return await self.encode(text, add_special_tokens=template is not None and template.add_special_tokens)

    async def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids, special tokens included unless skipped (an echoed prompt is
        the prompt as given). Long lists are decoded off the event loop."""
        if len(ids) < LONG_DECODE_IDS:
            return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return await asyncio.to_thread(self.tokenizer.decode, list(ids), skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------- requests in

    async def submit(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray],
        params: Sequence[SamplingParams],
        rids: Sequence[str] | None = None,
        stream: bool = False,
    ) -> ReqGroup:
        """Starts one choice per (prompt, params): their records are in the REQUEST channel
        (or queued for room) when this returns. `stream`: its deltas are awaited one by one
        (next_news), else only its end (finished)."""
        if self.dead is not None:
            raise self.dead
        for rid in rids or ():  # /abort_request must reach every request its rid names
            if rid in self._by_rid:
                raise bad_request(f"rid {rid!r} is already in use by a request in flight", "rid")
        loop = asyncio.get_running_loop()
        now_ns = time.monotonic_ns()
        group = ReqGroup(rids or (), now_ns, loop.time() + self.request_timeout, self.stream_interval if stream else 0)
        n = len(prompts)
        rid_hashes = [rid_hash(rid) for rid in group.rids] or [0]
        records, blobs, size = [], [], 0
        try:
            for index, (ids, p) in enumerate(zip(prompts, params)):
                slot, gen = self._alloc()
                state = ReqState(group, index, slot, gen, p, len(ids))
                self._states[slot] = state
                group.states.append(state)
                tag = rid_hashes[prompt_of(index, n, len(rid_hashes))]
                rec, blob = pack_request(self.worker, slot, gen, p, ids, now_ns, tag, base=size)
                blob += b"\0" * (-len(blob) % 4)  # the next request's ids stay 4-byte aligned
                records.append(rec)
                blobs.append(blob)
                size += len(blob)
            if size > MAX_REQUEST_PAYLOAD_BYTES:  # the routes refuse such a request first (check_request_size)
                raise bad_request(f"The request's prompts and stop strings take {size} bytes: too many", None)
            group.unfinished = len(group.states)
            self._groups.add(group)
            for rid in group.rids:
                self._by_rid[rid] = group
            if len(records) == 1:
                self._send(records[0], blobs[0])
            else:
                self._send(concat_records(records), b"".join(blobs))
        except BaseException:  # nothing was pushed (a push that fails publishes nothing): unregister it all
            for state in group.states:
                self._release(state)
            group.unfinished = 0
            self._forget(group)
            raise
        return group

    def abort(self, group: ReqGroup) -> None:
        """The client is gone: ABORT records for the group's unfinished choices (the scheduler
        frees their KV pages), slots freed; its waiters get ClientGone."""
        self._fail(group, ClientGone(), abort=True)

    def abort_rid(self, rid: str | None) -> int:
        """/abort_request: the request named `rid`, or every request of the server for None.
        This worker's are ended here (returns how many); another worker's through the
        scheduler, which ends them with finish_reason "abort" in their own streams (another
        worker may hold a request of the same rid: a worker sees only its own)."""
        groups = list(self._groups) if rid is None else [g for g in (self._by_rid.get(rid),) if g is not None]
        for group in groups:  # a batch's other prompts have rids of their own, as the scheduler sees them
            self._fail(group, None, abort=True, rid=rid)
        if rid is None:
            self._send(pack_control(RequestKind.ABORT_ALL, self.worker), None)
        else:
            self._send(pack_control(RequestKind.ABORT_RID, self.worker, rid=rid_hash(rid)), None)
        return len(groups)

    def flush_cache(self) -> None:
        self._send(pack_control(RequestKind.FLUSH_CACHE, self.worker), None)

    def _alloc(self) -> tuple[int, int]:
        if not self._free:
            n = len(self._gens)
            self._gens = np.concatenate([self._gens, np.zeros(n, np.uint32)])
            self._states.extend([None] * n)
            self._free = list(range(2 * n - 1, n - 1, -1))
        slot = self._free.pop()
        gen = self._next_gen
        self._next_gen = (gen + 1) & 0xFFFFFFFF or 1  # 0 marks a free slot
        self._gens[slot] = gen
        return slot, gen

    def _release(self, state: ReqState) -> None:
        """The slot is free again: its later records (a stale gen) are dropped by the reader."""
        slot = state.slot
        if self._states[slot] is state:
            self._gens[slot] = 0
            self._states[slot] = None
            self._free.append(slot)

    def _fail(self, group: ReqGroup, err: BaseException | None, abort: bool, rid: str | None = None) -> None:
        """Ends every unfinished choice (only those of `rid` if given) with finish "abort": with
        `err`, the group raises it; without, its choices end normally (/abort_request).
        `abort`: tell the scheduler."""
        aborts = []
        states = group.states
        if rid is not None and len(group.rids) > 1:
            states = [st for st in states if group.rids[prompt_of(st.index, len(states), len(group.rids))] == rid]
        for state in states:
            if not state.finished:
                if abort:
                    aborts.append(pack_control(RequestKind.ABORT, self.worker, state.slot, state.gen))
                state.finish = Finish.ABORT
                self._release(state)
                if not state.in_news:
                    state.in_news = True
                    group.news.append(state)
                group.unfinished -= 1
        if aborts and self.dead is None:
            self._send(concat_records(aborts), None)
        if group.error is None:
            group.error = err
        if group.unfinished == 0:
            self._forget(group)
        elif self._by_rid.get(rid) is group:
            del self._by_rid[rid]
        group._wake()

    def _forget(self, group: ReqGroup) -> None:
        self._groups.discard(group)
        for rid in group.rids:
            if self._by_rid.get(rid) is group:
                del self._by_rid[rid]

    # ---------------------------------------------------------------- the REQUEST channel

    def _send(self, records: np.ndarray, blob: bytes | None) -> None:
        """In order: behind anything still waiting for room."""
        if not self._outbox:
            done = self.request_ch.push(records, blob)
            if done == len(records):
                return
            records = records[done:]
        self._outbox.append((records, blob))
        self._outbox_ready.set()

    async def _send_loop(self) -> None:
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready.clear()
            while self._outbox:
                records, blob = self._outbox[0]
                await self.request_ch.push_all_async(records, blob)
                self._outbox.pop(0)

    # ---------------------------------------------------------------- the TEXT_OUT channel

    async def _read_loop(self) -> None:
        ch, waker = self.text_ch, self.waker
        while True:
            batch = ch.pop()
            if batch is None:
                await waker.wait_readable_async([ch])
                continue
            try:
                self._dispatch(batch.records, batch.payload)
            except Exception:  # a bug here must not silence every stream of the worker
                logger.exception("text-out batch of %d records dropped", len(batch.records))

    def _dispatch(self, recs: np.ndarray, payload: np.ndarray) -> None:
        slots = recs["slot"]
        gens = self._gens
        inside = slots < len(gens)
        live = inside & (gens[np.where(inside, slots, 0)] == recs["gen"])
        if not live.all():
            recs = take_records(recs, live)
            if not len(recs):
                return
        blob = payload.tobytes()
        states = self._states
        now_ns = time.monotonic_ns()
        aborts = []
        special = (
            (recs["finish"] != Finish.NONE)
            | (recs["kind"] != TextKind.TEXT)
            | (recs["logprobs_len"] > 0)
            | (recs["ids_len"] > 0)
        )
        for slot, off, n, completion, odd, i in zip(
            recs["slot"].tolist(),
            recs["text_off"].tolist(),
            recs["text_len"].tolist(),
            recs["completion_tokens"].tolist(),
            special.tolist(),
            range(len(recs)),
        ):
            state = states[slot]
            if state is None:  # ended earlier in this batch
                continue
            if odd and recs["kind"][i] == _PROMPT_LOGPROBS:  # no token yet: nothing to wake for
                self._prompt_logprobs(state, recs[i], payload)
                continue
            if n:
                state.parts.append(blob[off : off + n])
            state.completion_tokens = completion
            if not state.first_ns:
                state.first_ns = now_ns
            if odd and self._special(state, recs[i], payload):
                aborts.append(pack_control(RequestKind.ABORT, self.worker, state.slot, state.gen))
            if not state.in_news and (completion >= state.wake_at or state.finished):
                group = state.group
                state.wake_at = completion + group.wake_every
                state.in_news = True
                group.news.append(state)
                group._wake()
        if aborts:
            self._send(concat_records(aborts), None)

    @staticmethod
    def _prompt_logprobs(state: ReqState, rec: np.void, payload: np.ndarray) -> None:
        r = record_fields(rec)
        part = payload[r["logprobs_off"] : r["logprobs_off"] + r["logprobs_len"]]
        ids, lps, ranks, top_ids, top_lps = unpack_prompt_logprobs(part, r["n_tokens"], r["n_top"])
        state.prompt_logprobs.append(  # copies: views would keep the whole batch's payload alive
            PromptLogprobs(
                r["stop_token"],
                ids.astype(np.int64),
                lps.astype(np.float64),
                ranks.astype(np.int64),
                top_ids.astype(np.int64),
                top_lps.astype(np.float64),
            )
        )

    def _special(self, state: ReqState, rec: np.void, payload: np.ndarray) -> bool:
        """Token ids, logprobs, errors and finishes of one record; True when the scheduler must be told
        to abort the request: a stop string ended it in the detokenizer, or an error did (the
        detokenizer refuses a request past its open limit while the scheduler holds it; an
        engine rejection's abort is stale there and ignored)."""
        r = record_fields(rec)
        if r["ids_len"]:
            state.output_ids += payload[r["ids_off"] : r["ids_off"] + r["ids_len"]].view(np.uint32).tolist()
        if r["logprobs_len"]:
            k = r["n_top"]
            n_tokens = r["logprobs_len"] // (8 * (1 + k))
            part = payload[r["logprobs_off"] : r["logprobs_off"] + r["logprobs_len"]]
            state.logprobs.append(TokenLogprobs.of(*unpack_logprobs(part, n_tokens, k)))
        finish = r["finish"]
        if finish == Finish.NONE:
            return False
        state.prompt_tokens = r["prompt_tokens"]
        state.cached_tokens = r["cached_tokens"]
        if r["kind"] == TextKind.ERROR:
            message = bytes(payload[r["text_off"] : r["text_off"] + r["text_len"]]).decode(errors="replace")
            state.parts = []
            state.error = engine_error(r["error"], message)
            finish = Finish.ERROR
        state.finish = Finish(finish)
        state.stop_token, state.stop_index = r["stop_token"], r["stop_index"]
        self._release(state)
        group = state.group
        group.unfinished -= 1
        if state.error is not None and group.error is None:
            self._fail(group, state.error, abort=True)  # the other choices cannot complete the response
        elif group.unfinished == 0:
            self._forget(group)
        return state.error is not None or (state.stop_index >= 0 and finish == Finish.STOP)

    # ---------------------------------------------------------------- timeouts

    async def _sweep_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TIMEOUT_SWEEP_S)
            now = loop.time()
            for group in [g for g in self._groups if g.deadline < now]:
                logger.warning("request timed out after %.0f s (request_timeout): aborted", self.request_timeout)
                self._fail(
                    group,
                    APIError(
                        504,
                        f"The request did not finish within the server's request "
                        f"timeout of {self.request_timeout:g} s.",
                        type="server_error",
                        code="timeout",
                    ),
                    abort=True,
                )

    # ---------------------------------------------------------------- introspection

    def ring_depths(self) -> dict[str, int]:
        """Records waiting in this worker's rings (the zmq baseline cannot tell)."""
        return {
            name: len(ch)
            for name, ch in (("request", self.request_ch), ("text_out", self.text_ch))
            if hasattr(ch, "__len__")
        }


class TracedTokenizerManager(TokenizerManager):
    """The TokenizerManager with first-token stamps (RINGSERVE_TRACE_TTFT,
    perf/ttft_breakdown.py): when the request's text reached the chat template (its body
    parsed and checked), the encoder, and left it; when its records were pushed; when the
    reader popped its first text; and (`woken`, which the stream's loop calls) when its
    coroutine took that text. Stamps taken before `submit` names the request are kept by task."""

    def __init__(self, *args, trace: TtftTrace, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trace = trace
        self._early: dict[asyncio.Task | None, dict[str, int]] = {}  # task -> stamps before its submit
        self._traced: dict[tuple[int, int], dict[str, int]] = {}  # (slot, gen) -> stamps until first taken

    def _stamp(self, stage: str) -> None:
        self._early.setdefault(asyncio.current_task(), {}).setdefault(stage, time.monotonic_ns())

    async def chat_ids(self, messages: list[dict[str, Any]], template: ChatTemplateArgs | None = None) -> list[int]:
        self._stamp("w_parsed")
        return await super().chat_ids(messages, template)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._stamp("w_parsed")
        self._stamp("w_templated")
        ids = await super().encode(text, add_special_tokens)
        self._early[asyncio.current_task()]["w_encoded"] = time.monotonic_ns()
        return ids

    async def submit(self, prompts, params, rids=None, stream: bool = False) -> ReqGroup:
        entered = time.monotonic_ns()
        group = await super().submit(prompts, params, rids, stream)
        stamps = {**self._early.pop(asyncio.current_task(), {}), "w_submit": entered, "w_pushed": time.monotonic_ns()}
        for state in group.states:
            self._traced[(state.slot, state.gen)] = dict(stamps)
        return group

    def _dispatch(self, recs: np.ndarray, payload: np.ndarray) -> None:
        popped = time.monotonic_ns()
        for key in zip(recs["slot"].tolist(), recs["gen"].tolist()):
            stamps = self._traced.get(key)
            if stamps is not None:
                stamps.setdefault("w_pop", popped)
        super()._dispatch(recs, payload)

    async def close(self) -> None:
        await super().close()
        self.trace.close()

    def woken(self, state: ReqState, now_ns: int) -> None:
        stamps = self._traced.pop((state.slot, state.gen), None)
        if stamps is not None:
            self.trace.write((self.worker, state.slot, state.gen), {**stamps, "w_woken": now_ns})


def engine_error(code: int, message: str) -> APIError:
    """The APIError of a request the engine ended with an ERROR record."""
    if code in (ErrorCode.PROMPT_TOO_LONG, ErrorCode.INVALID_REQUEST):
        return bad_request(
            message or "The engine rejected the request.",
            None,
            code="context_length_exceeded" if code == ErrorCode.PROMPT_TOO_LONG else None,
        )
    if code == ErrorCode.OVERLOADED:
        return engine_unavailable(message or "The engine is overloaded; retry later.")
    return APIError(500, message or "The engine failed the request.", type="server_error", code="internal_error")
