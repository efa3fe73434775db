"""Server arguments: one frozen dataclass, filled from CLI flags (`python -m runtime serve`) or
from RINGSERVE_* environment variables (`granian ... runtime.app:app`).

Each setting is declared once, on its field (runtime/settings.py derives the flags, --help, the
environment, the checks of choices and bounds, and the README's table from it). Flag names
follow SGLang's launch_server where they mean the same thing; vLLM's names of the same settings
are aliases. List settings (served names, CORS) take several values on the command line, or a
JSON list or a comma-separated one in one argument or environment variable.

`python -m runtime.config --readme README.md` rewrites that file's table of settings.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from protocol.lora import MAX_LOADED_LORAS, lora_target_set, parse_lora_entries
from protocol.sampling_params import MAX_LOGPROB_ENTRIES, MAX_TOP_LOGPROBS
from runtime import settings
from runtime.settings import flag, setting
from structured.reasoning import REASONING_PARSERS
from structured.tool_parsers import PARSERS

MAX_DRAFT_TOKENS = 64  # speculative decoding: draft tokens and match window, each at most
PARALLELISM_HINT = "; run several servers behind sglang-router"
PROG = "python -m runtime serve"
DESCRIPTION = "Start the ringserve OpenAI-compatible server."
README_HEADING = "## Settings"


ROOT_PATH = re.compile(r"(/[A-Za-z0-9._~-]+)+")


def _names(names: Iterable[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = setting(
        None, "HF directory or `.gguf` file", default_text="embedded SmolLM2-135M-Instruct (GGUF)"
    )
    served_model_name: tuple[str, ...] = setting(
        (),
        "one or more names (vLLM's list): the first is what responses report, any is accepted as `model`, "
        "`/v1/models` lists them all",
        default_text="the directory or file name",
    )
    tokenizer_path: str | None = setting(
        None,
        "a tokenizer directory other than the model's, for every process that tokenizes",
        default_text="the model's directory",
    )
    chat_template: str | None = setting(
        None,
        "a Jinja template, or a file holding one; checked to compile at start-up",
        default_text="the tokenizer's; the embedded model: `structured/templates/hermes.jinja` "
        "(its own template, plus tools)",
    )
    dtype: str = setting(
        "auto",
        "the weights' and activations' type: `float32`, `bfloat16`, `float16`",
        choices=("auto", "float32", "bfloat16", "float16"),
        default_text="`auto`: fp32 on CPU (bf16 measured no faster there: perf/results/quality.md), bf16 on CUDA",
    )
    device: str = setting("auto", "where the model runs: `cpu`, `cuda`", choices=("auto", "cpu", "cuda"))
    attention_backend: str | None = setting(
        None,
        "the attention kernels: `cpu`, `torch`, `triton`, `flashinfer`",
        choices=("cpu", "torch", "triton", "flashinfer"),
        default_text="CPU: `cpu` (AVX2 C kernels) where they build, else `torch`; "
        "CUDA: `flashinfer` if installed, else `triton`",
    )
    context_length: int | None = setting(
        None,
        "the most tokens a request's prompt and completion hold together",
        default_text="the model's",
        aliases=("max_model_len",),
    )
    quantization: str = setting(
        "auto",
        "`none`: fp32 copies of the weights (exact; a GGUF's dequantized); `gguf`: a GGUF's tensors used in "
        "place in the file, its blocks (Q4_0 .. Q8_0, K-quants, IQ4_NL / IQ4_XS) through AVX2 C kernels "
        "(their int8 products with AVX512-VNNI where the CPU has it, else AVX-VNNI: Intel's client cores "
        "since Alder Lake), fp32 activations (the same values, sums in another order); "
        "`gguf-q8`: the same with activations rounded to int8 per 32 values (llama.cpp rounds the K-quants' "
        "per 256, which Gemma 3's outliers punish; mean KL from `none` and perplexity: perf/results/quality.md, "
        "per type: quality_types.md). CPU, fp32",
        choices=("auto", "none", "gguf", "gguf-q8"),
        default_text="`auto`: `gguf-q8` for a GGUF on a CPU in fp32 where the C kernels build, else `none`",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "the paged KV cache's element type: `float32`; `float16` / `bfloat16`: half the bytes per token of fp32, "
        "so twice the tokens in the same memory (K and V rounded to nearest even); `fp8_e5m2`: a quarter (lossy). "
        "CPU backends; on CUDA only the model's dtype",
        choices=("auto", "float32", "float16", "bfloat16", "fp8_e5m2"),
        default_text="`auto`: `float16` where the weights run with int8 activations (`gguf-q8`, a GGUF's CPU "
        "default; mean KL from fp32 K and V: perf/results/kv_fp16_quality_*.md), else the model's dtype",
    )
    grammar_backend: str = setting(
        "xgrammar",
        "structured output (SGLang's flag); `none`: every structured-output field is a 400",
        choices=("xgrammar", "none"),
    )
    constrained_json_any_whitespace: bool = setting(
        False,
        "JSON answers may hold any whitespace, as xgrammar's default (small models may then loop on it)",
        default_text="off: JSON answers without whitespace between tokens",
    )
    grammar_compile_timeout: float = setting(
        30.0,
        "a request whose grammar has not compiled by then fails with a 400 (compiles run one at a time, at a "
        "lowered CPU priority)",
        unit="s",
        positive=True,
    )
    tool_call_parser: str | None = setting(
        None,
        f'{_names(PARSERS)}: how `tool_choice: "auto"` answers are read',
        choices=tuple(PARSERS),
        default_text="the format the chat template renders calls in",
    )
    reasoning_parser: str | None = setting(
        None,
        f"{_names(REASONING_PARSERS)}: the `<think>` part goes to `reasoning_content`",
        choices=tuple(REASONING_PARSERS),
    )
    return_tokens_as_token_ids: bool = setting(
        False,
        "vLLM's: logprobs show each token as `token_id:<id>` (a request's `return_tokens_as_token_ids` overrides it)",
        same_row=True,
    )
    max_logprobs: int = setting(
        MAX_TOP_LOGPROBS,
        f"vLLM's: the most logprobs a request may ask per position (`top_logprobs`, `logprobs`, "
        f"`prompt_logprobs`, `logprob_token_ids`); -1: the whole vocabulary, which a request asks with -1. "
        f"Whatever it allows, a request asks at most {MAX_LOGPROB_ENTRIES:,} in all (positions times count)",
        at_least=-1,
        same_row=True,
    )
    enable_force_include_usage: bool = setting(
        False,
        "vLLM's: every stream carries usage, on each chunk and at its end, as if `stream_options` asked"
        " `include_usage` and `continuous_usage_stats`",
        same_row=True,
    )
    enable_per_request_metrics: bool = setting(
        False,
        "vLLM's: a one-choice answer carries `metrics` (queue, time to first token, generation time, mean "
        "inter-token latency, tokens per second; a stream's on its usage chunk), timed by the HTTP worker: its "
        "queue is the parsing and tokenizing, the scheduler's wait falls in the time to first token",
        same_row=True,
    )
    null_model: bool = setting(False, "instant tokens: measures the server's own per-token cost")
    is_embedding: bool = setting(
        False,
        "SGLang's: serve embeddings (`/v1/embeddings`, `/encode`; vLLM's `--task embed`, `--runner pooling`), "
        "not generation (docs/embeddings.md)",
        same_row=True,
        value_aliases=(
            ("task", (("embed", True), ("generate", False))),
            ("runner", (("pooling", True), ("generate", False))),
        ),
    )
    pooling: str | None = setting(
        None,
        "how an embedding pools the final hidden states: `last`, `mean`, `cls`",
        choices=("last", "mean", "cls"),
        default_text="the model's (sentence-transformers' `1_Pooling`), else `last`",
        same_row=True,
    )
    random_seed: int = setting(0, "seed of unseeded sampling")
    host: str = setting(
        "127.0.0.1", "the address to listen on (`serve` only: granian's own when granian runs directly)"
    )
    port: int = setting(30000, "the port to listen on (`serve` only)", at_least=1, same_row=True)
    workers: int = setting(1, "HTTP worker processes (`serve` only)", at_least=1, same_row=True)
    root_path: str | None = setting(
        None,
        "vLLM's: the path prefix a proxy serves this server under: `<prefix>/v1/...` is served as `/v1/...` "
        "(paths without it still are)",
        default_text="none",
        same_row=True,
    )
    api_key: str | None = setting(
        None,
        "a bearer key on every route but `/health`, `/health_generate`, `/metrics`; better given as "
        "`RINGSERVE_API_KEY`, off the command line",
    )
    log_level: str = setting(
        "info", "`debug`, `warning`, `error`, `critical`", choices=("debug", "info", "warning", "error", "critical")
    )
    log_requests: bool = setting(
        False,
        "one line a finished request (rid, endpoint, tokens, finish reason, latency; never text)",
        same_row=True,
    )
    dump_requests_folder: str | None = setting(
        None,
        "SGLang's: each finished request's inputs, sampling parameters and outputs (never a header) as JSON "
        "lines in `requests-w<worker>.jsonl` there (docs/engine-control.md; `perf/replay.py` sends them again)",
        default_text="none",
        same_row=True,
    )
    dump_requests_max_bytes: int = setting(
        64 << 20,
        "a worker's dump, at most: past half of it its file is renamed `.1.jsonl` (the previous one dropped)",
        default_text="67108864 (64 MiB)",
        at_least=4096,
        same_row=True,
    )
    allowed_origins: tuple[str, ...] = setting(
        (),
        "CORS, vLLM's flags: the origins whose pages may call the server (`'[\"*\"]'`: any)",
        default_text="none (no CORS headers: a page on another origin cannot read the answers)",
    )
    allowed_methods: tuple[str, ...] = setting(("*",), "CORS: the methods those pages may use", same_row=True)
    allowed_headers: tuple[str, ...] = setting(("*",), "CORS: the request headers those pages may send", same_row=True)
    allow_credentials: bool = setting(False, "CORS: whether those pages may send credentials", same_row=True)
    request_timeout: float = setting(600.0, "a request still running then is aborted: 504", unit="s")
    max_request_bytes: int = setting(
        8 << 20,
        "a larger body is refused with 413 before it is read (Content-Length; a chunked body as it arrives)",
        default_text="8388608 (8 MiB)",
        at_least=1024,
    )
    body_read_timeout: float = setting(
        30.0,
        "a body not received whole by then is refused with 408, so that a client that trickles one does not "
        "hold the worker; `serve` also gives granian this as its HTTP/1 header read timeout (at most 60 s), "
        "which closes idle connections",
        unit="s",
        positive=True,
    )
    stream_interval: int = setting(
        1,
        "a stream's events: at its first token, then every k tokens, and at its end (a client that falls "
        "behind gets its pending tokens in one event anyway)",
        at_least=1,
    )
    page_size: int = setting(16, "tokens per KV page", at_least=1)
    max_running_requests: int = setting(256, "requests in the running batch", aliases=("max_num_seqs",), at_least=1)
    max_total_tokens: int | None = setting(None, "KV pool size in tokens", default_text="from `--mem-fraction-static`")
    mem_fraction_static: float | None = setting(
        None,
        "share of memory for weights and KV cache",
        default_text="0.85 CUDA, 0.3 CPU",
        aliases=("gpu_memory_utilization",),
    )
    chunked_prefill_size: int = setting(
        2048,
        "prompt tokens per step (longer prompts are split)",
        aliases=("max_num_batched_tokens",),
        at_least=1,
    )
    max_prefill_tokens: int = setting(16384, "prefill budget of a step", at_least=1)
    schedule_policy: str = setting(
        "fcfs", "`fcfs`: first come, first served; `lpm`: longest cached prefix first", choices=("fcfs", "lpm")
    )
    disable_radix_cache: bool = setting(False, "no prefix sharing")
    enable_lora: bool = setting(
        False,
        "serve LoRA adapters (docs/lora.md): requests name one as `model` or `base:adapter`, /generate as "
        "`lora_path`; batches mix adapters and the base",
        same_row=True,
    )
    lora_paths: tuple[str, ...] = setting(
        (),
        "the adapters as `name=path` (a bare path: named after its last part), PEFT directories or llama.cpp's "
        "`.gguf` LoRA files (a GGUF base), registered at start; more with /load_lora_adapter",
        aliases=("lora_modules",),
        default_text="none",
        same_row=True,
    )
    max_loras_per_batch: int = setting(
        8,
        "adapters resident in memory, hence in one batch; the other registered ones are read again when a "
        "request needs them, evicting the least recently used idle one",
        at_least=1,
        aliases=("max_loras",),
        same_row=True,
    )
    max_loaded_loras: int = setting(
        64,
        "adapters registered at once (--lora-paths and run-time loads); a load past it is a 400",
        at_least=1,
        same_row=True,
    )
    max_lora_rank: int | None = setting(
        None,
        "an adapter of a higher rank is refused (at start, or its load is a 400)",
        same_row=True,
        default_text="any",
    )
    lora_target_modules: tuple[str, ...] = setting(
        (),
        "the projections adapters may target (SGLang's): of q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj, qkv_proj, gate_up_proj, all; an adapter with another is refused (at start, or its load is "
        "a 400)",
        same_row=True,
        default_text="all",
    )
    lora_allowed_dirs: tuple[str, ...] = setting(
        (),
        "/load_lora_adapter's `lora_path` must lie inside one of these directories, links resolved (a path "
        "outside is a 400)",
        default_text="any readable directory",
        same_row=True,
    )
    speculative_algorithm: str = setting(
        "NGRAM",
        "`NGRAM`: n-gram (prompt lookup) speculative decoding: a greedy request's next tokens drafted from its "
        "own earlier ones, verified in one forward; the same text as `none` (off); sampled requests are never "
        "drafted for, and a step drafts where the steps' measured costs say accepted drafts pay "
        "(docs/architecture.md, perf/results/peer.md); acceptance in `/metrics`",
        choices=("NGRAM", "none"),
    )
    speculative_num_draft_tokens: int = setting(
        8,
        f"NGRAM: the most tokens a request drafts a step (adapted to acceptance, costs; at most {MAX_DRAFT_TOKENS})",
        at_least=1,
        same_row=True,
    )
    speculative_ngram_min_match_window_size: int = setting(
        1, "NGRAM: the shortest suffix of a request's tokens matched to draft from", at_least=1, same_row=True
    )
    speculative_ngram_max_match_window_size: int = setting(
        12, f"NGRAM: the longest suffix matched (at most {MAX_DRAFT_TOKENS})", same_row=True
    )
    watchdog_timeout: float = setting(
        300.0,
        "a scheduler or detokenizer whose heartbeat is older is hung: killed and replaced (SGLang's default; "
        "the scheduler beats between a forward's layers, so a long prefill is busy, not hung: this bounds one "
        "layer, seconds for a 7B fp32 model's 2048-token chunk on a few CPU cores)",
        unit="s",
        positive=True,
    )
    engine_max_restarts: int = setting(
        5,
        "replacements of a dead or hung engine allowed in 10 minutes (waits of 1, 2, 4, ... s between them); "
        "then every request is a 503 saying so. 0: never replaced",
        at_least=0,
    )
    tp_size: int = setting(
        1,
        f"1 only: tensor parallelism is not supported{PARALLELISM_HINT}",
        aliases=("tensor_parallel_size", "tp"),
        short_flags=("-tp",),
    )
    dp_size: int = setting(
        1,
        f"1 only: data parallelism is not supported{PARALLELISM_HINT}",
        aliases=("data_parallel_size", "dp"),
        short_flags=("-dp",),
        same_row=True,
    )
    trust_remote_code: bool = setting(
        False, "accepted with no effect: ringserve runs its own model code, never code from the hub", same_row=True
    )
    enable_metrics: bool = setting(False, "accepted with no effect: /metrics is always on", same_row=True)
    disable_cuda_graph: bool = setting(
        False, "accepted with no effect: ringserve captures no CUDA graphs", same_row=True
    )
    transport: str = setting(
        "ring",
        "between the processes: `ring` (shared memory); `zmq`: the ZMQ + pickle baseline, for comparison",
        choices=("ring", "zmq"),
    )
    worker_stall_timeout: float = setting(
        30.0,
        "an HTTP worker that reads none of the text waiting for it this long has its requests failed; the "
        "other workers' streams never wait for it. One whose event loop stops this long is killed and replaced",
        unit="s",
        positive=True,
    )

    def __post_init__(self) -> None:
        settings.freeze_lists(self)
        for name in ("tp_size", "dp_size"):
            if getattr(self, name) != 1:
                kind = "tensor" if name == "tp_size" else "data"
                raise ValueError(
                    f"{flag(name)} {getattr(self, name)}: {kind} parallelism is not supported{PARALLELISM_HINT}"
                )
        settings.check(self)
        if self.speculative_num_draft_tokens > MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculative-num-draft-tokens must be at most {MAX_DRAFT_TOKENS}")
        if not (
            self.speculative_ngram_min_match_window_size
            <= self.speculative_ngram_max_match_window_size
            <= MAX_DRAFT_TOKENS
        ):
            raise ValueError(
                "--speculative-ngram-max-match-window-size must be at least the min match window size "
                f"and at most {MAX_DRAFT_TOKENS}"
            )
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("--mem-fraction-static must be in (0, 1)")
        if self.root_path and not ROOT_PATH.fullmatch(self.root_path):
            raise ValueError(f"--root-path must be a path like /api/llm (no trailing slash), not {self.root_path!r}")
        self._check_lora()
        if self.chat_template is not None and not (
            os.path.isfile(self.chat_template) or "{{" in self.chat_template or "{%" in self.chat_template
        ):
            raise ValueError(
                f"--chat-template must be a Jinja template or a file holding one: {self.chat_template!r} is neither"
            )

    def _check_lora(self) -> None:
        if not self.enable_lora:
            if self.lora_paths or self.lora_allowed_dirs or self.lora_target_modules:
                raise ValueError("--lora-paths, --lora-target-modules and --lora-allowed-dirs need --enable-lora")
            return
        lora_target_set(self.lora_target_modules)
        if self.is_embedding:
            raise ValueError("--enable-lora serves generation: not with --is-embedding")
        adapters = parse_lora_entries(self.lora_paths)
        pinned = sum(1 for _, _, pin in adapters if pin)
        if pinned and pinned >= self.max_loras_per_batch:
            raise ValueError(
                f"--lora-paths pins {pinned} adapters; at most --max-loras-per-batch - 1 "
                f"({self.max_loras_per_batch - 1}): one slot stays for the others"
            )
        if len(adapters) > self.max_loaded_loras:
            raise ValueError(
                f"--lora-paths names {len(adapters)} adapters; at most --max-loaded-loras ({self.max_loaded_loras})"
            )
        if self.max_loaded_loras > MAX_LOADED_LORAS:
            raise ValueError(f"--max-loaded-loras must be at most {MAX_LOADED_LORAS}")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be at least 1")
        for d in self.lora_allowed_dirs:
            if not os.path.isdir(d):
                raise ValueError(f"--lora-allowed-dirs: {d!r} is not a directory")

    @classmethod
    def from_cli(cls, argv: Sequence[str] | None = None) -> ServerArgs:
        """Flags not given keep the field's default."""
        return cls(**settings.parse_cli(cls, argv, PROG, DESCRIPTION))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerArgs:
        return cls(**settings.read_env(cls, os.environ if environ is None else environ))

    def to_env(self) -> dict[str, str]:
        """The environment that makes from_env() rebuild these arguments."""
        return settings.to_env(self)


ALIASES = settings.aliases_of(ServerArgs)


def readme_with_settings(readme: str) -> str:
    """The README's text with its table of settings generated from ServerArgs."""
    return settings.with_table(readme, settings.markdown_table(ServerArgs), README_HEADING)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--readme"] or len(sys.argv) != 3:
        sys.exit("usage: python -m runtime.config --readme README.md")
    with open(sys.argv[2]) as f:
        text = f.read()
    with open(sys.argv[2], "w") as f:
        f.write(readme_with_settings(text))
