"""Server arguments: one frozen dataclass, filled from CLI flags (`python -m runtime
serve`) or from RINGSERVE_* environment variables (`granian ... runtime.app:app`).

Flag names follow SGLang's launch_server where they mean the same thing; the
environment variable of `--max-running-requests` is RINGSERVE_MAX_RUNNING_REQUESTS. vLLM's
names of the same settings are aliases (ALIASES: `--max-model-len` is `--context-length`, and
RINGSERVE_MAX_MODEL_LEN is RINGSERVE_CONTEXT_LENGTH), resolved in one place (_merge_aliases)
for flags and environment alike; an alias and its target given different values is an error.
List settings (served names, CORS) take several values on the command line, or a JSON list
or a comma-separated one in one argument or environment variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from structured.reasoning import REASONING_PARSERS
from structured.tool_parsers import PARSERS

ENV_PREFIX = "RINGSERVE_"
MAX_DRAFT_TOKENS = 64  # speculative decoding: draft tokens and match window, each at most


@dataclass(frozen=True)
class ServerArgs:
    # model
    model_path: str | None = None  # HF directory or .gguf file; None = embedded SmolLM2
    # the names clients may send as `model`: the first is the one responses report; /v1/models
    # lists them all (vLLM's list; empty: the model's directory or file name)
    served_model_name: tuple[str, ...] = ()
    tokenizer_path: str | None = None  # a tokenizer directory other than the model's (every process's)
    chat_template: str | None = None  # a Jinja chat template, or a file holding one (None: the tokenizer's)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on CUDA)
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str | None = None  # cpu | torch | triton | flashinfer (None: per device)
    context_length: int | None = None
    # auto: gguf-q8 for a .gguf model on the CPU in float32 where its kernels build, else none
    # (gpu/model_runner.py resolve_quantization; perf/results/quality.md measures the modes);
    # none: fp32 copies of the weights (the exact computation); gguf: a GGUF's Q4_1 / Q8_0
    # weights as they are (CPU kernels, fp32 activations); gguf-q8: the same with activations
    # quantized to int8 per 32 values as llama.cpp does (the numerics change by their rounding)
    quantization: str = "auto"
    # the paged KV cache's element type: auto (the model's dtype) | float16 | bfloat16 (half the
    # bytes of fp32 K/V per token, so twice the tokens in the same memory and half the reads in
    # decode attention; K and V are rounded to nearest even when stored)
    kv_cache_dtype: str = "auto"
    # structured output and tool calls (SGLang's flags): the grammar backend (xgrammar | none);
    # JSON answers without whitespace between tokens unless asked (small models otherwise loop
    # on whitespace); the parser of tool calls in the model's text (hermes | qwen25 | llama3 |
    # mistral; None: the one the chat template's format names, if any); the parser of the
    # <think> part (deepseek-r1 | qwen3 | ...; None: no reasoning_content)
    grammar_backend: str = "xgrammar"
    constrained_json_any_whitespace: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    null_model: bool = False  # instant tokens: measures the server's own per-token cost
    random_seed: int = 0
    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    workers: int = 1
    api_key: str | None = None
    log_level: str = "info"
    log_requests: bool = False  # one log line a finished request: rid, endpoint, tokens, finish, latency
    # CORS, vLLM's flags: no origin by default (issue 22: a page on another origin cannot read
    # answers); once origins are listed, any method and header, no credentials
    allowed_origins: tuple[str, ...] = ()  # none: no CORS headers (a page elsewhere cannot read answers)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    request_timeout: float = 600.0  # soft limit on a request's life, seconds
    # a request body larger than this is refused (413) before it is read: Content-Length first,
    # a chunked body as it arrives
    max_request_bytes: int = 8 << 20
    # a request body not received whole within this many seconds is refused (408), so that a
    # client that trickles a body does not hold the worker
    body_read_timeout: float = 30.0
    # a stream's events: at its first token, then once every stream_interval tokens (and at its
    # end): fewer, larger events for clients that keep up (one that falls behind gets its
    # pending tokens in one event anyway)
    stream_interval: int = 1
    # scheduler
    page_size: int = 16
    max_running_requests: int = 256
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from mem_fraction_static
    mem_fraction_static: float | None = None
    chunked_prefill_size: int = 2048
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"  # fcfs | lpm
    disable_radix_cache: bool = False
    # speculative decoding (SGLang's flags; runtime/scheduler/speculative.py): NGRAM drafts a
    # greedy request's next tokens from its own earlier ones and verifies them in one forward;
    # none: off. At most num_draft_tokens a request a step, from suffix matches of min to max
    # match window tokens. On by default: greedy text is the same, sampled requests are never
    # drafted for, and no request drafts in a large batch (perf/results/peer.md measures it)
    speculative_algorithm: str = "NGRAM"
    speculative_num_draft_tokens: int = 8
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # supervision (runtime/supervise/): a scheduler or detokenizer whose heartbeat is older than
    # this is hung: killed and replaced like a dead one, seconds (SGLang's flag; the scheduler
    # beats before each forward, and one chunked-prefill forward of a 7B model in fp32 on a few
    # CPU cores takes minutes)
    watchdog_timeout: float = 300.0
    # a dead or hung engine is replaced at most this many times in 10 minutes (with a growing
    # wait between tries); then every request is a 503 until the server restarts. 0: never
    engine_max_restarts: int = 5
    # parallelism: one GPU a server (1 only: several servers behind sglang-router instead)
    tp_size: int = 1
    dp_size: int = 1
    # accepted for SGLang / vLLM command lines, with no effect (NO_EFFECT says why)
    trust_remote_code: bool = False
    enable_metrics: bool = False
    disable_cuda_graph: bool = False
    # transport between the processes: ring (shared memory) or zmq (pickle baseline)
    transport: str = "ring"
    # detokenizer: an HTTP worker that reads none of its text for this long while text waits
    # for it has its requests failed (the other workers' streams never wait for it), seconds
    worker_stall_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in LIST_FIELDS:  # a list (from JSON, e.g. the engine's spec) is kept as a tuple
            value = getattr(self, name)
            if isinstance(value, str):
                value = _parse_list(value)
            object.__setattr__(self, name, tuple(value))
            if any(not isinstance(v, str) or not v or "," in v for v in value):
                raise ValueError(f"--{_flag(name)}: every value must be a non-empty string without commas")
        for name in ("tp_size", "dp_size"):
            if getattr(self, name) != 1:
                kind = "tensor" if name == "tp_size" else "data"
                raise ValueError(
                    f"--{_flag(name)} {getattr(self, name)}: {kind} parallelism is not supported{PARALLELISM_HINT}"
                )
        choices = {
            "dtype": ("auto", "float32", "bfloat16", "float16"),
            "device": ("auto", "cpu", "cuda"),
            "attention_backend": (None, "cpu", "torch", "triton", "flashinfer"),
            "quantization": ("auto", "none", "gguf", "gguf-q8"),
            "kv_cache_dtype": ("auto", "float16", "bfloat16", "fp8_e5m2"),
            "schedule_policy": ("fcfs", "lpm"),
            "speculative_algorithm": ("NGRAM", "none"),
            "transport": ("ring", "zmq"),
            "grammar_backend": ("xgrammar", "none"),
            "tool_call_parser": (None, *PARSERS),
            "reasoning_parser": (None, *REASONING_PARSERS),
            "log_level": ("debug", "info", "warning", "error", "critical"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"--{_flag(name)} must be one of {[a for a in allowed if a]}, not {getattr(self, name)!r}"
                )
        positive = (
            "port",
            "workers",
            "stream_interval",
            "page_size",
            "max_running_requests",
            "chunked_prefill_size",
            "max_prefill_tokens",
            "speculative_num_draft_tokens",
            "speculative_ngram_min_match_window_size",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be at least 1")
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
        if self.max_request_bytes < 1024:
            raise ValueError("--max-request-bytes must be at least 1024")
        if not self.body_read_timeout > 0:
            raise ValueError("--body-read-timeout must be positive")
        if not self.worker_stall_timeout > 0:
            raise ValueError("--worker-stall-timeout must be positive")
        if not self.watchdog_timeout > 0:
            raise ValueError("--watchdog-timeout must be positive")
        if self.engine_max_restarts < 0:
            raise ValueError("--engine-max-restarts must be at least 0")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("--mem-fraction-static must be in (0, 1)")
        if self.chat_template is not None and not (
            os.path.isfile(self.chat_template) or "{{" in self.chat_template or "{%" in self.chat_template
        ):
            raise ValueError(
                f"--chat-template must be a Jinja template or a file holding one: {self.chat_template!r} is neither"
            )

    @classmethod
    def from_cli(cls, argv: Sequence[str] | None = None) -> ServerArgs:
        """Flags given are parsed into their field (an alias into a name of its own, merged by
        _merge_aliases); flags not given keep the field's default."""
        parser = argparse.ArgumentParser(
            prog="python -m runtime serve", description="Start the ringserve OpenAI-compatible server."
        )
        for f in dataclasses.fields(cls):
            names = [f"--{_flag(f.name)}", *SHORT_FLAGS.get(f.name, ())]
            _add_flag(parser, names, f.name, f.type, HELP.get(f.name))
        for alias, target in ALIASES.items():
            help_ = f"= --{_flag(target)} (vLLM's name)"
            _add_flag(parser, [f"--{_flag(alias)}"], ALIAS_DEST + alias, _field_type(target), help_, target.upper())
        given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
        for name in LIST_FIELDS:  # several values, each a JSON or comma-separated list
            if name in given:
                given[name] = _parse_list(given[name])
        return cls(**_merge_aliases(given, "--", _flag))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerArgs:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in [*(f.name for f in dataclasses.fields(cls)), *ALIASES]:
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is None:
                continue
            annotation = _field_type(ALIASES.get(name, name))
            kind = _base_type(annotation)
            dest = ALIAS_DEST + name if name in ALIASES else name
            try:
                if name in LIST_FIELDS:
                    values[dest] = _parse_list(raw)
                else:
                    values[dest] = _parse_bool(raw) if kind is bool else kind(raw)
            except ValueError:
                raise ValueError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind.__name__}") from None
        return cls(**_merge_aliases(values, ENV_PREFIX, str.upper))

    def to_env(self) -> dict[str, str]:
        """The environment that makes from_env() rebuild these arguments."""
        env = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in LIST_FIELDS:
                env[ENV_PREFIX + f.name.upper()] = json.dumps(list(value))
            elif value is not None:
                env[ENV_PREFIX + f.name.upper()] = str(value)
        return env


