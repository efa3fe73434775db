"""The OfflineEngine (vLLM's LLM, SGLang's Engine): generate() drives the same Scheduler
core and the same batch detokenizer as the server, in this process, without HTTP or
rings, so its texts are the server's (stop strings, min_tokens, stop tokens' text).

    engine = OfflineEngine(max_running_requests=64)
    outs = engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_new_tokens=8))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].cached_tokens
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gpu.models.model_files import resolve_model_dir
from protocol.payloads import unpack_prompt_logprobs
from protocol.records import NO_TOKEN, Finish
from protocol.sampling_params import InvalidParam, SamplingParams
from runtime.config import ServerArgs
from runtime.detokenizer.deltas import text_tokens
from runtime.detokenizer.incremental import BatchDetokenizer, DetokOptions
from runtime.scheduler.config import SchedulerConfig
from runtime.scheduler.core import Scheduler
from runtime.scheduler.runner import make_runner

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
        self._detok = BatchDetokenizer(self.tokenizer, 256)  # here: its byte table is slow to build

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
        detok = self._detokenizer(len(prompt_ids))
        runs = [_Run(ids, p) for ids, p in zip(prompt_ids, params)]
        for slot, run in enumerate(runs):
            p = run.params
            detok.open(
                slot,
                DetokOptions(
                    skip_special_tokens=p.skip_special_tokens,
                    stop=p.stop,
                    min_tokens=p.min_new_tokens,
                    no_stop_trim=p.no_stop_trim,
                ),
            )
            sched.add_request(ENGINE_WORKER, slot, generation, run.prompt, run.params)
        pending = len(runs)
        while pending or sched.has_work:  # has_work: the end events of stop-string aborts
            if sched.only_compiling:  # nothing to run until a grammar is compiled
                sched.wait_for_grammar()
            res = sched.step()
            for req in res.failed:
                if req.generation == generation:
                    runs[req.slot].error = req.error
            if res.prompt_records is not None:
                _take_prompt_logprobs(res, runs, generation)
            ev = res.events
            mine = [
                i
                for i, (slot, gen) in enumerate(zip(ev["slot"].tolist(), ev["gen"].tolist()))
                if gen == generation and runs[slot].finish is None
            ]  # else: a stop string's abort
            for i in mine:
                run = runs[int(ev["slot"][i])]
                token = int(ev["token"][i])
                if token != NO_TOKEN:
                    run.tokens.append(token)
                    if run.params.logprobs:
                        run.logprobs.append(float(ev["logprob"][i]))
                        if run.params.top_logprobs and res.top_ids is not None:
                            k = run.params.top_logprobs
                            run.top.append(dict(zip(res.top_ids[i, :k].tolist(), res.top_logprobs[i, :k].tolist())))
                run.counts = (int(ev["prompt_tokens"][i]), int(ev["completion_tokens"][i]), int(ev["cached_tokens"][i]))
            rows = ev[mine]
            finish = rows["finish"]
            trim = np.array([not runs[slot].params.no_stop_trim for slot in rows["slot"].tolist()], bool)
            out = detok.step(
                rows["slot"].astype(np.int64), text_tokens(rows["token"], finish, trim), finish != Finish.NONE
            )
            stopped = set(out.req[out.stop >= 0].tolist())  # a stop string: the scheduler does not know it
            for k, slot in enumerate(out.req.tolist()):
                runs[slot].parts.append(out.delta(k))
            for slot, f in zip(rows["slot"].tolist(), finish.tolist()):
                run = runs[slot]
                if run.finish is None and (f != Finish.NONE or slot in stopped):
                    run.finish = Finish.STOP if slot in stopped else Finish(f)
                    pending -= 1
                    if slot in stopped:
                        sched.abort(ENGINE_WORKER, slot, generation)
        return [self._output(run) for run in runs]

    def chat(
        self,
        conversations: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerateOutput]:
        """generate() over chat conversations (lists of {"role", "content"}) through the
        tokenizer's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        ids = [
            self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True, tokenize=True)
            for c in conversations
        ]
        return self.generate([_as_ids(i) for i in ids], sampling_params)

    def _detokenizer(self, n: int) -> BatchDetokenizer:
        """The Engine's detokenizer, with room for n requests (slots 0..n-1)."""
        if self._detok.capacity < n:
            self._detok = BatchDetokenizer(self.tokenizer, max(n, 2 * self._detok.capacity))
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
    """One prompt's progress inside generate()."""

    __slots__ = (
        "prompt",
        "params",
        "tokens",
        "logprobs",
        "top",
        "finish",
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
        self.counts = (len(prompt), 0, 0)
        self.parts: list[bytes] = []  # the detokenizer's UTF-8 deltas
        self.error = ""
        self.prompt_lps: list[float | None] = []
        self.prompt_top: list[dict[int, float] | None] = []


def _take_prompt_logprobs(res, runs: list[_Run], generation: int) -> None:
    """Appends a step's PROMPT_LOGPROBS records (StepResult.prompt_records) to their runs."""
    for rec, part in zip(res.prompt_records, res.prompt_payloads):
        if int(rec["gen"]) != generation:
            continue
        run, n, k = runs[int(rec["slot"])], int(rec["completion_tokens"]), int(rec["n_top"])
        _, lps, _, top_ids, top_lps = unpack_prompt_logprobs(np.frombuffer(part, np.uint8), n, k)
        for j, (lp, ids, alts) in enumerate(zip(lps.tolist(), top_ids.tolist(), top_lps.tolist())):
            first = int(rec["token"]) + j == 0  # no token predicts the prompt's first
            run.prompt_lps.append(None if first else lp)
            run.prompt_top.append(None if first else dict(zip(ids, alts)))


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
