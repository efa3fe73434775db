"""The HTTP worker with first-token stamps, for perf/ttft_breakdown.py: run instead of the
plain one when RINGSERVE_TRACE_TTFT names a directory (runtime/http_worker/main.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from httpapi.chat_request import ChatTemplateArgs
from protocol.sampling_params import SamplingParams
from runtime.http_worker.core import TokenizerManager
from runtime.http_worker.process import HTTPWorkerProcess
from runtime.http_worker.req_state import ReqGroup, ReqState
from runtime.ttft_trace import TtftTrace


class TracedTokenizerManager(TokenizerManager):
    """The TokenizerManager with first-token stamps (RINGSERVE_TRACE_TTFT,
    perf/ttft_breakdown.py): when the request's text reached the chat template (its body
    parsed and checked), the encoder, and left it; when its records were pushed; when the
    reader popped its first text; and (`woken`, which its worker process calls) when its
    coroutine took that text. Stamps taken before `submit` names the request are kept by task."""

    def __init__(self, *args: Any, trace: TtftTrace, **kwargs: Any) -> None:
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

    async def submit(
        self,
        prompts: Sequence[Sequence[int] | np.ndarray],
        params: Sequence[SamplingParams],
        rids: Sequence[str] | None = None,
        stream: bool = False,
    ) -> ReqGroup:
        entered = time.monotonic_ns()
        group = await super().submit(prompts, params, rids, stream)
        stamps = {**self._early.pop(asyncio.current_task(), {}), "w_submit": entered, "w_pushed": time.monotonic_ns()}
        for state in group.states:
            self._traced[(state.slot, state.gen)] = dict(stamps)
        return group

    def dispatch(self, recs: np.ndarray, payload: np.ndarray) -> None:
        popped = time.monotonic_ns()
        for key in zip(recs["slot"].tolist(), recs["gen"].tolist()):
            stamps = self._traced.get(key)
            if stamps is not None:
                stamps.setdefault("w_pop", popped)
        super().dispatch(recs, payload)

    def close(self) -> None:
        super().close()
        self.trace.close()

    def woken(self, state: ReqState, now_ns: int) -> None:
        stamps = self._traced.pop((state.slot, state.gen), None)
        if stamps is not None:
            self.trace.write((self.worker, state.slot, state.gen), {**stamps, "w_woken": now_ns})


class TracedHTTPWorkerProcess(HTTPWorkerProcess):
    """The worker process of a TracedTokenizerManager, which it tells when a streamed
    choice's coroutine took its text."""

    tm: TracedTokenizerManager

    def observe_delta(self, state: ReqState, now_ns: int) -> None:
        self.tm.woken(state, now_ns)
        super().observe_delta(state, now_ns)
