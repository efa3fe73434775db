"""The OfflineEngine (vLLM's LLM, SGLang's Engine): generate() drives the same Scheduler
core as the server and hands each step's TOKEN_OUT records (runtime/scheduler/token_out.py)
to the same Detokenizer core, in this process, without HTTP or rings, so its texts, stop
strings, finish reasons, logprobs and usage are the server's, made the one same way.

    engine = OfflineEngine(max_running_requests=64)
    outs = engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_new_tokens=8))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].cached_tokens
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpu.models.model_files import resolve_model_dir
from ipc.ring import Batch
from protocol.payloads import unpack_logprobs, unpack_prompt_logprobs
from protocol.record_bytes import record_fields
from protocol.records import Finish, TextKind
from protocol.sampling_params import InvalidParam, SamplingParams
from runtime.config import ServerArgs
from runtime.detokenizer.core import Detokenizer
from runtime.scheduler.config import SchedulerConfig
from runtime.scheduler.core import Scheduler
from runtime.scheduler.runner import make_runner
from runtime.scheduler.token_out import step_records

ENGINE_WORKER = 0  # the worker id the Engine's requests carry


@dataclass
class GenerateOutput:
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort | error
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[float] | None = None  # the chosen tokens', when asked
    top_logprobs: list[dict[int, float]] | None = None
    error: str = ""  # why it failed, when finish_reason is "error" (e.g. its grammar did not compile)
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)
    # when asked (prompt_logprobs >= 0): each prompt position's from prompt_logprobs_start, None at
    # position 0; and its top prompt_logprobs alternatives, {id: logprob} likeliest first
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None


class OfflineEngine:
    def __init__(self, server_args: ServerArgs | None = None, **kwargs) -> None:
        """`kwargs` are ServerArgs fields (max_running_requests=..., disable_radix_cache=...);
        given with server_args they override it. Scheduler knobs that are not server flags
        (e.g. init_new_token_ratio) can go in `scheduler_overrides`."""
        overrides = kwargs.pop("scheduler_overrides", {})
        args = dataclasses.replace(server_args, **kwargs) if server_args else ServerArgs(**kwargs)
        self.server_args = args
        self.runner = make_runner(args)
        model_dir = resolve_model_dir(args.model_path)
        from transformers import AutoTokenizer  # slow import: only where a tokenizer is needed

        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or str(model_dir))
        config = SchedulerConfig.from_server_args(args, self.runner.model_config.context_length, **overrides)
        self.scheduler = Scheduler(self.runner, config)
        self._generations = itertools.count(1)
        self._detok = Detokenizer(self.tokenizer, 256)  # here: its byte table is slow to build

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerateOutput]:
        """Runs every prompt to completion, batched; outputs are in the prompts' order."""
        prompt_ids = self._tokenize(prompts)
        params = _per_prompt(sampling_params, len(prompt_ids))
        vocab = self.runner.model_config.vocab_size
        for p in params:
            p.validate(vocab)
        sched, generation = self.scheduler, next(self._generations)
        detokenizer = self._detokenizer(len(prompt_ids))
        runs = [_Run(ids, p) for ids, p in zip(prompt_ids, params)]
        for slot, (run, p) in enumerate(zip(runs, _with_ids(params))):
            sched.add_request(ENGINE_WORKER, slot, generation, run.prompt, p)
        pending = len(runs)
        while pending or sched.has_work:  # has_work: the end events of stop-string aborts
            if sched.only_compiling:  # nothing to run until a grammar is compiled
                sched.wait_for_grammar()
            res = sched.step()
            if res.empty:
                continue
            records, blob = step_records(res, sched)
            text, payload = detokenizer.handle(Batch(records, np.frombuffer(blob, np.uint8)))
            for rec in text:
                r = record_fields(rec)
                if r["gen"] != generation:  # a request of an earlier call that was cut short
                    continue
                run = runs[r["slot"]]
                if not run.take(r, payload):
                    continue
                pending -= 1
                if run.stop_index >= 0:  # a stop string: the scheduler does not know it
                    sched.abort(ENGINE_WORKER, r["slot"], generation)
        return [self._output(run) for run in runs]

    def chat(
        self,
        conversations: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerateOutput]:
        """generate() over chat conversations (lists of {"role", "content"}) through the
        tokenizer's chat template."""
        one = bool(conversations) and isinstance(conversations[0], dict)
        chats: Sequence[Any] = [conversations] if one else conversations
        ids = [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True, tokenize=True) for c in chats]
        return self.generate([_as_ids(i) for i in ids], sampling_params)

    def _detokenizer(self, n: int) -> Detokenizer:
        """The Engine's detokenizer, with room for n requests (slots 0..n-1)."""
        if self._detok.max_open < n:
            self._detok = Detokenizer(self.tokenizer, max(n, 2 * self._detok.max_open))
        return self._detok

    def flush_cache(self) -> int:
        return self.scheduler.flush_cache()

    def _tokenize(self, prompts) -> list[np.ndarray]:
        if isinstance(prompts, str):
            prompts = [prompts]
        elif len(prompts) and isinstance(prompts[0], (int, np.integer)):
            prompts = [prompts]
        if not len(prompts):
            raise InvalidParam("prompt", "generate() needs at least one prompt")
        out = []
        for p in prompts:
            ids = self.tokenizer.encode(p) if isinstance(p, str) else p
            out.append(np.asarray(ids, dtype=np.int32).reshape(-1))
        return out

    def _output(self, run: _Run) -> GenerateOutput:
        p = run.params
        prompt_tokens, completion_tokens, cached = run.counts
        if run.finish is None or run.finish.api_name is None:
            raise ValueError("an unfinished run has no output")
        return GenerateOutput(
            text=b"".join(run.parts).decode(),
            token_ids=run.tokens,
            finish_reason=run.finish.api_name,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached,
            logprobs=run.logprobs if p.logprobs else None,
            top_logprobs=run.top if p.top_logprobs else None,
            error=run.error,
            prompt_token_ids=run.prompt.tolist(),
            prompt_logprobs=run.prompt_lps if p.prompt_logprobs >= 0 else None,
            prompt_top_logprobs=run.prompt_top if p.prompt_logprobs >= 0 else None,
        )


