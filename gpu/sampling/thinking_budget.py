"""vLLM's thinking_token_budget for one sampler row: it counts the row's reasoning tokens and,
once they reach the budget, names the tokens of the reasoning's end marker that the row must
take next, one a step, so that the answer leaves its reasoning (the reasoning parser then reads
what came before the marker as the reasoning, what follows as the content).

The reasoning starts with the first output token, or once the model wrote the start marker
when one is given (a template that lets the model choose whether to think). A model that ends
its reasoning itself within the budget is left alone. The state is a function of the output so
far: a retracted request resumed with its output rebuilds it exactly."""

from __future__ import annotations

from collections.abc import Iterable


class ThinkingBudget:
    def __init__(
        self, budget: int, start_ids: tuple[int, ...], end_ids: tuple[int, ...], output_ids: Iterable[int] = ()
    ) -> None:
        self.budget, self.start_ids, self.end_ids = budget, start_ids, end_ids
        self.reasoning = not start_ids  # inside the reasoning
        self.ended = False
        self.count = 0  # reasoning tokens the model chose
        self.forced = 0  # end-marker tokens taken since the budget ran out
        self.recent: list[int] = []  # the last tokens, as long as the longer marker
        self.window = max(len(start_ids), len(end_ids))
        for token in output_ids:
            self.advance(int(token))

    def forced_token(self) -> int | None:
        """The token this row must take now, or None while it chooses."""
        if self.reasoning and not self.ended and self.count >= self.budget:
            return self.end_ids[self.forced]
        return None

    def advance(self, token: int) -> None:
        """The row took `token`."""
        if self.ended:
            return
        self.recent = [*self.recent[1 - self.window :], token] if self.window > 1 else [token]
        if not self.reasoning:
            self.reasoning = tuple(self.recent[-len(self.start_ids) :]) == self.start_ids
            return
        if self.count >= self.budget:
            self.forced += 1
            self.ended = self.forced == len(self.end_ids)
            return
        self.count += 1
        self.ended = tuple(self.recent[-len(self.end_ids) :]) == self.end_ids
