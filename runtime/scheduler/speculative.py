"""N-gram speculative decoding (SGLang's `--speculative-algorithm NGRAM`): a running greedy
request's next tokens are drafted from its own earlier tokens (prompt lookup: the latest
earlier place where its last tokens occurred, and what followed them there), and the step
verifies them in the same forward as its normal decode, at one logits row per drafted token.
The scheduler keeps the longest prefix of the draft the model itself chose plus the model's
next token, so a greedy request's text is the same with speculation off.

Drafting costs a lookup on the host, and a drafted row runs 1 + k tokens through the model
instead of 1 (on a CPU, through the Python forward instead of the C decode loop): worth it
only where drafts are accepted. So each request adapts its draft length to what it has been
accepting, stops drafting for a while after drafts it rejected whole (longer each time), and
nothing is drafted in steps with more decodes than MAX_BATCH, where a forward is compute
bound and rejected tokens cost as much as accepted ones.

Only plain greedy requests are drafted for (no penalties, no pending min_tokens, no grammar, no
thinking budget): their choice at each drafted position does not depend on the tokens sampled
before it in the same step, so verifying k positions at once is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpu.kvcache.req_table import ReqTable
from protocol.record_bytes import concat_records
from protocol.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

# decodes in a step above which none is drafted for
MAX_BATCH = 4
# steps a request waits before drafting again after its m-th draft in a row rejected whole:
# min(2**m, MAX_BACKOFF)
MAX_BACKOFF = 64


@dataclass
class SpeculationStats:
    verifies: int = 0  # drafted rows verified (a row that drafts in n steps counts n)
    draft_tokens: int = 0  # tokens drafted and verified
    accepted_tokens: int = 0  # of those, the tokens the model chose too


class NgramSpeculator:
    """Which running rows draft this step, and how many tokens each (see the module's doc)."""

    def __init__(self, num_rows: int, max_draft: int, min_window: int, max_window: int) -> None:
        self.max_draft = max_draft
        self.min_window = min_window
        self.max_window = max_window
        self.eligible = np.zeros(num_rows, bool)
        self.draft_len = np.zeros(num_rows, np.int64)  # the most this row drafts next
        self.misses = np.zeros(num_rows, np.int64)  # its drafts rejected whole, in a row
        self.wait = np.zeros(num_rows, np.int64)  # steps before it drafts again
        self.stats = SpeculationStats()

    def admit(self, row: int, params: SamplingParams, constrained: bool) -> None:
        self.eligible[row] = (
            params.greedy
            and not constrained
            and not params.min_new_tokens
            and not params.penalized
            and params.thinking_budget < 0  # its forced tokens are the sampler's, step by step
            # a step's tokens of a request share one text record: a vocabulary's alternatives for
            # each of a draft's tokens would outgrow it
            and params.top_logprobs <= MAX_TOP_LOGPROBS
        )
        self.draft_len[row], self.misses[row], self.wait[row] = self.max_draft, 0, 0

    def release(self, row: int) -> None:
        self.eligible[row] = False

    def propose(self, table: ReqTable, rows: np.ndarray) -> dict[int, np.ndarray]:
        """Drafts for some of this step's decode `rows` (int64): row -> its drafted tokens, no
        more than the request may still generate after the token the step samples anyway."""
        if len(rows) > MAX_BATCH:
            return {}
        drafts = {}
        for row in rows[self.eligible[rows]].tolist():
            if self.wait[row]:
                self.wait[row] -= 1
                continue
            length = int(table.length[row])
            k = min(int(self.draft_len[row]), int(table.max_len[row]) - length - 1)
            draft = table.draft(row, k, self.min_window, self.max_window)
            if len(draft):
                drafts[row] = draft
        return drafts

    def verified(self, row: int, drafted: int, accepted: int) -> None:
        """Adapts `row`'s next draft to this one: `accepted` of its `drafted` tokens were right."""
        s = self.stats
        s.verifies, s.draft_tokens, s.accepted_tokens = (
            s.verifies + 1,
            s.draft_tokens + drafted,
            s.accepted_tokens + accepted,
        )
        if accepted == drafted:
            self.draft_len[row] = min(2 * drafted, self.max_draft)
            self.misses[row] = 0
        elif accepted:
            self.draft_len[row] = accepted + 1
            self.misses[row] = 0
        else:
            self.draft_len[row] = 1
            self.misses[row] += 1
            self.wait[row] = min(2 ** int(self.misses[row]), MAX_BACKOFF)


def accept_drafts(
    table: ReqTable, speculator: NgramSpeculator, rows: np.ndarray, drafts: np.ndarray, out
) -> tuple[np.ndarray, list[int], np.ndarray]:
    """Appends to each sampled row (int64 [S]; drafts int64 [S]: its drafted tokens) the
    tokens the model chose up to and including its first choice that differs from the draft
    (all of them when none does): (their TOKEN_OUT records, a row's in order, the rows that
    finished, the index of each record's token in out.tokens). A row's tokens stop at the one
    that finishes it. The KV of the accepted drafts stays; the rejected ones' is past kv_len,
    overwritten by the next tokens."""
    counts = 1 + drafts
    first = np.cumsum(counts) - counts  # each row's first token in out.tokens
    accepted = np.zeros(len(rows), np.int64)
    for i in np.flatnonzero(drafts).tolist():
        row, d, at = int(rows[i]), int(drafts[i]), int(first[i])
        length = int(table.length[row])
        wrong = np.flatnonzero(table.ids[row, length : length + d] != out.tokens[at : at + d])
        accepted[i] = wrong[0] if len(wrong) else d
        speculator.verified(row, d, int(accepted[i]))
    parts, picks, finished = [], [], []
    live = np.ones(len(rows), bool)
    for j in range(int(accepted.max()) + 1):  # the j-th token of every row that has one
        idx = np.flatnonzero(live & (accepted >= j))
        if not len(idx):
            break
        at = first[idx] + j
        events, ended = table.append(rows[idx], out.tokens[at], out.logprobs[at])
        parts.append(events)
        picks.append(at)
        if ended:
            finished += ended
            live[idx[np.isin(rows[idx], ended)]] = False
    drafted = rows[drafts > 0]
    table.kv_len[drafted] = table.length[drafted] - 1
    return concat_records(parts), finished, np.concatenate(picks)


class NoSpeculation:
    """Speculation off: nothing is ever drafted."""

    def __init__(self) -> None:
        self.stats = SpeculationStats()

    def admit(self, row: int, params: SamplingParams, constrained: bool) -> None:
        pass

    def release(self, row: int) -> None:
        pass

    def propose(self, table: ReqTable, rows: np.ndarray) -> dict[int, np.ndarray]:
        return {}

    def verified(self, row: int, drafted: int, accepted: int) -> None:
        raise AssertionError("nothing was drafted")


def make_speculator(
    algorithm: str, num_rows: int, num_draft_tokens: int, min_window: int, max_window: int
) -> NgramSpeculator | NoSpeculation:
    if algorithm == "none":
        return NoSpeculation()
    if algorithm != "NGRAM":
        raise ValueError(f"--speculative-algorithm must be NGRAM or none, not {algorithm!r}")
    return NgramSpeculator(num_rows, num_draft_tokens, min_window, max_window)
