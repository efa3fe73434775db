"""The model executor a server's arguments ask for."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from gpu.model_runner import ModelRunner, ModelRunnerConfig
from gpu.null_model import NullModelRunner
from runtime.config import ServerArgs


def runner_config(args: ServerArgs) -> ModelRunnerConfig:
    """Every ModelRunnerConfig field from the server argument of the same name."""
    return ModelRunnerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ModelRunnerConfig)})


def make_runner(args: ServerArgs, progress: Callable[[], None] | None = None) -> ModelRunner | NullModelRunner:
    """The real model, or the null model (instant tokens) with --null-model. `progress`: called
    between the layers of the real model's forward (ModelRunner)."""
    config = runner_config(args)
    return NullModelRunner(config) if args.null_model else ModelRunner(config, progress)
