"""One request as the scheduler sees it.

What changes every step (token ids, lengths, page table) lives in ReqTable's per-row
numpy arrays, not here: a Req only carries what is needed to (re)admit it.
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from protocol.records import ErrorCode
from protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from gpu.kvcache.radix_cache import TreeNode


class ReqStatus(enum.IntEnum):
    QUEUED = 0  # new, or retracted and waiting to resume
    RUNNING = 1  # holds a row and KV pages
    FINISHED = 2
    COMPILING = 3  # new, waiting for its grammar to compile before it can be queued


class Req:
    __slots__ = (
        "worker",
        "slot",
        "generation",
        "prompt",
        "params",
        "arrival",
        "status",
        "row",
        "node",
        "prefix_pages",
        "cached_tokens",
        "output",
        "tag",
        "error_code",
        "error",
        "grammar",
        "matcher",
        "prompt_logprobs_next",
        "pool_sum",
    )

    def __init__(
        self,
        worker: int,
        slot: int,
        generation: int,
        prompt: np.ndarray,
        params: SamplingParams,
        arrival: int,
        tag: object = None,
    ) -> None:
        self.worker = worker
        self.slot = slot
        self.generation = generation
        self.prompt = prompt  # int32 [P]
        self.params = params
        self.arrival = arrival  # admission order: retraction takes the newest first
        self.status = ReqStatus.QUEUED
        self.row = -1  # row in ReqTable and in the model runner's sampler state while running
        self.node: TreeNode | None = None  # radix node locked for the matched prefix while running
        self.prefix_pages = 0  # pages of this request that belong to the radix tree
        self.cached_tokens = -1  # prompt tokens served from cache on first admission; -1: not yet
        self.output = np.zeros(0, dtype=np.int32)  # tokens generated before a retraction
        self.tag = tag  # its owner's data: the scheduler process keeps the rid's hash here (ABORT_RID)
        self.error_code = ErrorCode.NONE  # why it was refused before running (then finish ERROR)
        self.error = ""  # the same, one line for the user
        self.grammar: Future | None = None  # Future of its compiled grammar while COMPILING (grammar.py)
        self.matcher: Any = None  # a constrained request's grammar state (xgr.GrammarMatcher), from compile to end
        # the next prompt position whose logprob it is owed (SamplingParams.prompt_logprobs); len(prompt):
        # none (never asked, or all sent). Kept across a retraction, so no position is sent twice.
        self.prompt_logprobs_next = (
            min(params.prompt_logprobs_start, len(prompt)) if params.prompt_logprobs >= 0 else len(prompt)
        )

        self.pool_sum: np.ndarray | None = None  # a pooled request's vector so far (runtime/scheduler/pooling.py)

    @property
    def key(self) -> tuple[int, int]:
        return self.worker, self.slot

    def fill_ids(self) -> np.ndarray:
        """Every token known so far: what a (re)admission has to have in the KV cache."""
        return np.concatenate([self.prompt, self.output]) if len(self.output) else self.prompt

    def __repr__(self) -> str:
        return (
            f"Req({self.worker}, {self.slot}, {self.generation}, prompt={len(self.prompt)}, "
            f"output={len(self.output)}, {self.status.name}, row={self.row})"
        )
