"""The TokenizerManager: one per HTTP worker, on the worker's event loop; transport-free (the
worker process, process.py, moves its records through the rings).

    tm = TokenizerManager(worker, send, tokenizer, model, request_timeout, stream_interval)
    ids = await tm.encode(text) / await tm.chat_ids(messages)
    group = await tm.submit(prompts, params, stream=True)  # one ReqState per choice, records sent
    tm.dispatch(records, payload)                # each TEXT_OUT batch the worker's reader pops
    while not group.done:                        # streaming
        for state in await group.next_news(): text, logprobs, finish = state.take()
    states = await group.finished()              # non-streaming: every choice done
    tm.abort(group)                              # client gone: ABORT records, slots freed

A request is named on the token path by (worker, slot, gen): `slot` indexes this TM's
table, `gen` is unique in this process (a random start, so a respawned worker's
requests never match its dead predecessor's). The worker's one reader hands each TEXT_OUT
batch to `dispatch`, which drops stale records with one vectorised gen check and
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
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from httpapi.chat_request import ChatTemplateArgs
from httpapi.errors import APIError, bad_request, engine_error, engine_unavailable
from httpapi.logprobs import PromptLogprobs, TokenLogprobs
from httpapi.sampling import check_prompt_chars
from protocol.payloads import unpack_logprobs, unpack_prompt_logprobs
from protocol.record_bytes import concat_records, record_fields, take_records
from protocol.records import MAX_REQUEST_PAYLOAD_BYTES, Finish, RequestKind, TextKind
from protocol.request_records import pack_call, pack_control, pack_request, rid_hash
from protocol.sampling_params import SamplingParams
from runtime.http_worker.chat_template import ChatTemplate
from runtime.http_worker.prompt_encoder import PromptEncoder
from runtime.http_worker.req_state import ClientGone, ReqGroup, ReqState

logger = logging.getLogger("ringserve.tokenizer_manager")

LONG_PROMPT_CHARS = 4096  # longer texts are tokenized off the event loop
LONG_CONVERSATION_MESSAGES = 64  # longer conversations are rendered off the event loop
LONG_DECODE_IDS = 4096  # longer id lists are decoded off the event loop
_PROMPT_LOGPROBS = int(TextKind.PROMPT_LOGPROBS)
_REPLY = int(TextKind.REPLY)
MIN_TOKEN_CHARS = 16  # the characters a token may hold, at least (longest_token_chars)


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP layer needs to know about the served model."""

    model_dir: str
    served_name: str
    architecture: str
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()  # what ends a beam (beam_search.py); the scheduler stops at them itself


def prompt_of(choice: int, n_choices: int, n_prompts: int) -> int:
    """The prompt a choice belongs to: a group's choices are prompt-major (n of each prompt)."""
    return choice * n_prompts // n_choices


def longest_token_chars(tokenizer: Any) -> int:
    """Twice the characters of the vocabulary's longest token as the tokenizer spells it (a
    byte-level BPE's token is spelled a character a byte, so it bounds the token's text): a text
    longer than that times the context cannot fit the context, however it tokenizes."""
    try:
        longest = max(map(len, tokenizer.get_vocab()), default=0)
    except Exception:  # a tokenizer without a vocabulary to list
        longest = 64
    return 2 * max(MIN_TOKEN_CHARS, longest)


