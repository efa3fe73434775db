"""A request's grammars checked before any engine work, off the event loop when not memoized."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from httpapi.errors import engine_unavailable
from httpapi.sampling import SamplingSpec

GRAMMAR_CHECK_THREADS = 2  # grammar checks of one worker at once
# grammar checks a worker holds at once, running or queued: a client's distinct pathological
# grammars (a second of CPU each) cannot queue without end; past it, a 503 to retry
MAX_GRAMMAR_CHECKS = 64


class GrammarChecks:
    """The grammar checks not memoized (a 200 KB schema takes 0.1 s to parse; xgrammar frees the
    GIL meanwhile), in threads of their own so that they never queue behind tokenizing, at most
    `limit` held at once: past it, a 503."""

    def __init__(
        self,
        backend: str,
        any_whitespace: bool,
        threads: int = GRAMMAR_CHECK_THREADS,
        limit: int = MAX_GRAMMAR_CHECKS,
    ) -> None:
        self.backend, self.any_whitespace = backend, any_whitespace  # --grammar-backend and its JSON flag
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-check")
        self._limit = limit
        self._held = 0

    async def check(self, specs: Sequence[SamplingSpec]) -> None:
        """Each spec's grammar checked (APIError 400 naming its field): inline when its verdict
        is memoized, else in a grammar-check thread."""
        backend, any_whitespace = self.backend, self.any_whitespace
        for spec in {id(s): s for s in specs}.values():  # a batch shares one spec
            if backend == "none" or spec.grammar_checked(any_whitespace):
                spec.check_grammar(backend, any_whitespace)
            else:
                await self.run(spec.check_grammar, backend, any_whitespace)

    async def run(self, check: Callable[..., None], *args: Any) -> None:
        if self._held >= self._limit:
            raise engine_unavailable(
                f"{self._held} grammars are being checked on this worker, its limit; retry shortly."
            )
        self._held += 1
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, check, *args)
        finally:
            self._held -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
