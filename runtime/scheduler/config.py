"""What the scheduler core is told at start: batch and prefill limits, the queue policy, the
new-token ratio that paces admission, the grammar backend and speculative decoding."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from runtime.config import ServerArgs


@dataclass(frozen=True)
class SchedulerConfig:
    """The fields named as ServerArgs' are those settings (runtime/config.py says what each
    does), with their defaults, but context_length: the model's unless the setting lowers it.
    from_server_args copies them by name."""

    context_length: int
    max_running_requests: int = ServerArgs.max_running_requests
    chunked_prefill_size: int = ServerArgs.chunked_prefill_size
    max_prefill_tokens: int = ServerArgs.max_prefill_tokens
    schedule_policy: str = ServerArgs.schedule_policy
    disable_radix_cache: bool = ServerArgs.disable_radix_cache
    # Admission keeps KV room for this fraction of the running requests' remaining max_tokens
    # (SGLang's new_token_ratio): it decays while decoding goes well and jumps back to the
    # initial value on a retraction, trading admission eagerness against retraction churn.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    grammar_backend: str = ServerArgs.grammar_backend
    constrained_json_any_whitespace: bool = ServerArgs.constrained_json_any_whitespace
    grammar_compile_timeout: float = ServerArgs.grammar_compile_timeout
    tokenizer_path: str | None = ServerArgs.tokenizer_path
    lora_paths: tuple[str, ...] = ServerArgs.lora_paths
    max_loaded_loras: int = ServerArgs.max_loaded_loras
    speculative_algorithm: str = ServerArgs.speculative_algorithm
    speculative_num_draft_tokens: int = ServerArgs.speculative_num_draft_tokens
    speculative_ngram_min_match_window_size: int = ServerArgs.speculative_ngram_min_match_window_size
    speculative_ngram_max_match_window_size: int = ServerArgs.speculative_ngram_max_match_window_size

    @classmethod
    def from_server_args(cls, args: ServerArgs, context_length: int, **overrides) -> SchedulerConfig:
        """`args`' settings of the same names; `overrides` (this class's other fields) win."""
        settings = {f.name for f in dataclasses.fields(ServerArgs)} - {"context_length"}
        copied = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name in settings}
        return cls(**{**copied, "context_length": context_length, **overrides})
