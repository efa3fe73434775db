"""The model executor a server's arguments ask for."""

from __future__ import annotations

from gpu.model_runner import ModelRunner, ModelRunnerConfig
from gpu.null_model import NullModelRunner
from runtime.config import ServerArgs


def runner_config(args: ServerArgs) -> ModelRunnerConfig:
    return ModelRunnerConfig(
        model_path=args.model_path,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        page_size=args.page_size,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        random_seed=args.random_seed,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def make_runner(args: ServerArgs) -> ModelRunner | NullModelRunner:
    """The real model, or the null model (instant tokens) with --null-model."""
    config = runner_config(args)
    return NullModelRunner(config) if args.null_model else ModelRunner(config)
