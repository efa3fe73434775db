"""N-gram speculative decoding (SGLang's `--speculative-algorithm NGRAM`): a running greedy
request's next tokens are drafted from its own earlier tokens (prompt lookup: the latest
earlier place where its last tokens occurred, and what followed them there), and the step
verifies them in the same forward as its normal decode, at one logits row per drafted token.
The scheduler keeps the longest prefix of the draft the model itself chose plus the model's
next token, so a greedy request's text is the same with speculation off.

Drafting costs a lookup on the host, and a drafted row runs 1 + k tokens through the model
instead of 1: worth it only where drafts are accepted and where the step's extra tokens cost
less than they yield. So each request adapts its draft length to what it has been accepting
(doubled while whole drafts are accepted, else the accepted length + 1), keeps a running
acceptance rate and stops drafting for a while after drafts it rejected whole (longer each
time). In a step of up to FREE_BATCH
decodes every ready request drafts all it finds: the step's time is the weights' reading,
drafts ride on it. In a larger one the step drafts the tokens likeliest to be accepted (a
request's j-th drafted token is accepted with its rate to the j-th power), as many as raise
the step's expected tokens a second the most by what the steps already run cost (StepCosts):
as the batch grows the forward turns compute bound and only well-accepted drafts pay.
Above FREE_BATCH nothing is drafted where the forward is under MIN_FORWARD_SHARE of a decode
step's time: there the host's work a drafted token (lookups, acceptance, the detokenizer's and
HTTP workers' events, not all of it in the step's time) outweighs what the forward saves (the
null model, whose forward costs next to nothing: drafting doubled the server's CPU a token).
Nor in steps of more than MAX_BATCH decodes, which bounds the host's lookups a step.

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

# decodes in a step up to which every ready request drafts what it finds
FREE_BATCH = 4
# decodes in a step above which none is drafted for
MAX_BATCH = 32
# the forward's share of a decode step's time (a running average, COST_WEIGHT) under which,
# above FREE_BATCH decodes, none is drafted for
MIN_FORWARD_SHARE = 0.5
# a request's acceptance rate (the chance a drafted token is accepted, its earlier ones
# being accepted) before its first verify: PRIOR_HITS of PRIOR_TRIALS. Hopeful: greedy text
# that repeats itself is n-gram drafting's case, and a rate too low to draft at is never
# corrected by a verify, only by aging back to this
PRIOR_HITS, PRIOR_TRIALS = 3.0, 4.0
# each step it may draft in, a request's counts keep this share of their distance from the
# prior's: old verifies fade, and a request that stopped drafting tries again once they have
AGE = 0.9
# weight of a step's seconds in its bucket's running average
COST_WEIGHT = 0.2
# each decode step every bucket's seconds keep this share of their excess over its floor, its
# count at the cheapest seconds a token measured: a count measured dear (a first run's
# allocations, a burst of other work) is tried again some hundred steps later rather than
# never. Aged toward the cheapest bucket's seconds instead, a step of 128 tokens came to be
# estimated at half its measured cost within tens of steps, and a compute-bound batch of 32
# drafted for it every few steps
COST_AGE = 0.98
# consecutive buckets of StepCosts' token counts are this far apart at most
BUCKET_RATIO = 1.25
# steps it may draft in that a request waits out after its m-th draft in a row rejected whole:
# min(2**m, MAX_BACKOFF)
MAX_BACKOFF = 64


@dataclass
class SpeculationStats:
    verifies: int = 0  # drafted rows verified (a row that drafts in n steps counts n)
    draft_tokens: int = 0  # tokens drafted and verified
    accepted_tokens: int = 0  # of those, the tokens the model chose too


class StepCosts:
    """Seconds a decode step takes by its number of tokens, learned from the steps run: a
    running average a bucket of token counts (BUCKET_RATIO apart), linear between buckets,
    aged toward its count at the cheapest seconds a token (COST_AGE). Past the largest count
    measured a step is estimated at that count's cost, so a larger one is tried once and is
    then known; before any is measured every count costs the same. Counts past `max_tokens`
    (what a drafting step can run) are not kept: a large batch's steps pay no bookkeeping for
    it."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        edges = [1]
        while edges[-1] < max_tokens:
            edges.append(max(edges[-1] + 1, int(edges[-1] * BUCKET_RATIO)))
        self.edges = np.array(edges, np.int64)  # bucket i: counts edges[i] .. edges[i + 1] - 1
        self.tokens = np.zeros(len(edges))  # the bucket's running average count and seconds
        self.seconds = np.zeros(len(edges))
        self.seen = np.zeros(len(edges), bool)

    def record(self, tokens: int, seconds: float) -> None:
        if tokens > self.max_tokens:
            return
        seen = self.seen
        if seen.any():
            floor = self.tokens[seen] * (self.seconds[seen] / self.tokens[seen]).min()
            self.seconds[seen] = floor + COST_AGE * (self.seconds[seen] - floor)
        i = int(np.searchsorted(self.edges, tokens, "right")) - 1
        w = COST_WEIGHT if self.seen[i] else 1.0
        self.tokens[i] += w * (tokens - self.tokens[i])
        self.seconds[i] += w * (seconds - self.seconds[i])
        self.seen[i] = True

    def estimate(self, tokens: np.ndarray) -> np.ndarray:
        """tokens: int64 [N] -> the seconds of a step of each count [N]."""
        if not self.seen.any():
            return np.ones(len(tokens))
        return np.interp(tokens, self.tokens[self.seen], self.seconds[self.seen])


