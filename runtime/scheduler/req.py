"""One request as the scheduler sees it, and the finish reasons it can end with.

What changes every step (token ids, lengths, page table) lives in ReqTable's per-row
numpy arrays, not here: a Request only carries what is needed to (re)admit it.
"""
from __future__ import annotations

import enum

import numpy as np

from protocol.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    NONE = 0  # still running
    STOP = 1  # EOS or a stop token (stop strings are the detokenizer's)
    LENGTH = 2  # max_tokens, or the context / KV pool ran out
    ABORT = 3
    ERROR = 4  # never ran: the prompt does not fit

    @property
    def api_name(self) -> str | None:
        """The OpenAI `finish_reason` string."""
        return None if self is FinishReason.NONE else self.name.lower()


class Rejection(enum.IntEnum):
    """Why a request ended with FinishReason.ERROR before running."""
    NONE = 0
    PROMPT_TOO_LONG = 1  # longer than the context or the KV pool
    INVALID_REQUEST = 2  # empty prompt, token ids outside the vocabulary, bad sampling parameters


class ReqStatus(enum.IntEnum):
    QUEUED = 0  # new, or retracted and waiting to resume
    RUNNING = 1  # holds a row and KV pages
    FINISHED = 2


class Request:
    __slots__ = ("worker", "slot", "generation", "prompt", "params", "arrival", "status",
                 "row", "node", "prefix_pages", "cached_tokens", "output", "tag", "rejection", "error")

    def __init__(self, worker: int, slot: int, generation: int, prompt: np.ndarray,
                 params: SamplingParams, arrival: int, tag: object = None) -> None:
        self.worker = worker
        self.slot = slot
        self.generation = generation
        self.prompt = prompt  # int32 [P]
        self.params = params
        self.arrival = arrival  # admission order: retraction takes the newest first
        self.status = ReqStatus.QUEUED
        self.row = -1  # row in ReqTable and in the model runner's sampler state while running
        self.node = None  # radix node locked for the matched prefix while running
        self.prefix_pages = 0  # pages of this request that belong to the radix tree
        self.cached_tokens = -1  # prompt tokens served from cache on first admission; -1: not yet
        self.output = np.zeros(0, dtype=np.int32)  # tokens generated before a retraction
        self.tag = tag  # its owner's data: the scheduler process keeps the rid's hash here (ABORT_RID)
        self.rejection = Rejection.NONE
        self.error = ""  # why it was rejected, one line for the user

    @property
    def key(self) -> tuple[int, int]:
        return self.worker, self.slot

    def fill_ids(self) -> np.ndarray:
        """Every token known so far: what a (re)admission has to have in the KV cache."""
        return np.concatenate([self.prompt, self.output]) if len(self.output) else self.prompt

    def __repr__(self) -> str:
        return (f"Request({self.worker}, {self.slot}, {self.generation}, prompt={len(self.prompt)}, "
                f"output={len(self.output)}, {self.status.name}, row={self.row})")
