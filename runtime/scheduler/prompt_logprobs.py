"""Prompt logprobs (SamplingParams.prompt_logprobs): what the runner is asked to compute for
a step's prefill chunks, and the PROMPT_LOGPROBS records made of its answer."""

from __future__ import annotations

import math

import numpy as np

from gpu.forward_batch import PromptLogprobsAsk
from protocol.payloads import pack_prompt_logprobs
from protocol.record_bytes import concat_records
from protocol.records import TOKEN_OUT, TokenKind
from runtime.scheduler.req import Req

# A PROMPT_LOGPROBS record's payload, in bytes, past which its positions go in several: however
# large a prefill chunk is, each record fits one TOKEN_OUT push (half its arena). A position of a
# whole vocabulary's alternatives (8 bytes each) goes in one record of its own.
PROMPT_LOGPROBS_RECORD_BYTES = 512 << 10


class PromptLogprobs:
    """The prompt positions this step's prefill chunks report, between ask() and records()."""

    def __init__(self) -> None:
        # (request, first, end) of the prompt positions each chunk reports, in step order
        self.runs: list[tuple[Req, int, int]] = []

    def ask(self, prefill: list[tuple[Req, int]], num_decodes: int, starts: np.ndarray) -> PromptLogprobsAsk | None:
        """What the runner computes for the prefill chunks owed prompt logprobs: a chunk of
        positions [s, s + n) reports the prompt positions [next, min(P, s + n + 1)) (position j's
        logprob is read from the logits at j - 1; position 0 has none). Notes them in runs for
        records()."""
        seqs, first, counts, targets = [], [], [], []
        for i, (req, n) in enumerate(prefill):
            P, owed = len(req.prompt), req.prompt_logprobs_next
            if owed >= P:
                continue
            s = int(starts[num_decodes + i])
            end = min(P, s + n + 1)
            if end <= owed:  # a resumed chunk still recomputing positions it reported
                continue
            self.runs.append((req, owed, end))
            lo = max(owed, 1) - 1  # the first position whose logits are read
            if end - 1 > lo:
                seqs.append(num_decodes + i)
                first.append(lo - s)
                counts.append(end - 1 - lo)
                targets.append(req.prompt[lo + 1 : end])
        if not seqs:
            return None
        return PromptLogprobsAsk(
            seqs=np.array(seqs, np.int64),
            first=np.array(first, np.int64),
            counts=np.array(counts, np.int64),
            targets=np.concatenate(targets).astype(np.int64),
            top_k=max(req.params.prompt_logprobs for req, _, _ in self.runs),
        )

    def records(self, out) -> tuple[np.ndarray, list[bytes]]:
        """The PROMPT_LOGPROBS records of this step's runs, from the runner's output."""
        runs, self.runs = self.runs, []
        got = out.prompt_logprobs
        recs, payloads, at = [], [], 0
        for req, owed, end in runs:
            k, m = req.params.prompt_logprobs, end - owed
            lps = np.full(m, np.nan, np.float32)  # position 0: no token predicts it
            ranks = np.zeros(m, np.uint32)
            top_ids = np.zeros((m, k), np.uint32)
            top_lps = np.full((m, k), np.nan, np.float32)
            skip = 1 if owed == 0 else 0  # position 0 is reported, never computed
            c = m - skip
            if c:
                lps[skip:] = got.logprobs[at : at + c]
                ranks[skip:] = got.ranks[at : at + c]
                top_ids[skip:] = got.top_ids[at : at + c, :k]
                top_lps[skip:] = got.top_logprobs[at : at + c, :k]
                at += c
            per_record = max(1, PROMPT_LOGPROBS_RECORD_BYTES // (12 + 8 * k))  # id, logprob, rank; k alternatives
            for a in range(0, m, per_record):
                b = min(a + per_record, m)
                ids = req.prompt[owed + a : owed + b]
                payloads.append(pack_prompt_logprobs(ids, lps[a:b], ranks[a:b], top_ids[a:b], top_lps[a:b]))
                rec = np.zeros(1, TOKEN_OUT.dtype)
                rec["kind"], rec["worker"], rec["slot"] = TokenKind.PROMPT_LOGPROBS, req.worker, req.slot
                rec["gen"], rec["token"], rec["completion_tokens"] = req.generation, owed + a, b - a
                rec["prompt_tokens"], rec["cached_tokens"] = len(req.prompt), max(req.cached_tokens, 0)
                rec["n_top"], rec["logprob"] = k, math.nan
                recs.append(rec)
            req.prompt_logprobs_next = end
        return concat_records(recs), payloads