# vLLM's names of ringserve's settings (SGLang's --tp is here too). --max-num-batched-tokens is
# vLLM's token budget of one step, into which long prompts are chunked: ringserve's prompt tokens
# a step, --chunked-prefill-size.
ALIASES = {
    "max_model_len": "context_length",
    "gpu_memory_utilization": "mem_fraction_static",
    "max_num_seqs": "max_running_requests",
    "max_num_batched_tokens": "chunked_prefill_size",
    "tensor_parallel_size": "tp_size",
    "tp": "tp_size",
    "data_parallel_size": "dp_size",
    "dp": "dp_size",
}
SHORT_FLAGS = {"tp_size": ("-tp",), "dp_size": ("-dp",)}  # vLLM's
ALIAS_DEST = "alias__"
LIST_FIELDS = ("served_model_name", "allowed_origins", "allowed_methods", "allowed_headers")
PARALLELISM_HINT = "; run several servers behind sglang-router"
NO_EFFECT = {
    "trust_remote_code": "accepted with no effect: ringserve runs its own model code, never code from the hub",
    "enable_metrics": "accepted with no effect: /metrics is always on",
    "disable_cuda_graph": "accepted with no effect: ringserve captures no CUDA graphs",
}
HELP = {
    **NO_EFFECT,
    "served_model_name": "one or more names: the first is what responses report, any is accepted as `model`",
    "tokenizer_path": "a tokenizer directory other than the model's",
    "dtype": "auto (default): float32 on the CPU (bfloat16 measured no faster there: perf/results/quality.md), "
    "bfloat16 on CUDA; or float32, bfloat16, float16",
    "quantization": "auto (default): gguf-q8 for a .gguf Llama/Mistral model on the CPU in float32 where the C "
    "kernels build, else none; none: fp32 weights dequantized, the exact computation; gguf: the file's Q4_1/Q8_0 "
    "blocks, fp32 activations (same values, another order of sums); gguf-q8: the blocks with activations rounded "
    "to int8 per 32 values as llama.cpp (mean KL from none and perplexity: perf/results/quality.md)",
    "kv_cache_dtype": "auto (default): the model's dtype; float16 / bfloat16: half the bytes per token; "
    "fp8_e5m2: a quarter (lossy)",
    "log_requests": "log one line a request: rid, endpoint, prompt tokens, finish reason, latency (never text)",
    "allowed_origins": "CORS origins (a JSON list or several values, * for any; default none: no CORS headers)",
    "allowed_methods": "CORS methods (default *)",
    "allowed_headers": "CORS request headers (default *)",
    "allow_credentials": "CORS: allow credentials",
    "speculative_algorithm": "NGRAM (default): n-gram speculative decoding of greedy requests; none: off",
    "speculative_num_draft_tokens": "NGRAM: the most tokens a request drafts a step (default 8; adapted to acceptance)",
    "tp_size": "1 only: tensor parallelism is not supported" + PARALLELISM_HINT,
    "dp_size": "1 only: data parallelism is not supported" + PARALLELISM_HINT,
}


