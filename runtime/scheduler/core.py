"""The scheduler core, transport-free: continuous batching with chunked prefill over a
paged KV pool with a radix prefix cache, and retraction when decode runs out of pages.

Each step() serves every running decode plus as many prefill tokens as the budget allows
(one request at a time may be mid-prefill, split into chunks), calls the model runner once,
and returns one token event per request that sampled a token, as one numpy structured array.
Requests are addressed by (worker, slot, generation); the server's scheduler process and the
OfflineEngine both drive this class.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gpu.forward_batch import StepInput, TokenMask
from gpu.kvcache.radix_cache import RadixCache
from gpu.kvcache.req_table import MAX_STOP_IDS, ReqTable
from protocol.record_bytes import concat_records
from protocol.records import GRAMMAR_ERROR_PREFIX, NO_TOKEN, ErrorCode, Finish, TokenKind
from protocol.sampling_params import InvalidParam, SamplingParams
from runtime.scheduler.config import SchedulerConfig
from runtime.scheduler.grammar import MAX_TOKEN_CPU_S, GrammarError, XGrammarBackend, make_grammar_backend
from runtime.scheduler.lora import SchedulerLoras
from runtime.scheduler.policy import order_queue
from runtime.scheduler.pooling import NO_CACHE_POOLINGS, Pooler
from runtime.scheduler.prompt_logprobs import PromptLogprobs
from runtime.scheduler.req import Req, ReqStatus
from runtime.scheduler.speculative import NgramSpeculator, accept_drafts, make_speculator
from runtime.scheduler.step_result import TOKEN_EVENT, StepResult

logger = logging.getLogger(__name__)

_NO_IDS = np.zeros(0, np.int32)
CLIP_MAX_NEW_TOKENS = 4096  # admission reserves room for at most this many future tokens a request


@dataclass
class SchedulerStats:
    steps: int = 0
    forward_tokens: int = 0  # tokens run through the model (prefill chunks + decodes)
    prefill_tokens: int = 0  # prompt (and resumed) tokens computed, cache hits excluded
    cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    generated_tokens: int = 0
    retractions: int = 0


class Scheduler:
    def __init__(self, runner, config: SchedulerConfig, heartbeat: Callable[[], None] | None = None) -> None:
        self.runner = runner
        self.pool = runner.pool
        self.config = config
        self.page_size: int = self.pool.page_size
        self.vocab_size: int = runner.model_config.vocab_size
        pool = getattr(runner, "loras", None)  # the null model: no adapters
        self.loras = SchedulerLoras(pool, config.lora_paths, config.max_loaded_loras) if pool is not None else None
        self.cache = RadixCache(self.pool, disabled=config.disable_radix_cache)
        self.table: ReqTable[Req] = ReqTable(config.max_running_requests, config.context_length, self.page_size)
        self.eos_ids = np.unique(np.asarray(runner.model_config.eos_token_ids, dtype=np.int32))[:MAX_STOP_IDS]
        self.heartbeat = heartbeat  # called before each forward: a long one starts with a fresh beat
        self.queue: list[Req] = []  # waiting to be (re)admitted, in arrival order
        self.compiling: list[Req] = []  # new constrained requests waiting for their grammar
        self.grammar = make_grammar_backend(
            config.grammar_backend,
            runner.model_config,
            config.max_running_requests,
            config.constrained_json_any_whitespace,
            config.tokenizer_path,
            config.grammar_compile_timeout,
        )
        self.speculator = make_speculator(
            config.speculative_algorithm,
            config.max_running_requests,
            config.speculative_num_draft_tokens,
            config.speculative_ngram_min_match_window_size,
            config.speculative_ngram_max_match_window_size,
        )
        self.num_constrained = 0  # running requests with a grammar
        self.constrained = np.zeros(config.max_running_requests, bool)  # by table row
        self._mask_cpu_s = np.zeros(config.max_running_requests)  # the step's mask fill, by table row
        self._grammar_overruns: list[Req] = []  # whose last token's grammar work passed MAX_TOKEN_CPU_S
        self.requests: dict[tuple[int, int], Req] = {}  # every live request by (worker, slot)
        self.chunked: Req | None = None  # the request mid-prefill, if any
        self.new_token_ratio = config.init_new_token_ratio
        self.stats = SchedulerStats()
        self._arrivals = itertools.count()
        self._ended: list[np.ndarray] = []  # TOKEN_EVENT records of requests ended between steps
        self._opened: list[Req] = []
        self._failed: list[Req] = []  # ended with an ERROR record since the last step
        self._valid_params: SamplingParams | None = None  # the last params validated (frozen)
        self.prompt_logprobs = PromptLogprobs()  # what this step's prefill chunks owe
        self.pooler = Pooler(config.max_running_requests)  # embeddings and scores: pooled, not sampled
        self.paused: str | None = None  # /pause_generation's mode: no forward runs, ends and OPENs still sent

    # ---- requests in -----------------------------------------------------------
    @property
    def has_work(self) -> bool:
        """Something to run or to report: step() would do something."""
        if self.paused:
            return bool(self._ended or self._opened)
        return self._has_steps or bool(self.compiling)

    @property
    def only_compiling(self) -> bool:
        """Nothing to do until a grammar compile finishes (or a request comes)."""
        return bool(self.compiling) and not self._has_steps

    @property
    def _has_steps(self) -> bool:
        """Something to run or to report now, grammar compiles aside."""
        return bool(self.queue or self.table.num_active or self._ended or self._opened)

    def wait_for_grammar(self, timeout: float | None = None) -> None:
        """Blocks until a waiting request's grammar is compiled (or failed), or `timeout` s pass."""
        concurrent.futures.wait(
            [r.grammar for r in self.compiling if r.grammar is not None],
            timeout,
            return_when=concurrent.futures.FIRST_COMPLETED,
        )

    def close(self) -> None:
        self.grammar.close()

    @property
    def num_running(self) -> int:
        return self.table.num_active

    def add_request(
        self, worker: int, slot: int, generation: int, prompt_ids, params: SamplingParams, tag: object = None
    ) -> Req:
        """Queues a request. One that can never run (bad prompt or parameters) ends at once
        with an ERROR event, named in the log; it never reaches the model."""
        prompt = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
        req = Req(worker, slot, generation, prompt, params, next(self._arrivals), tag)
        old = self.requests.get(req.key)
        if old is not None:  # the slot was reused, so its old request is gone for its owner
            self._end(old, Finish.ABORT)
        self._opened.append(req)
        self.requests[req.key] = req
        req.error_code, req.error = self._check(req)
        if req.error_code:
            logger.warning("request (%d, %d, %d) rejected: %s", worker, slot, generation, req.error)
            self._end(req, Finish.ERROR)
        elif params.constrained:  # queued once its grammar is compiled (next step on a cache hit)
            req.grammar = self.grammar.compile(params.grammar_kind, params.grammar)
            req.status = ReqStatus.COMPILING
            self.compiling.append(req)
        else:
            self.queue.append(req)
        return req

    def _take_grammars(self) -> None:
        """Queues the waiting requests whose grammar is compiled, each with a fresh matcher;
        ends those whose grammar failed with an ERROR that names what failed."""
        self.grammar.collect()  # compiles past --grammar-compile-timeout fail now
        for req, compiled in [(r, r.grammar) for r in self.compiling if r.grammar is not None and r.grammar.done()]:
            err = compiled.exception()
            if err is not None:
                if isinstance(err, GrammarError):
                    req.error_code, req.error = ErrorCode.INVALID_REQUEST, str(err)
                else:  # the backend itself failed (its tokenizer, say): not the request's fault
                    logger.error("grammar backend failed", exc_info=err)
                    req.error_code, req.error = ErrorCode.INTERNAL, "grammar: the grammar backend failed"
                logger.warning("request (%d, %d, %d) failed: %s", req.worker, req.slot, req.generation, req.error)
                self._end(req, Finish.ERROR)
                continue
            self.compiling.remove(req)
            assert isinstance(self.grammar, XGrammarBackend)  # a disabled backend's compiles all fail
            req.matcher = self.grammar.matcher(compiled.result())
            req.grammar, req.status = None, ReqStatus.QUEUED
            bisect.insort(self.queue, req, key=lambda q: q.arrival)

    def _check(self, req: Req) -> tuple[ErrorCode, str]:
        n, ctx, kv = len(req.prompt), self.config.context_length, self.pool.num_pages * self.page_size
        if n == 0:
            return ErrorCode.INVALID_REQUEST, "the prompt is empty"
        if n > ctx or (n == ctx and not req.params.pooling):  # a pooled request generates nothing
            return (
                ErrorCode.PROMPT_TOO_LONG,
                f"the prompt has {n} tokens; the context holds {ctx} including at least one generated token",
            )
        if n + 1 > kv:
            return ErrorCode.PROMPT_TOO_LONG, f"the prompt has {n} tokens; the KV cache holds {kv}"
        if req.prompt.view(np.uint32).max() >= self.vocab_size:  # a negative id too, seen as uint32
            return ErrorCode.INVALID_REQUEST, f"prompt token ids must be in [0, {self.vocab_size})"
        lid = req.params.lora_id
        if lid and (self.loras is None or lid not in self.loras.served):  # unloaded since its worker looked
            return ErrorCode.INVALID_REQUEST, f"lora_id: no LoRA adapter {lid} on this server (unloaded?)"
        if req.params is not self._valid_params:  # requests that share settings share their object
            try:
                req.params.validate(self.vocab_size)
            except InvalidParam as e:
                return ErrorCode.INVALID_REQUEST, f"{e.param}: {e.message}"
            self._valid_params = req.params
        return ErrorCode.NONE, ""

    def abort(self, worker: int, slot: int, generation: int) -> bool:
        """Ends a request in whatever state it is (queued, mid-prefill, decoding, retracted)
        and frees its pages now. A stale address (finished, or another generation) is ignored."""
        req = self.requests.get((worker, slot))
        if req is None or req.generation != generation:
            return False
        self._end(req, Finish.ABORT)
        return True

    def abort_where(self, match: Callable[[Req], bool]) -> int:
        """Ends every request `match` holds for (all of a worker whose process is gone, those
        of one rid...), in whatever state; returns how many."""
        gone = [r for r in self.requests.values() if match(r)]
        for req in gone:
            self._end(req, Finish.ABORT)
        return len(gone)

    def flush_cache(self) -> int:
        """Drops every cached page no running request uses; returns how many were freed."""
        return self.cache.flush()

    # ---- one step --------------------------------------------------------------------
    def step(self) -> StepResult:
        start = time.perf_counter()
        if self.paused:
            return self._result(np.zeros(0, TOKEN_EVENT), None, None)
        if self.compiling:
            self._take_grammars()
        if self._grammar_overruns:
            self._end_grammar_overruns()
        decode_rows = self._schedule_decode()
        prefill = self._schedule_prefill()
        if not len(decode_rows) and not prefill:
            return self._result(np.zeros(0, TOKEN_EVENT), None, None)
        drafts = self._draft(decode_rows)
        if self.heartbeat is not None:
            self.heartbeat()
        step = self._step_input(decode_rows, prefill, drafts)
        forward_start = time.perf_counter()
        out = self.runner.step(step)
        forward_s = time.perf_counter() - forward_start
        result = self._process(step, prefill, drafts, out)
        if not prefill:  # what drafting decides by: a step's tokens, its whole time and its forward's
            self.speculator.timed(len(step.rows), time.perf_counter() - start, forward_s)
        return result

    def _schedule_decode(self) -> np.ndarray:
        """Every running decode, each with a page for its next token: evicts cached pages,
        then retracts the newest requests, until the pool has enough."""
        t = self.table
        while True:
            rows, need = t.decode_rows()
            if self._make_room(len(need)):
                break
            if t.num_active == 1:  # alone and still no page: the pool is its length limit
                self._end(t.held(int(need[0])), Finish.LENGTH)
                continue
            active = np.flatnonzero(t.active)
            self._retract(t.held(int(active[np.argmax(t.arrival[active])])))
        if len(need):
            t.add_pages(need, self.pool.alloc(len(need)))
        return rows

    def _schedule_prefill(self) -> list[tuple[Req, int]]:
        """(request, prefill tokens this step): the chunked request first, then queued ones
        in policy order while rows, the token budget and KV room last."""
        t, cfg = self.table, self.config
        budget = min(cfg.chunked_prefill_size, cfg.max_prefill_tokens)
        plan: list[tuple[Req, int]] = []
        req = self.chunked
        if req is not None:
            remaining = int(t.length[req.row] - t.kv_len[req.row])
            if remaining <= 1:  # its last token is a plain decode this step
                self.chunked = None
            else:
                n = self._grow(req.row, min(remaining, budget))
                if n:
                    plan.append((req, n))
                if n < remaining:
                    return plan
                self.chunked = None
                budget -= n
        if not self.queue or t.num_free_rows == 0:
            return plan
        reserve = self._reserved_tokens()
        for req in order_queue(self.queue, cfg.schedule_policy, self.cache):
            if budget <= 0 or t.num_free_rows == 0:
                break
            if req.params.lora_id and not self._lora_resident(req):
                continue  # its adapter waits for a slot of the pool: requests behind it may go
            n, expected = self._admit(req, budget, reserve)
            if not n:
                break
            plan.append((req, n))
            budget -= n
            reserve += expected
            if self.chunked is req:
                break
        return plan

    def _lora_resident(self, req: Req) -> bool:
        """Whether `req`'s adapter is resident, made so if a slot is free or idle; a request
        whose adapter's directory cannot be read again ends with an error that says why."""
        from gpu.lora import LoraLoadError

        assert self.loras is not None  # _check refused a lora_id without adapters
        try:
            return self.loras.pool.make_resident(req.params.lora_id)
        except LoraLoadError as e:
            req.error_code, req.error = ErrorCode.INVALID_REQUEST, f"lora_id: {e}"
            logger.warning("request (%d, %d, %d) failed: %s", req.worker, req.slot, req.generation, req.error)
            self._end(req, Finish.ERROR)
            return False

    def lora_users(self, lid: int) -> int:
        """Live requests (queued, compiling or running) that run with adapter `lid`."""
        return sum(1 for r in self.requests.values() if r.params.lora_id == lid)

    def _reserved_tokens(self) -> float:
        """KV tokens the running requests are still expected to need: their prompts' tokens not
        yet computed and new_token_ratio of what they may still generate."""
        return self.table.reserved_tokens(self.new_token_ratio, CLIP_MAX_NEW_TOKENS)

    def _admit(self, req: Req, budget: int, reserve: float) -> tuple[int, float]:
        """Admits `req` with up to `budget` prefill tokens: (how many, 0 for not now; the KV
        tokens it is expected to need, as _reserved_tokens counts them)."""
        t, ps = self.table, self.page_size
        fill = req.fill_ids()
        # a request owed prompt logprobs computes the logits of every position it reports: its
        # KV may come from the cache only up to the position before the next one it is owed
        owed = req.prompt_logprobs_next
        key = fill[: max(owed - 1, 0)] if owed < len(req.prompt) else fill[:-1]
        if req.params.pooling in NO_CACHE_POOLINGS:
            key = fill[:0]
        # an adapter's KV differs from the base model's for the same tokens: its own tree (salt)
        prefix_pages, node = self.cache.match_prefix(key, req.params.lora_id)
        prefix = len(prefix_pages) * ps
        remaining = len(fill) - prefix
        n = min(remaining, budget)
        max_len = len(req.prompt) + min(req.params.max_new_tokens, self.config.context_length - len(req.prompt))
        self.cache.lock(node)
        room = self.pool.num_free + self.cache.evictable_pages  # pages
        expected = remaining + self.new_token_ratio * min(max_len - len(fill), CLIP_MAX_NEW_TOKENS)
        if t.num_active and room * ps < reserve + expected:
            self.cache.unlock(node)
            return 0, 0.0
        n = min(n, (len(prefix_pages) + room) * ps - prefix)  # alone: as much as fits
        if n <= 0:
            self.cache.unlock(node)
            return 0, 0.0
        stop_ids = self._stop_ids(req.params)
        if req.cached_tokens < 0:
            req.cached_tokens = min(prefix, len(req.prompt))
            self.stats.cached_tokens += req.cached_tokens
        self.queue.remove(req)
        row = t.admit(req, fill, max_len, stop_ids)
        t.page_table[row, : len(prefix_pages)] = prefix_pages
        t.num_pages[row] = len(prefix_pages)
        t.kv_len[row] = prefix
        req.node, req.prefix_pages, req.status = node, len(prefix_pages), ReqStatus.RUNNING
        self.runner.set_request(row, req.params, req.prompt, req.output)
        self.speculator.admit(row, req.params, req.matcher is not None or bool(req.params.pooling))
        self.pooler.admit(row, req)
        if req.matcher is not None:
            self.constrained[row] = True
            self.num_constrained += 1
        n = self._grow(row, n)
        if n < remaining:
            self.chunked = req
        return n, expected

    def _stop_ids(self, params: SamplingParams) -> np.ndarray:
        """The ids that end the request: EOS (unless ignore_eos) and its stop_token_ids, each once
        (the common request, with no stop_token_ids, costs no numpy call: the precomputed ids)."""
        base = _NO_IDS if params.ignore_eos else self.eos_ids
        if not params.stop_token_ids:
            return base
        return np.unique(np.concatenate([np.asarray(params.stop_token_ids, dtype=np.int32), base]))[:MAX_STOP_IDS]

    def _grow(self, row: int, n: int, evict: bool = True) -> int:
        """Gives `row` the pages for n more tokens (fewer tokens if fewer pages can be had,
        evicting cached ones first unless `evict` is False); returns the tokens it has room for."""
        t, ps = self.table, self.page_size
        kv, have = int(t.kv_len[row]), int(t.num_pages[row])
        need = -(-(kv + n) // ps) - have
        if need > 0 and not (self._make_room(need) if evict else self.pool.num_free >= need):
            need = self.pool.num_free
            n = (have + need) * ps - kv
        if need > 0:
            t.page_table[row, have : have + need] = self.pool.alloc(need)
            t.num_pages[row] = have + need
        return max(n, 0)

    def _make_room(self, num_pages: int) -> bool:
        short = num_pages - self.pool.num_free
        if short > 0:
            self.cache.evict(short)
        return self.pool.num_free >= num_pages

    def _draft(self, decode_rows: np.ndarray) -> np.ndarray | None:
        """Drafts tokens for some decodes (speculative decoding), written in the table past their
        known tokens, each with the pages it needs if free ones are left (drafts evict nothing):
        int64 [len(decode_rows)], the drafts of each; None: none. Not while a constrained request
        runs: its mask is filled for one sampled token a sequence."""
        if self.num_constrained or (self.pooler.num_running and self.pooler.pooled[decode_rows].any()):
            return None  # a pooled prompt's last token, run as a decode, samples nothing
        t = self.table
        proposed = self.speculator.propose(t, decode_rows)
        if not proposed:
            return None
        counts = np.zeros(len(decode_rows), np.int64)
        for i, row in enumerate(decode_rows.tolist()):
            draft = proposed.get(row)
            if draft is None:
                continue
            k = self._grow(row, 1 + len(draft), evict=False) - 1  # the decode's own token and its drafts
            if k > 0:
                length = int(t.length[row])
                t.ids[row, length : length + k] = draft[:k]
                counts[i] = k
        return counts if counts.any() else None

    def _step_input(
        self, decode_rows: np.ndarray, prefill: list[tuple[Req, int]], drafts: np.ndarray | None = None
    ) -> StepInput:
        """The decodes (one token each), then the prefill chunks, as columns of the table. A decode
        with d drafts is 1 + d sequences of one token each, at its next positions over the same
        pages: a decode step still (the C decode loop takes it), exact since a step stores every
        token's K and V before any attention reads them."""
        t, B = self.table, len(decode_rows)
        rows, q_lens = decode_rows, t.ones[:B]
        if prefill:
            rows = np.concatenate([rows, np.fromiter((req.row for req, _ in prefill), np.int64, len(prefill))])
            q_lens = np.concatenate([q_lens, np.fromiter((n for _, n in prefill), np.int64, len(prefill))])
        if drafts is not None:
            q_lens = q_lens.copy()
            q_lens[:B] += drafts
        starts, token_ids, num_pages, page_table, sample = t.step_input(rows, q_lens)
        if drafts is not None:
            counts = np.concatenate([1 + drafts, np.ones(len(prefill), np.int64)])
            after = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            sample = np.concatenate([np.ones(int(counts[:B].sum()), bool), sample[B:]])
            rows, starts = np.repeat(rows, counts), np.repeat(starts, counts) + after
            num_pages, page_table = np.repeat(num_pages, counts), np.repeat(page_table, counts, axis=0)
            B = len(sample) - len(prefill)
            q_lens = np.concatenate([np.ones(B, np.int64), q_lens[len(drafts) :]])
        pool = None
        if self.pooler.num_running:
            pool, sample = self.pooler.ask(t.reqs, rows, starts, q_lens, sample)
        mask = self._token_mask(rows[sample]) if self.num_constrained else None
        ask = None
        if any(req.prompt_logprobs_next < len(req.prompt) for req, _ in prefill):
            ask = self.prompt_logprobs.ask(prefill, B, starts)
        return StepInput(
            rows=rows,
            starts=starts,
            q_lens=q_lens,
            token_ids=token_ids,
            page_table=page_table,
            num_pages=num_pages,
            sample=sample,
            token_mask=mask,
            prompt_logprobs=ask,
            pool=pool,
        )

    def _token_mask(self, sampled: np.ndarray) -> TokenMask | None:
        """The grammars' allowed tokens for the constrained rows among `sampled` (the rows
        that sample this step, in order), or None when there is none: a chunk before a
        prompt's last one samples nothing, so its matcher is untouched."""
        index = np.flatnonzero(self.constrained[sampled])
        if not len(index):
            return None
        assert isinstance(self.grammar, XGrammarBackend)  # constrained rows run with a grammar backend only
        bitmask, reqs = self.grammar.bitmask, self.table.reqs
        for i, row in zip(index.tolist(), sampled[index].tolist()):
            start = time.thread_time()
            reqs[row].matcher.fill_next_token_bitmask(bitmask, i)
            self._mask_cpu_s[row] = time.thread_time() - start
        return TokenMask(bitmask, index)

    # ---- after the forward -------------------------------------------------------------
    def _process(self, step: StepInput, prefill: list[tuple[Req, int]], drafts: np.ndarray | None, out) -> StepResult:
        t, stats = self.table, self.stats
        # each row once (a drafted decode's first sequence), decodes then prefill chunks
        t.kv_len[step.rows] += step.q_lens.astype(t.kv_len.dtype)
        forward = len(step.token_ids)
        stats.forward_tokens += forward
        stats.prefill_tokens += forward - (len(step.rows) - len(prefill))  # every decode is one token a sequence
        stats.steps += 1
        for req, _ in prefill:  # their full pages are shareable from now on
            self._cache_running(req)
        # the decodes, then the prompts whose last chunk this was
        rows = step.rows[step.sample] if prefill or step.pool is not None else step.rows
        top_ids, top_logprobs = out.top_ids, out.top_logprobs
        if drafts is None:
            events, finished = t.append(rows, out.tokens, out.logprobs)
        else:  # the sampled rows, each once, with their drafts
            counts = 1 + np.concatenate([drafts, np.zeros(len(rows) - int(drafts.sum()) - len(drafts), np.int64)])
            rows = rows[np.cumsum(counts) - counts]
            assert isinstance(self.speculator, NgramSpeculator)  # drafts come from a speculator only
            events, finished, picked = accept_drafts(t, self.speculator, rows, counts - 1, out)
            if top_ids is not None:
                top_ids, top_logprobs = top_ids[picked], top_logprobs[picked]
        if step.token_mask is not None:
            self._advance_grammars(rows, out.tokens, step.token_mask.index, events, finished)
        stats.generated_tokens += len(events)
        for row in finished:
            self._finish(t.held(row))
        self.new_token_ratio = max(
            self.config.min_new_token_ratio, self.new_token_ratio - self.config.new_token_ratio_decay
        )
        pooled, pooled_recs, pooled_payloads = (
            self.pooler.records(out.pooled) if self.pooler.num_running else ([], None, [])
        )
        for req in pooled:
            self._finish(req)
        res = self._result(events, top_ids, top_logprobs)
        if self.prompt_logprobs.runs:
            res.prompt_records, res.prompt_payloads = self.prompt_logprobs.records(out)
        if pooled_recs is not None:
            res.add_before(pooled_recs, pooled_payloads)
        return res

    def _advance_grammars(
        self, rows: np.ndarray, tokens: np.ndarray, index: np.ndarray, events: np.ndarray, finished: list[int]
    ) -> None:
        """The matchers of the constrained rows, rows[index], accept their tokens. A grammar
        that is done (it accepted a stop token: EOS with ignore_eos too) ends the request with
        STOP; one that refuses the token (no allowed token was left to sample, e.g. min_tokens
        masked the stop token the grammar needed) ends it with ABORT. `events`: the sampled
        rows' records, in order; the rows that end here are added to `finished`."""
        reqs, finish = self.table.reqs, events["finish"]
        for k, row, token in zip(index.tolist(), rows[index].tolist(), tokens[index].tolist()):
            req, start = reqs[row], time.thread_time()
            accepted = req.matcher.accept_token(token)
            if time.thread_time() - start + self._mask_cpu_s[row] > MAX_TOKEN_CPU_S:
                self._grammar_overruns.append(req)  # ended before the next step: its next token costs more
            if accepted:
                if not req.matcher.is_terminated():
                    continue
                reason = Finish.STOP
            else:
                logger.warning(
                    "request (%d, %d, %d): its grammar refused token %d; ended",
                    req.worker,
                    req.slot,
                    req.generation,
                    token,
                )
                reason = Finish.ABORT
            if finish[k] == Finish.NONE:
                finish[k] = reason
                finished.append(row)

    def _end_grammar_overruns(self) -> None:
        """Ends with an ERROR the requests whose grammar work for one token passed
        MAX_TOKEN_CPU_S of the step loop's CPU (grammar.py says why)."""
        overruns, self._grammar_overruns = self._grammar_overruns, []
        for req in overruns:
            if req.status is not ReqStatus.FINISHED:
                req.error_code = ErrorCode.INVALID_REQUEST
                limit_ms = MAX_TOKEN_CPU_S * 1e3
                req.error = f"{GRAMMAR_ERROR_PREFIX}matching the answer to it costs over {limit_ms:g} ms a token"
                logger.warning("request (%d, %d, %d) failed: %s", req.worker, req.slot, req.generation, req.error)
                self._end(req, Finish.ERROR)

    def _cache_running(self, req: Req) -> None:
        t, r = self.table, req.row
        assert req.node is not None  # locked when the request was admitted
        tree_pages, req.node = self.cache.cache_prefix(t.ids[r, : t.kv_len[r]], t.pages(r), req.prefix_pages, req.node)
        t.page_table[r, : len(tree_pages)] = tree_pages
        req.prefix_pages = len(tree_pages)

    def _result(self, events: np.ndarray, top_ids, top_logprobs) -> StepResult:
        num_sampled = len(events)
        if self._ended:
            events = concat_records([events, np.stack(self._ended)])
            self._ended = []
        opened, self._opened = self._opened, []
        failed, self._failed = self._failed, []
        return StepResult(events, num_sampled, top_ids, top_logprobs, opened, failed)

    # ---- leaving the running set ----------------------------------------------------------
    def _release(self, req: Req) -> None:
        """Gives back the request's row and KV pages (full pages stay in the radix cache)."""
        t, r = self.table, req.row
        assert req.node is not None  # locked when the request was admitted
        self.cache.release(t.ids[r, : t.kv_len[r]], t.pages(r), req.prefix_pages, req.node)
        self.runner.clear_request(r)
        self.speculator.release(r)
        self.pooler.release(r)
        if req.matcher is not None:  # it keeps its matcher: a retracted request resumes with it
            self.constrained[r] = False
            self.num_constrained -= 1
        t.release(r)
        req.node, req.prefix_pages = None, 0
        if self.chunked is req:
            self.chunked = None

    def retract_all(self) -> int:
        """Every running request back to the queue, its KV pages released (to be recomputed when
        it is admitted again: after a weight update, by the new weights); returns how many."""
        rows = np.flatnonzero(self.table.active).tolist()
        for row in rows:
            self._retract(self.table.held(row), "paused")
        return len(rows)

    def _retract(self, req: Req, why: str = "KV pool exhausted") -> None:
        t, r = self.table, req.row
        logger.info(
            "%s: retracting request (%d, %d, %d) after %d tokens",
            why,
            req.worker,
            req.slot,
            req.generation,
            t.length[r] - t.prompt_len[r],
        )
        req.output = t.ids[r, t.prompt_len[r] : t.length[r]].copy()
        self._release(req)
        req.status = ReqStatus.QUEUED
        bisect.insort(self.queue, req, key=lambda q: q.arrival)
        self.stats.retractions += 1
        self.new_token_ratio = self.config.init_new_token_ratio

    def _finish(self, req: Req) -> None:
        self._release(req)
        req.status = ReqStatus.FINISHED
        del self.requests[req.key]

    def _end(self, req: Req, reason: Finish) -> None:
        """Ends a request outside the normal token flow, with an event that carries no token."""
        t = self.table
        if req.status is ReqStatus.RUNNING:
            completion = int(t.length[req.row] - t.prompt_len[req.row])
            self._release(req)
        else:
            completion = len(req.output)
            if req.status is ReqStatus.COMPILING:
                self.compiling.remove(req)
                req.grammar = None
            elif req in self.queue:
                self.queue.remove(req)
        req.status = ReqStatus.FINISHED
        if self.requests.get(req.key) is req:
            del self.requests[req.key]
        rec = np.zeros((), TOKEN_EVENT)
        if reason == Finish.ERROR:  # the scheduler process adds the message (req.error)
            rec["kind"], rec["error"] = TokenKind.ERROR, req.error_code
            self._failed.append(req)
        else:
            rec["kind"] = TokenKind.TOKEN
        rec["worker"], rec["slot"], rec["gen"] = req.worker, req.slot, req.generation
        rec["token"], rec["logprob"], rec["finish"] = NO_TOKEN, math.nan, reason
        rec["prompt_tokens"], rec["completion_tokens"] = len(req.prompt), completion
        rec["cached_tokens"] = max(req.cached_tokens, 0)
        self._ended.append(rec)
