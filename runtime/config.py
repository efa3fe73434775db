"""Server arguments: one frozen dataclass, filled from CLI flags (`python -m runtime
serve`) or from RINGSERVE_* environment variables (`granian ... runtime.app:app`).

Flag names follow SGLang's launch_server where they mean the same thing; the
environment variable of `--max-running-requests` is RINGSERVE_MAX_RUNNING_REQUESTS.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from structured.reasoning import REASONING_PARSERS
from structured.tool_parsers import PARSERS

ENV_PREFIX = "RINGSERVE_"


@dataclass(frozen=True)
class ServerArgs:
    # model
    model_path: str | None = None  # HF directory or .gguf file; None = embedded SmolLM2
    served_model_name: str | None = None
    chat_template: str | None = None  # a Jinja chat template, or a file holding one (None: the tokenizer's)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on CUDA)
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str | None = None  # cpu | torch | triton | flashinfer (None: per device)
    context_length: int | None = None
    # gguf: run a GGUF's Q4_1 / Q8_0 weights as they are (CPU kernels, fp32 activations);
    # gguf-q8: the same with activations quantized to int8 per 32 values as llama.cpp does
    # (faster; the numerics change by the activations' rounding)
    quantization: str | None = None
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
    # supervision (runtime/supervise/): a scheduler or detokenizer whose heartbeat is older than
    # this is hung: killed and replaced like a dead one, seconds (SGLang's flag; the scheduler
    # beats before each forward, and one chunked-prefill forward of a 7B model in fp32 on a few
    # CPU cores takes minutes)
    watchdog_timeout: float = 300.0
    # a dead or hung engine is replaced at most this many times in 10 minutes (with a growing
    # wait between tries); then every request is a 503 until the server restarts. 0: never
    engine_max_restarts: int = 5
    # transport between the processes: ring (shared memory) or zmq (pickle baseline)
    transport: str = "ring"
    # detokenizer: an HTTP worker that reads none of its text for this long while text waits
    # for it has its requests failed (the other workers' streams never wait for it), seconds
    worker_stall_timeout: float = 30.0

    def __post_init__(self) -> None:
        choices = {
            "dtype": ("auto", "float32", "bfloat16", "float16"),
            "device": ("auto", "cpu", "cuda"),
            "attention_backend": (None, "cpu", "torch", "triton", "flashinfer"),
            "quantization": (None, "gguf", "gguf-q8"),
            "kv_cache_dtype": ("auto", "float16", "bfloat16", "fp8_e5m2"),
            "schedule_policy": ("fcfs", "lpm"),
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
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be at least 1")
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
        parser = argparse.ArgumentParser(
            prog="python -m runtime serve", description="Start the ringserve OpenAI-compatible server."
        )
        for f in dataclasses.fields(cls):
            kind = _base_type(f.type)
            if kind is bool:
                parser.add_argument(f"--{_flag(f.name)}", action="store_true", default=f.default)
            else:
                parser.add_argument(f"--{_flag(f.name)}", type=kind, default=f.default)
        return cls(**vars(parser.parse_args(argv)))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServerArgs:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            kind = _base_type(f.type)
            try:
                values[f.name] = _parse_bool(raw) if kind is bool else kind(raw)
            except ValueError:
                raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={raw!r} is not a valid {kind.__name__}") from None
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The environment that makes from_env() rebuild these arguments."""
        return {
            ENV_PREFIX + f.name.upper(): str(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }


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
    return annotation
