"""Grammars for constrained decoding (structured output, tool calls): compiled off the token
path, one matcher per constrained request.

A constrained request's grammar (SamplingParams.grammar_kind / .grammar) is compiled in a
small thread pool (xgrammar releases the GIL while it compiles), so a large schema never
stalls the scheduler's steps: the request waits in the scheduler's list of requests waiting
for a grammar until its future is done, then gets a matcher and joins the queue. Compiled
grammars, and compile errors (a bad schema sent again costs nothing), are kept in a cache
bounded by bytes, keyed by (kind, text); concurrent requests for one grammar (a request's n
choices) share one compile.

Each step the scheduler fills one bitmask row per constrained request that samples (the
tokens its grammar allows next), the sampler applies them to the logits in one call, and
after sampling each matcher accepts its request's token (runtime/scheduler/core.py).

`--grammar-backend none` builds DisabledGrammars: every constrained request fails at once.
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from protocol.memo import ByteLRU
from protocol.sampling_params import GrammarKind

logger = logging.getLogger(__name__)

COMPILE_THREADS = 1  # a compile keeps one core busy; the step loop needs the other (2-core hosts)
CACHE_BYTES = 256 << 20  # compiled grammars kept (their masks' memory, as xgrammar counts it)
MAX_MESSAGE_CHARS = 400  # of a compile error, in the request's ERROR record
DISABLED_MESSAGE = "structured output is disabled (--grammar-backend none)"
# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:line: "; the user needs the rest
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


class GrammarError(Exception):
    """A grammar that cannot be used; the message is for the user."""


class XGrammarBackend:
    """Compiles grammars with xgrammar for one model's tokenizer and vocabulary (its logits'
    width) and makes matchers for them. Everything but the compiles runs on the scheduler's
    thread. The tokenizer and xgrammar's TokenizerInfo (a second or so) are built by the first
    compile, in the pool, so servers that never see a constrained request never pay for them."""

    def __init__(
        self,
        model_dir: str | Path,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        max_rows: int,
        any_whitespace: bool = False,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.model_dir = str(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.any_whitespace = any_whitespace
        self.max_rows = max_rows
        self.executor = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._compiler = None  # xgr.GrammarCompiler, made by the first compile (pool thread)
        self._cache = ByteLRU(cache_bytes)  # (kind, text) -> CompiledGrammar | GrammarError
        self._in_flight: dict[tuple[int, str], Future] = {}
        self._bitmask: torch.Tensor | None = None

    def compile(self, kind: int, text: str) -> Future:
        """A future of the CompiledGrammar for (kind, text); its exception is a GrammarError
        when the grammar cannot be compiled. Done already on a cache hit."""
        self._collect()
        key = (int(kind), text)
        fut = self._in_flight.get(key)
        if fut is not None:
            return fut
        hit = self._cache.get(key)
        if hit is not None:
            return _done(hit)
        fut = self.executor.submit(self._compile, key[0], text)
        self._in_flight[key] = fut
        return fut

    def _collect(self) -> None:
        """Moves finished compiles from in flight to the cache (on the scheduler's thread:
        ByteLRU is not thread-safe)."""
        if not self._in_flight:
            return
        for key, fut in [(k, f) for k, f in self._in_flight.items() if f.done()]:
            del self._in_flight[key]
            err = fut.exception()
            if err is None:
                value = fut.result()
                self._cache.put(key, value, value.memory_size_bytes + len(key[1]))
            else:
                self._cache.put(key, err, len(key[1]))

    def _compile(self, kind: int, text: str):
        """Runs in the pool: the compiled grammar, or GrammarError naming what failed."""
        compiler = self._compiler or self._make_compiler()
        try:
            if kind == GrammarKind.JSON_SCHEMA:
                return compiler.compile_json_schema(text, any_whitespace=self.any_whitespace)
            if kind == GrammarKind.REGEX:
                return compiler.compile_regex(text)
            if kind == GrammarKind.EBNF:
                return compiler.compile_grammar(text)
            if kind == GrammarKind.STRUCTURAL_TAG:
                return compiler.compile_structural_tag(text)
        except Exception as e:  # xgrammar raises RuntimeError, ValueError, its own JSON errors...
            message = _CPP_PREFIX.sub("", str(e).strip()).splitlines()
            raise GrammarError(f"grammar: {message[0] if message else type(e).__name__}"[:MAX_MESSAGE_CHARS]) from None
        raise GrammarError(f"grammar: unknown grammar kind {kind}")

    def _make_compiler(self):
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        # its own cache is unbounded: ours, bounded by bytes, keeps what is reused
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def matcher(self, compiled):
        """A fresh matcher (an xgr.GrammarMatcher) for one request."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    @property
    def bitmask(self) -> torch.Tensor:
        """The step's allowed-token bitmask, int32 [max_rows, ceil(V / 32)] on the host: row i
        for the step's i-th sampled sequence (xgrammar's layout: bit j of word k allows token
        32k + j). Made once, reused every step; only the rows of constrained sequences are
        filled and read."""
        if self._bitmask is None:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(self.max_rows, self.vocab_size)
        return self._bitmask

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class DisabledGrammars:
    """--grammar-backend none: every constrained request fails at once."""

    def compile(self, kind: int, text: str) -> Future:
        return _done(GrammarError(DISABLED_MESSAGE))

    def close(self) -> None:
        pass


def make_grammar_backend(
    name: str, model_config, max_rows: int, any_whitespace: bool = False, tokenizer_path: str | None = None
) -> XGrammarBackend | DisabledGrammars:
    """The backend --grammar-backend names, for the model of `model_config` (gpu/models/model_config.py)
    and its tokenizer (`tokenizer_path`, --tokenizer-path: else the model's directory's)."""
    if name == "none":
        return DisabledGrammars()
    if name != "xgrammar":
        raise ValueError(f"--grammar-backend must be xgrammar or none, not {name!r}")
    return XGrammarBackend(
        tokenizer_path or model_config.model_dir,
        model_config.vocab_size,
        tuple(model_config.eos_token_ids),
        max_rows,
        any_whitespace,
    )


def _done(value) -> Future:
    """A finished future of `value` (its exception when it is one)."""
    fut: Future = Future()
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)
    return fut
