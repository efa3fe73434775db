"""What the scheduler core is told at start: batch and prefill limits, the queue policy, the
new-token ratio that paces admission, the grammar backend and speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass

from runtime.config import ServerArgs


@dataclass(frozen=True)
class SchedulerConfig:
    context_length: int
    max_running_requests: int = 256
    chunked_prefill_size: int = 2048  # prefill tokens of one step (a longer prompt is split)
    max_prefill_tokens: int = 16384
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    # Admission keeps KV room for this fraction of the running requests' remaining max_tokens
    # (SGLang's new_token_ratio): it decays while decoding goes well and jumps back to the
    # initial value on a retraction, trading admission eagerness against retraction churn.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.1
    new_token_ratio_decay: float = 0.001
    grammar_backend: str = "xgrammar"  # xgrammar | none (constrained requests fail)
    constrained_json_any_whitespace: bool = False  # False: JSON schemas allow compact JSON only
    tokenizer_path: str | None = None  # --tokenizer-path (None: the model's directory)
    # speculative decoding (runtime/scheduler/speculative.py): NGRAM or none (off)
    speculative_algorithm: str = "none"
    speculative_num_draft_tokens: int = 8
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12

    @classmethod
    def from_server_args(cls, args: ServerArgs, context_length: int, **overrides) -> SchedulerConfig:
        return cls(
            context_length=context_length,
            max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            max_prefill_tokens=args.max_prefill_tokens,
            schedule_policy=args.schedule_policy,
            disable_radix_cache=args.disable_radix_cache,
            grammar_backend=args.grammar_backend,
            constrained_json_any_whitespace=args.constrained_json_any_whitespace,
            tokenizer_path=args.tokenizer_path,
            speculative_algorithm=args.speculative_algorithm,
            speculative_num_draft_tokens=args.speculative_num_draft_tokens,
            speculative_ngram_min_match_window_size=args.speculative_ngram_min_match_window_size,
            speculative_ngram_max_match_window_size=args.speculative_ngram_max_match_window_size,
            **overrides,
        )
