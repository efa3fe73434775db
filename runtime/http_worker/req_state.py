"""A request in flight on the HTTP side: one ReqGroup per HTTP request, one ReqState per choice.

The TokenizerManager appends what TEXT_OUT records bring to a choice's ReqState and posts it
to its group; the request's coroutine takes it (next_news, then take) once woken.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence

from httpapi.errors import APIError
from httpapi.logprobs import PromptLogprobs, TokenLogprobs
from protocol.records import Finish
from protocol.sampling_params import SamplingParams

NEVER = 1 << 62  # a non-streamed choice's wake_at: only its end wakes it


class ClientGone(Exception):
    """The client disconnected; the request was aborted and nothing is left to send."""


class ReqState:
    """One choice in flight: what the reader appended and its coroutine has not taken yet."""

    __slots__ = (
        "_group",
        "index",
        "slot",
        "gen",
        "params",
        "parts",
        "logprobs",
        "finish",
        "stop_token",
        "stop_index",
        "stop_pattern",
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
        "kept",
    )

    def __init__(
        self, group: ReqGroup, index: int, slot: int, gen: int, params: SamplingParams, prompt_tokens: int
    ) -> None:
        # weak: the group holds its states, and a cycle would leave every finished request's
        # group, states and lists to the cyclic collector (whose young collections then ran
        # every ~2,000 requests, each scanning every live request's objects); the TokenizerManager
        # holds a group while any of its choices is unfinished, its route while it renders
        self._group = weakref.ref(group)
        self.index = index  # the choice's index in the response
        self.slot, self.gen = slot, gen
        self.params = params
        self.parts: list[bytes] = []  # UTF-8 deltas not yet taken
        self.logprobs: list[TokenLogprobs] = []  # their logprobs, when asked
        self.finish = Finish.NONE
        self.stop_token = -1
        self.stop_index = -1
        self.stop_pattern: str | None = None  # the stop_regex pattern that ended it (stop_regex.py)
        self.prompt_tokens, self.completion_tokens, self.cached_tokens = prompt_tokens, 0, 0
        self.first_ns = 0  # when its first delta arrived (TTFT)
        self.error: APIError | None = None
        self.in_news = False  # listed in group.news
        self.wake_at = 1 if group.wake_every else NEVER  # completion_tokens that wakes its coroutine
        self.sent_tokens, self.last_ns = 0, 0  # streamed so far, and when (the HTTP layer's)
        self.output_ids: list[int] = []  # every token id so far, when params.return_ids
        self.prompt_logprobs: list[PromptLogprobs] = []  # its PROMPT_LOGPROBS records', not yet taken
        self.kept: list[str] | None = None  # every text taken, when the request is dumped (request_dump.py)

    @property
    def group(self) -> ReqGroup:
        group = self._group()
        assert group is not None, "a choice outlived its group"
        return group

    @property
    def finished(self) -> bool:
        return self.finish != Finish.NONE

    def take(self) -> tuple[str, TokenLogprobs | None, str | None]:
        """Every pending delta as one: (text, logprobs or None, finish_reason once finished)."""
        parts, self.parts = self.parts, []
        text = parts[0].decode(errors="replace") if len(parts) == 1 else b"".join(parts).decode(errors="replace")
        if self.kept is not None:
            self.kept.append(text)
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
        """The stop token id, stop string or stop_regex pattern that ended the request."""
        if self.stop_pattern is not None:
            return self.stop_pattern
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
        "grammar_param",
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
        # the field its grammar came from, which the engine's grammar errors name (set by the route
        # as submit returns: no record is read in between)
        self.grammar_param: str | None = None

    @property
    def done(self) -> bool:
        return self.unfinished == 0 and not self.news

    def post(self, state: ReqState) -> None:
        """`state` has something to take: listed in news (once) and the group's coroutine woken."""
        if not state.in_news:
            state.in_news = True
            self.news.append(state)
        self.wake()

    def wake(self) -> None:
        """The group's coroutine, if it waits, runs again (to see news, or its error)."""
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