class _Run:
    """One prompt's progress inside generate(): what its TEXT_OUT records said so far."""

    __slots__ = (
        "prompt",
        "params",
        "tokens",
        "logprobs",
        "top",
        "finish",
        "stop_index",
        "counts",
        "parts",
        "error",
        "prompt_lps",
        "prompt_top",
    )

    def __init__(self, prompt: np.ndarray, params: SamplingParams) -> None:
        self.prompt, self.params = prompt, params
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[dict[int, float]] = []
        self.finish: Finish | None = None
        self.stop_index = -1  # the stop string that ended it
        self.counts = (len(prompt), 0, 0)
        self.parts: list[bytes] = []  # the detokenizer's UTF-8 deltas
        self.error = ""
        self.prompt_lps: list[float | None] = []
        self.prompt_top: list[dict[int, float] | None] = []

    def take(self, r: dict, payload: np.ndarray) -> bool:
        """One TEXT_OUT record of it (record_fields); True when it ends the request."""
        if r["kind"] == TextKind.PROMPT_LOGPROBS:
            self._take_prompt_logprobs(r, payload[r["logprobs_off"] : r["logprobs_off"] + r["logprobs_len"]])
            return False
        text = payload[r["text_off"] : r["text_off"] + r["text_len"]].tobytes()
        if r["kind"] == TextKind.ERROR:
            self.parts, self.error = [], text.decode(errors="replace")
        elif text:
            self.parts.append(text)
        if r["ids_len"]:
            self.tokens += payload[r["ids_off"] : r["ids_off"] + r["ids_len"]].view(np.uint32).tolist()
        if r["logprobs_len"]:
            k = r["n_top"]
            part = payload[r["logprobs_off"] : r["logprobs_off"] + r["logprobs_len"]]
            _, lps, top_ids, top_lps = unpack_logprobs(part, r["logprobs_len"] // (8 * (1 + k)), k)
            self.logprobs += lps.tolist()
            if k:
                self.top += [dict(zip(i, lp)) for i, lp in zip(top_ids.tolist(), top_lps.tolist())]
        self.counts = (r["prompt_tokens"], r["completion_tokens"], r["cached_tokens"])
        if r["finish"] == Finish.NONE or self.finish is not None:
            return False
        self.finish, self.stop_index = Finish(r["finish"]), r["stop_index"]
        return True

    def _take_prompt_logprobs(self, r: dict, part: np.ndarray) -> None:
        """A PROMPT_LOGPROBS record's positions, from the first (its stop_token field) on."""
        _, lps, _, top_ids, top_lps = unpack_prompt_logprobs(part, r["n_tokens"], r["n_top"])
        for j, (lp, ids, alts) in enumerate(zip(lps.tolist(), top_ids.tolist(), top_lps.tolist())):
            first = r["stop_token"] + j == 0  # no token predicts the prompt's first
            self.prompt_lps.append(None if first else lp)
            self.prompt_top.append(None if first else dict(zip(ids, alts)))


def _with_ids(params: list[SamplingParams]) -> list[SamplingParams]:
    """`params` asking for their token ids too (they come with the text, as /generate's
    output_ids do); prompts that share settings still share one object."""
    asked: dict[int, SamplingParams] = {}
    for p in params:
        if id(p) not in asked:
            asked[id(p)] = p if p.return_ids else dataclasses.replace(p, return_ids=True)
    return [asked[id(p)] for p in params]


def _per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise InvalidParam("sampling_params", f"got {len(params)} sampling params for {n} prompts")
    return params


def _as_ids(ids) -> list[int]:
    """apply_chat_template returns a list, or a BatchEncoding in newer transformers."""
    return list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