class TokenizerManager:
    """The worker's requests on the token path: tokenizing, the slot table, REQUEST records
    out (through `send`, the worker process's outbox) and TEXT_OUT records in (dispatch)."""

    def __init__(
        self,
        worker: int,
        send: Callable[[np.ndarray, bytes | None], None],
        tokenizer: Any,
        model: ModelInfo,
        request_timeout: float,
        stream_interval: int = 1,
    ) -> None:
        self.worker = worker
        self._send = send
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
        self._calls: dict[int, asyncio.Future] = {}  # slot -> the engine call waiting there for its REPLY

    # ---------------------------------------------------------------- life

    def close(self) -> None:
        """The worker stops: every request fails, new ones too."""
        self.fail_all(engine_unavailable("The server is shutting down."))

    def resume(self) -> None:
        """A new engine took the place of the one lost (fail_all): new requests are taken
        again (the failed ones left no slot behind)."""
        self.dead = None

    def fail_all(self, err: APIError) -> None:
        """The engine is gone (or the worker stops): every request fails with `err`, new ones too."""
        self.dead = err
        for group in list(self._groups):
            self._fail(group, err.fresh(), abort=False)

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
            raise self.dead.fresh()
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

    def stop_choice(self, state: ReqState, matched: str) -> None:
        """Ends a choice as stopped by `matched`, a stop_regex pattern its coroutine found in its
        text (which it takes next: the choice is not posted again): finish "stop", and an ABORT
        record so that the scheduler stops generating it, unless it had ended already."""
        finished = state.finished
        state.finish, state.stop_pattern = Finish.STOP, matched
        if finished:
            return
        if self.dead is None:
            self._send(pack_control(RequestKind.ABORT, self.worker, state.slot, state.gen), None)
        self._release(state)
        group = state.group
        group.unfinished -= 1
        if group.unfinished == 0:
            self._forget(group)

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

    async def call(self, args: dict[str, Any], timeout: float) -> dict[str, Any]:
        """An engine call (runtime/scheduler/control.py: pause, continue, weights) and its
        answer. It holds a slot of this worker's table, as a request does, so that its REPLY
        comes back here and a late one (past `timeout`, a 504) is dropped as stale."""
        if self.dead is not None:
            raise self.dead.fresh()
        slot, gen = self._alloc()
        answer = asyncio.get_running_loop().create_future()
        self._calls[slot] = answer
        try:
            self._send(*pack_call(self.worker, slot, gen, orjson.dumps(args)))
            return await asyncio.wait_for(answer, timeout)
        except asyncio.TimeoutError:
            raise APIError(
                504, f"The engine did not answer within {timeout:g} s.", type="server_error", code="timeout"
            ) from None
        finally:
            del self._calls[slot]
            self._gens[slot] = 0
            self._free.append(slot)

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
                group.post(state)
                group.unfinished -= 1
        if aborts and self.dead is None:
            self._send(concat_records(aborts), None)
        if group.error is None:
            group.error = err
        if group.unfinished == 0:
            self._forget(group)
        elif rid is not None and self._by_rid.get(rid) is group:
            del self._by_rid[rid]
        group.wake()

    def _forget(self, group: ReqGroup) -> None:
        self._groups.discard(group)
        for rid in group.rids:
            if self._by_rid.get(rid) is group:
                del self._by_rid[rid]

    # ---------------------------------------------------------------- records in

    def dispatch(self, recs: np.ndarray, payload: np.ndarray) -> None:
        """One batch of TEXT_OUT records: each live one's delta appended to its choice's
        ReqState, whose coroutine is woken as its stream interval says; a stale one (a
        released slot's) dropped."""
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
            if state is None:  # ended earlier in this batch, or an engine call's slot
                if odd and slot in self._calls:
                    self._reply(slot, recs[i], blob)
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
                state.wake_at = completion + state.group.wake_every
                state.group.post(state)
        if aborts:
            self._send(concat_records(aborts), None)

    def _reply(self, slot: int, rec: np.void, blob: bytes) -> None:
        answer = self._calls[slot]
        if rec["kind"] == _REPLY and not answer.done():
            off, n = int(rec["text_off"]), int(rec["text_len"])
            answer.set_result(orjson.loads(blob[off : off + n]))

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
            pinned = bool(state.params.logprob_token_ids)
            state.logprobs.append(TokenLogprobs.of(*unpack_logprobs(part, n_tokens, k), pinned=pinned))
        finish = r["finish"]
        if finish == Finish.NONE:
            return False
        state.prompt_tokens = r["prompt_tokens"]
        state.cached_tokens = r["cached_tokens"]
        if r["kind"] == TextKind.ERROR:
            message = bytes(payload[r["text_off"] : r["text_off"] + r["text_len"]]).decode(errors="replace")
            state.parts = []
            state.error = engine_error(r["error"], message, state.group.grammar_param)
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

    def sweep_timeouts(self, now: float) -> None:
        """Every request past its deadline (loop time `now`) fails with a 504 and is aborted."""
        for group in [g for g in self._groups if g.deadline < now]:
            logger.warning("request timed out after %.0f s (request_timeout): aborted", self.request_timeout)
            self._fail(
                group,
                APIError(
                    504,
                    f"The request did not finish within the server's request timeout of {self.request_timeout:g} s.",
                    type="server_error",
                    code="timeout",
                ),
                abort=True,
            )