def _merge_aliases(given: dict[str, Any], prefix: str, spell) -> dict[str, Any]:
    """`given` (field or ALIAS_DEST + alias -> value) with each alias's value moved to its field;
    an alias and its field (or two aliases of it) given different values is a ValueError."""
    values = {k: v for k, v in given.items() if not k.startswith(ALIAS_DEST)}
    named = {k: k for k in values}
    for key, value in given.items():
        if not key.startswith(ALIAS_DEST):
            continue
        alias = key[len(ALIAS_DEST) :]
        target = ALIASES[alias]
        if target in values and values[target] != value:
            raise ValueError(
                f"{prefix}{spell(alias)} {value} and {prefix}{spell(named[target])} {values[target]} conflict: "
                f"they name the same setting ({prefix}{spell(target)})"
            )
        values[target], named[target] = value, alias
    return values


def _field_type(name: str) -> Any:
    return {f.name: f.type for f in dataclasses.fields(ServerArgs)}[name]


def _add_flag(
    parser: argparse.ArgumentParser,
    names: list[str],
    dest: str,
    annotation: Any,
    help_: str | None,
    metavar: str | None = None,
) -> None:
    """A flag whose value is None unless given (the field's default applies then)."""
    kind = _base_type(annotation)
    if kind is bool:
        parser.add_argument(*names, dest=dest, action="store_true", default=None, help=help_)
    elif kind is tuple:
        parser.add_argument(*names, dest=dest, nargs="*", default=None, help=help_)
    else:
        parser.add_argument(*names, dest=dest, type=kind, default=None, help=help_, metavar=metavar)


def _parse_list(raw: str | Sequence[Any]) -> tuple[str, ...]:
    """A JSON list (vLLM's form: '["http://a", "http://b"]') or comma-separated values; several
    command-line values (nargs) are each read so and joined."""
    if not isinstance(raw, str):
        return tuple(v for item in raw for v in (_parse_list(item) if isinstance(item, str) else (item,)))
    text = raw.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"{raw!r} is not a JSON list") from None
        if not isinstance(items, list):
            raise ValueError(f"{raw!r} is not a JSON list")
        return tuple(items)
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def _base_type(annotation: Any) -> type:
    """`int | None` -> int; annotations are strings under `from __future__ import annotations`."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"__builtins__": __builtins__}, {})
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return typing.get_origin(annotation) or annotation