class NgramSpeculator:
    """Which running rows draft this step, and how many tokens each (see the module's doc)."""

    def __init__(self, num_rows: int, max_draft: int, min_window: int, max_window: int) -> None:
        self.max_draft = max_draft
        self.min_window = min_window
        self.max_window = max_window
        self.eligible = np.zeros(num_rows, bool)
        # drafted tokens it accepted and tokens its verifies tried (accepted ones and the first
        # rejected one), aged (AGE): its acceptance rate is their ratio
        self.hits = np.zeros(num_rows)
        self.trials = np.ones(num_rows)
        self.draft_len = np.zeros(num_rows, np.int64)  # the most this row drafts next
        self.misses = np.zeros(num_rows, np.int64)  # its drafts rejected whole, in a row
        self.wait = np.zeros(num_rows, np.int64)  # steps before it drafts again
        self.costs = StepCosts(min(num_rows, MAX_BATCH) * (1 + max_draft))
        self.forward_share = 1.0  # of a decode step's time; before any, hopeful
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
        self.hits[row], self.trials[row] = PRIOR_HITS, PRIOR_TRIALS

    def release(self, row: int) -> None:
        self.eligible[row] = False

    def propose(self, table: ReqTable, rows: np.ndarray) -> dict[int, np.ndarray]:
        """Drafts for some of this step's decode `rows` (int64): row -> its drafted tokens, no
        more than the request may still generate after the token the step samples anyway."""
        if len(rows) > MAX_BATCH or (len(rows) > FREE_BATCH and self.forward_share < MIN_FORWARD_SHARE):
            return {}  # nothing is drafted in such a step: its requests' counts and waits stand still
        eligible = rows[self.eligible[rows]]
        self.hits[eligible] = PRIOR_HITS + AGE * (self.hits[eligible] - PRIOR_HITS)
        self.trials[eligible] = PRIOR_TRIALS + AGE * (self.trials[eligible] - PRIOR_TRIALS)
        waiting = self.wait[eligible] > 0
        self.wait[eligible[waiting]] -= 1
        ready = eligible[~waiting]
        room = np.minimum(self.draft_len[ready], table.max_len[ready] - table.length[ready] - 1)
        drafts = {}
        for row, k in zip(*self._worth_drafting(len(rows), ready[room > 0], room[room > 0])):
            draft = table.draft(row, k, self.min_window, self.max_window)
            if len(draft):
                drafts[row] = draft
        return drafts

    def accept_rate(self, rows: np.ndarray) -> np.ndarray:
        """The chance each of `rows` accepts a drafted token whose earlier ones it accepted."""
        return self.hits[rows] / self.trials[rows]

    def _worth_drafting(self, decodes: int, rows: np.ndarray, room: np.ndarray) -> tuple[list[int], list[int]]:
        """Of the candidate `rows`' drafted tokens (up to `room` each) in a step of `decodes`, the
        likeliest to be accepted, as many as raise the step's expected tokens a second the most
        (all of them up to FREE_BATCH decodes): (the rows that draft, how many tokens each)."""
        if not len(rows):
            return [], []
        if decodes <= FREE_BATCH:
            return rows.tolist(), room.tolist()
        owner = np.repeat(np.arange(len(rows)), room)  # a candidate token: its row's index,
        depth = np.arange(len(owner)) - np.repeat(np.cumsum(room) - room, room) + 1  # its place in the draft
        chance = self.accept_rate(rows)[owner] ** depth  # accepted only with every token before it
        order = np.lexsort((depth, -chance))  # likeliest first; a row's tokens in draft order
        expected = decodes + np.concatenate([[0.0], np.cumsum(chance[order])])  # with the first n of order
        n = int(np.argmax(expected / self.costs.estimate(decodes + np.arange(len(order) + 1))))
        lengths = np.bincount(owner[order[:n]], minlength=len(rows))
        return rows[lengths > 0].tolist(), lengths[lengths > 0].tolist()

    def timed(self, tokens: int, seconds: float, forward_seconds: float) -> None:
        """A step of decodes only ran `tokens` tokens (drafts included) in `seconds`, of which
        its forward took `forward_seconds`. The costs are kept only while they can decide a
        draft (the forward's share at least MIN_FORWARD_SHARE): a step of the null model pays
        nothing for them."""
        if seconds > 0:
            self.forward_share += COST_WEIGHT * (min(forward_seconds / seconds, 1.0) - self.forward_share)
        if self.forward_share >= MIN_FORWARD_SHARE:
            self.costs.record(tokens, seconds)

    def verified(self, row: int, drafted: int, accepted: int) -> None:
        """Adapts `row`'s next draft and its rate to this one: `accepted` of its `drafted` tokens
        were right; a draft rejected whole makes it wait before drafting again."""
        s = self.stats
        s.verifies, s.draft_tokens, s.accepted_tokens = (
            s.verifies + 1,
            s.draft_tokens + drafted,
            s.accepted_tokens + accepted,
        )
        self.hits[row] += accepted
        self.trials[row] += accepted + (accepted < drafted)
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

    def timed(self, tokens: int, seconds: float, forward_seconds: float) -> None:
        pass


def make_speculator(
    algorithm: str, num_rows: int, num_draft_tokens: int, min_window: int, max_window: int
) -> NgramSpeculator | NoSpeculation:
    if algorithm == "none":
        return NoSpeculation()
    if algorithm != "NGRAM":
        raise ValueError(f"--speculative-algorithm must be NGRAM or none, not {algorithm!r}")
    return NgramSpeculator(num_rows, num_draft_tokens, min_window, max_window)
