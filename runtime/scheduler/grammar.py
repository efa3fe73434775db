"""Grammars for constrained decoding (structured output, tool calls): compiled off the token
path, one matcher per constrained request.

A constrained request's grammar (SamplingParams.grammar_kind / .grammar) is compiled in one
thread at a lowered CPU priority (xgrammar releases the GIL while it compiles), so a large
schema never stalls the scheduler's steps nor takes the CPU the steps need: the request waits
in the scheduler's list of requests waiting for a grammar until its future is done, then gets a
matcher and joins the queue. A compile not done within --grammar-compile-timeout of its
submission fails its requests (a compile cannot be stopped in its thread: it runs on, at the low
priority, and its result is dropped); a cache hit never waits behind a compile. Compiled
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
import os
import re
import threading
import time
from concurrent.futures import CancelledError, Future, InvalidStateError, ThreadPoolExecutor
from pathlib import Path

import torch

from protocol.memo import ByteLRU
from protocol.records import GRAMMAR_ERROR_PREFIX
from protocol.sampling_params import GrammarKind

logger = logging.getLogger(__name__)

COMPILE_THREADS = 1  # a compile keeps one core busy; the step loop needs the other (2-core hosts)
# the compile thread's nice: it gets a tenth of a core the step loop competes for, all of an idle one
COMPILE_NICE = 10
# CPU seconds one constrained token may cost the scheduler's thread (mask fill and accept): a
# grammar whose matching grows with the answer (nested repetitions: `(a{0,700}){0,700}b` costs
# 0.6 s at its 10th token, 20 s at its 20th) would stall every request's steps; common schemas
# cost tens of microseconds
MAX_TOKEN_CPU_S = 0.05
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
        compile_timeout: float = 30.0,
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        self.model_dir = str(model_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.any_whitespace = any_whitespace
        self.max_rows = max_rows
        self.compile_timeout = compile_timeout  # --grammar-compile-timeout
        self.executor = ThreadPoolExecutor(
            COMPILE_THREADS, thread_name_prefix="grammar", initializer=_lower_thread_priority
        )
        self._compiler = None  # xgr.GrammarCompiler, made by the first compile (pool thread)
        self._compiler_ready: float | None = None  # when it was made (monotonic): deadlines start no sooner
        self._cache = ByteLRU(cache_bytes)  # (kind, text) -> CompiledGrammar | GrammarError
        # (kind, text) -> (the future its requests wait on, when it was submitted on the monotonic clock)
        self._in_flight: dict[tuple[int, str], tuple[Future, float]] = {}
        self._bitmask: torch.Tensor | None = None

    def compile(self, kind: int, text: str) -> Future:
        """A future of the CompiledGrammar for (kind, text); its exception is a GrammarError
        when the grammar cannot be compiled. Done already on a cache hit."""
        self._collect()
        key = (int(kind), text)
        flight = self._in_flight.get(key)
        if flight is not None:
            return flight[0]
        hit = self._cache.get(key)
        if hit is not None:
            return _done(hit)
        # the requests wait on a future of their own, which the deadline can fail while the pool's runs on
        fut: Future = Future()
        self.executor.submit(self._compile, key[0], text).add_done_callback(lambda done: _settle(fut, done))
        self._in_flight[key] = (fut, time.monotonic())
        return fut

    def _collect(self) -> None:
        """Fails the compiles past their deadline, and moves finished ones from in flight to
        the cache (on the scheduler's thread: ByteLRU is not thread-safe); a timeout is not
        cached: the grammar may have waited behind another, or on a busy host."""
        if not self._in_flight:
            return
        now, ready = time.monotonic(), self._compiler_ready
        for key, (fut, submitted) in list(self._in_flight.items()):
            if ready is not None and now > max(submitted, ready) + self.compile_timeout:
                message = f"did not compile within {self.compile_timeout:g} s (--grammar-compile-timeout)"
                message = GRAMMAR_ERROR_PREFIX + message
                _settle(fut, _done(GrammarError(message)))
                del self._in_flight[key]
        for key, fut in [(k, f) for k, (f, _) in self._in_flight.items() if f.done()]:
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
            first = message[0] if message else type(e).__name__
            raise GrammarError(f"{GRAMMAR_ERROR_PREFIX}{first}"[:MAX_MESSAGE_CHARS]) from None
        raise GrammarError(f"{GRAMMAR_ERROR_PREFIX}unknown grammar kind {kind}")

    def _make_compiler(self):
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        # its own cache is unbounded: ours, bounded by bytes, keeps what is reused
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiler_ready = time.monotonic()  # its making (a second or more) is no grammar's fault
        return self._compiler

    def collect(self) -> None:
        """Settles the compiles done or past their deadline (the scheduler's thread)."""
        self._collect()

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

    def collect(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_grammar_backend(
    name: str,
    model_config,
    max_rows: int,
    any_whitespace: bool = False,
    tokenizer_path: str | None = None,
    compile_timeout: float = 30.0,
) -> XGrammarBackend | DisabledGrammars:
    """The backend --grammar-backend names, for the model of `model_config` (gpu/models/model_config.py)
    and its tokenizer (`tokenizer_path`, --tokenizer-path: else the model's directory's);
    `compile_timeout`: --grammar-compile-timeout."""
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
        compile_timeout,
    )


def _lower_thread_priority() -> None:
    """Runs first in the compile thread: its nice raised (Linux's nice is per thread; xgrammar's
    own threads, if it starts any, inherit it), so a compile takes the CPU the steps leave."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except OSError as e:  # a lowered priority is a courtesy; compiles still run without it
        logger.warning("grammar compile thread keeps its priority: %s", e)


def _settle(fut: Future, done: Future) -> None:
    """`fut` takes `done`'s outcome unless it is settled already (a compile finishing after its
    deadline failed it, or the deadline passing as it finishes: either may come first)."""
    try:
        err = done.exception()
        if err is None:
            fut.set_result(done.result())
        else:
            fut.set_exception(err)
    except (InvalidStateError, CancelledError):  # settled already, or the pool shut down
        pass


def _done(value) -> Future:
    """A finished future of `value` (its exception when it is one)."""
    fut: Future = Future()
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)
    return fut
