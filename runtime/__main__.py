"""`python -m runtime serve [flags]`: the one-command way to run the server.

Checks the flags and the model (a bad one is one line on stderr and exit status 1) while
the engine's processes, started first, import what they load with; then lets them load and
becomes granian (exec, same pid) serving runtime.app:app with the flags passed as
RINGSERVE_* environment variables, exactly as `granian --interface asgi runtime.app:app`
does with them set by hand. The exec leaves nothing of this
process's imports behind in granian's main process, whose workers it forks.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from runtime.config import ALIASES, ServerArgs
from runtime.settings import ENV_PREFIX, env_name
from runtime.supervise.launcher import start_engine_early

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")  # one of them: a tokenizer

# Connections (granian's own settings; ServerArgs' body limits are the app's): HTTP/1 only, since
# granian's automatic HTTP/2 detection waits for a client's first bytes with no timeout (an idle
# connection that never sends one would stay open for ever), while HTTP/1's header read timeout
# closes it; and room for this many requests in flight a worker (granian's backpressure, by
# default 1024 / workers), so that slow clients, which the body read timeout cuts off in the
# end, do not hold every place and leave /health waiting.
GRANIAN_BACKPRESSURE = 8192
MAX_HEADER_READ_TIMEOUT_MS = 60_000  # granian's upper bound
GRANIAN_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warning", "error": "error", "critical": "critical"}


def granian_command(args: ServerArgs) -> list[str]:
    return [
        sys.executable,
        "-m",
        "granian",
        "--interface",
        "asgi",
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--workers",
        str(args.workers),
        "--http",
        "1",
        "--http1-header-read-timeout",
        str(min(MAX_HEADER_READ_TIMEOUT_MS, max(1, round(args.body_read_timeout * 1000)))),
        "--backpressure",
        str(GRANIAN_BACKPRESSURE),
        "--respawn-failed-workers",  # a worker that dies, or is killed as frozen (worker_watch.py), is replaced
        "--log-level",
        GRANIAN_LOG_LEVELS[args.log_level],
        "--process-name",
        "ringserve",
        "runtime.app:app",
    ]


def server_env(args: ServerArgs) -> dict[str, str]:
    """This environment without the RINGSERVE_* variables of settings (a setting's and its
    aliases'), plus those of `args`. The others (RINGSERVE_CACHE_DIR, RINGSERVE_IPC_NATIVE,
    ...) are no settings: they reach granian and the engine as they are."""
    settings_env = {env_name(name) for name in (*(f.name for f in dataclasses.fields(ServerArgs)), *ALIASES)}
    env = {k: v for k, v in os.environ.items() if k not in settings_env}
    env.update(args.to_env())
    return env


def check_model(args: ServerArgs) -> str | None:
    """Why the model cannot be served (one line), or None. A GGUF's directory is made once
    (its tokenizer), and its tensors are checked against the config here: a file whose
    metadata lies about shapes fails the start, not each scheduler granian respawns."""
    from gpu.models.model_config import ModelConfig
    from gpu.models.model_files import ModelLoadError, resolve_model_dir
    from runtime.http_worker.chat_template import read_chat_template

    try:
        config = ModelConfig.from_dir(resolve_model_dir(args.model_path), args.context_length)
        if config.gguf_path is not None:
            from gpu.models.gguf_layout import gguf_layout

            gguf_layout(config)  # without torch: the scheduler, started beside, imports it
        if args.enable_lora:  # every adapter read and checked against the model once, here
            import torch

            from gpu.lora import load_adapter
            from protocol.lora import lora_target_set, parse_lora_paths

            targets = lora_target_set(args.lora_target_modules)
            for name, path in parse_lora_paths(args.lora_paths):
                load_adapter(name, path, config, args.max_lora_rank, targets, torch.float32, torch.device("cpu"))
        if args.chat_template is not None:
            read_chat_template(args.chat_template)
        if args.tokenizer_path is not None and not any(
            (Path(args.tokenizer_path) / name).is_file() for name in TOKENIZER_FILES
        ):
            return f"--tokenizer-path {args.tokenizer_path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}) there"
    except (ModelLoadError, OSError, ValueError) as e:
        return str(e)
    return None


def hide_secrets(argv: list[str]) -> None:
    """Rewrites this process's command line (what /proc/PID/cmdline shows every local user)
    without the value of --api-key, at once: the checks below take seconds (the model's
    config, a GGUF's conversion). The key reaches granian in RINGSERVE_API_KEY, never on its
    command line; RINGSERVE_API_KEY=K python -m runtime serve keeps it off every command line."""
    shown, hide = [], False
    for arg in argv:
        if hide:
            shown.append("***")
            hide = False
        elif arg == "--api-key":
            shown.append(arg)
            hide = True
        elif arg.startswith("--api-key="):
            shown.append("--api-key=***")
        else:
            shown.append(arg)
    if shown != argv:
        from setproctitle import setproctitle

        setproctitle(" ".join([sys.executable, "-m", "runtime", *shown]))


def raise_open_files_limit() -> None:
    """Every connection is a file descriptor: the soft limit (often 1024) raised to the hard one,
    so that many clients, slow ones included, do not run the server out of them."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
        hide_secrets(argv)
    if not argv or argv[0] != "serve":
        print(
            "usage: python -m runtime serve [--model-path PATH] [--host H] [--port N] [--workers N] ... "
            "(python -m runtime serve --help)",
            file=sys.stderr,
        )
        return 2
    try:
        args = ServerArgs.from_cli(argv[1:])
        if args.api_key is None and os.environ.get(ENV_PREFIX + "API_KEY"):  # a key kept off the command line
            args = dataclasses.replace(args, api_key=os.environ[ENV_PREFIX + "API_KEY"])
    except ValueError as e:
        print(f"ringserve: {e}", file=sys.stderr)
        return 2
    raise_open_files_limit()  # before the engine starts: its processes inherit the limit
    env = server_env(args)
    engine = start_engine_early(args, env)  # its imports run beside the checks
    problem = check_model(args)
    if problem:
        engine.cancel()
        print(f"ringserve: {problem}", file=sys.stderr)
        return 1
    engine.hand_over()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, granian_command(args), env)


if __name__ == "__main__":
    sys.exit(main())
