"""A granian worker's start (the ASGI lifespan's): its settings, logging and tokenizer, the
engine it attaches to (starting it if it is the first), and the worker process that serves it
(traced when RINGSERVE_TRACE_TTFT names a directory)."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from gpu.models.model_files import ModelLoadError
from httpapi.info import served_model_name
from httpapi.logprobs import LogprobVocab
from runtime.config import ServerArgs
from runtime.gc_tuning import settle_heap
from runtime.http_worker.chat_template import read_chat_template
from runtime.http_worker.core import ModelInfo, TokenizerManager
from runtime.http_worker.metrics import WorkerMetrics, use_multiprocess_dir
from runtime.http_worker.process import HTTPWorkerProcess, RequestOutbox
from runtime.http_worker.traced import TracedHTTPWorkerProcess, TracedTokenizerManager
from runtime.supervise.files import ServerFiles
from runtime.supervise.launcher import attach_engine
from runtime.ttft_trace import TtftTrace
from structured.tools import HERMES_TEMPLATE

logger = logging.getLogger("ringserve.app")


async def start_http_worker() -> HTTPWorkerProcess:
    args = ServerArgs.from_env()
    _configure_logging(args.log_level)
    files = ServerFiles.of(os.getppid())  # granian's main process: the server
    use_multiprocess_dir(files.metrics_dir)  # before prometheus_client is imported
    loading = asyncio.ensure_future(asyncio.to_thread(_load_tokenizer, args))  # while the engine starts
    try:
        link = await asyncio.to_thread(attach_engine, args, files)
    except BaseException:
        await asyncio.gather(loading, return_exceptions=True)
        raise
    try:
        tokenizer, model, vocab = await loading
        metrics = WorkerMetrics(model.served_name)
    except BaseException:
        link.close(files)
        raise
    outbox = RequestOutbox(link.request_ch)
    tm_args = (link.worker, outbox.send, tokenizer, model, args.request_timeout, args.stream_interval)
    trace_dir = TtftTrace.directory()
    if trace_dir is None:
        worker = HTTPWorkerProcess(args, files, link, outbox, TokenizerManager(*tm_args), vocab, metrics)
    else:
        tm = TracedTokenizerManager(*tm_args, trace=TtftTrace(trace_dir, f"worker{link.worker}"))
        worker = TracedHTTPWorkerProcess(args, files, link, outbox, tm, vocab, metrics)
    worker.start()
    settle_heap()
    logger.info(
        "HTTP worker %d (pid %d) attached to the engine of server %d: scheduler pid %d, detokenizer pid %d",
        link.worker,
        os.getpid(),
        files.server_pid,
        *(p.pid for p in link.procs),
    )
    return worker


def _configure_logging(level: str) -> None:
    log = logging.getLogger("ringserve")
    log.setLevel(level.upper())
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s worker {os.getpid()}: %(message)s"))
        log.addHandler(handler)
        log.propagate = False


def _load_tokenizer(args: ServerArgs) -> tuple[Any, ModelInfo, LogprobVocab]:
    from gpu.models.model_config import ModelConfig
    from gpu.models.model_files import resolve_model_dir
    from runtime.tokenizer_load import load_tokenizer

    model_dir = resolve_model_dir(args.model_path)
    cfg = ModelConfig.from_dir(model_dir, args.context_length)
    tokenizer = load_tokenizer(args.tokenizer_path or model_dir)
    # the embedded model's own template renders no tools; the Hermes one renders everything
    # else as it does (tests/unit/test_hermes_template.py), and tool calls as the hermes parser reads them
    template = args.chat_template or (str(HERMES_TEMPLATE) if args.model_path is None else None)
    if template is not None:
        try:
            tokenizer.chat_template = read_chat_template(template)
        except (OSError, ValueError) as e:
            raise ModelLoadError(str(e)) from None
    model = ModelInfo(
        str(model_dir),
        served_model_name(args.model_path, args.served_model_name),
        cfg.architecture,
        cfg.context_length,
        cfg.vocab_size,
        cfg.eos_token_ids,
    )
    return tokenizer, model, LogprobVocab.from_tokenizer(tokenizer, cfg.vocab_size)
