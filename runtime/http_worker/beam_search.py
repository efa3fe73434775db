"""vLLM's beam search (`use_beam_search`, n beams) over the engine's one-token requests, as
vLLM runs it (its EngineClient.beam_search): each step asks every live beam's next token with
its 2n likeliest alternatives (their raw logprobs), extends each beam by each of them, and
keeps the n best by score; a beam that picked an end-of-sequence token is done. After
max_tokens steps (or once no beam is live) the n best of the done and the live beams are the
answer, best first. A beam's score is vLLM's: its cumulative logprob over its length (the
prompt's tokens included, a final EOS not) to the power length_penalty.

Each step's requests share their prefix with the step before's, which the prefix cache holds:
a step costs each beam one new token's forward. Steps ask the engine for up to 20 logprobs a
token (the TOKEN record's most), hence n <= 10 (httpapi/request_fields.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from httpapi.request_fields import BeamSearch
from httpapi.responses import ChoiceResult, Usage
from protocol.sampling_params import SamplingParams
from runtime.http_worker.req_state import ReqGroup, ReqState


@dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...]  # generated, a final EOS included
    cum_logprob: float
    ended: bool = False  # by an end-of-sequence token

    def score(self, prompt_len: int, length_penalty: float) -> float:
        length = prompt_len + len(self.tokens) - self.ended
        return self.cum_logprob / (length**length_penalty)


async def beam_search(
    worker,
    prompt: list[int],
    params: SamplingParams,
    beam: BeamSearch,
    request_id: str,
    finished: Callable[[ReqGroup], Awaitable[list[ReqState]]],
) -> list[Beam]:
    """The beam.width best beams of `prompt` for params' max_new_tokens steps, best first;
    `finished` waits for a step's requests (the route's wait: it aborts them if the client leaves)."""
    width = beam.width
    step = dataclasses.replace(
        params, max_new_tokens=1, min_new_tokens=0, temperature=0.0, logprobs=True, top_logprobs=2 * width
    )
    eos = frozenset(() if params.ignore_eos else worker.model.eos_token_ids)

    def score(b: Beam) -> float:
        return b.score(len(prompt), beam.length_penalty)

    live, done = [Beam((), 0.0)], list[Beam]()
    for _ in range(params.max_new_tokens):
        prompts = [prompt + list(b.tokens) for b in live]
        group = await worker.submit("beam_search", prompts, [step] * len(live), 1, [request_id], False)
        states = await finished(group)
        extended: list[Beam] = []
        for b, state in zip(live, states):
            (lp,) = state.logprobs  # its one token's
            for token, logprob in zip(lp.top_ids[0].tolist(), lp.top_logprobs[0].tolist()):
                grown = Beam((*b.tokens, token), b.cum_logprob + logprob, token in eos)
                (done if grown.ended else extended).append(grown)
        live = sorted(extended, key=score, reverse=True)[:width]
        if not live:
            break
    return sorted(done + live, key=score, reverse=True)[:width]


async def beam_choices(
    worker, beams: list[Beam], params: SamplingParams, prompt_len: int, first: int
) -> list[ChoiceResult]:
    """The beams as choices `first`, first + 1, ...: each its text (a final EOS's left out unless
    include_stop_str_in_output asked for it), `stop` if an EOS ended it, else `length`."""
    choices = []
    for i, b in enumerate(beams):
        shown = b.tokens[:-1] if b.ended and not params.no_stop_trim else b.tokens
        text = await worker.tm.decode(shown, skip_special_tokens=params.skip_special_tokens)
        choices.append(
            ChoiceResult(
                first + i,
                text,
                "stop" if b.ended else "length",
                Usage(prompt_len, len(b.tokens)),
                matched_stop=b.tokens[-1] if b.ended else None,
                output_ids=list(b.tokens) if params.return_ids else None,
            )
        )
    return choices
