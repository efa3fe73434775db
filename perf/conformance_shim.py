"""A pytest plugin that hands the peers' OpenAI-server tests a running ringserve.

Loaded by scripts/conformance.py into pytest in the conformance venv (never the project's
.venv). It replaces the one thing in each suite that starts a server: vLLM's
`RemoteOpenAIServer` (tests/utils.py) and SGLang's `popen_launch_server`
(sglang/test/test_utils.py). Every other line of their tests runs as they wrote it.

The server is `python -m runtime serve` from the repository, on its embedded default model
(SmolLM2-135M-Instruct), with the test's model names as `--served-model-name` aliases. The
peers' launch flags are translated: ringserve's own names and aliases pass unchanged, the few
spelled differently are renamed, flags that tune another engine without changing what the API
answers are dropped (listed below, with why), a context longer than the served model's
positions is cut to them (it was another model's), and anything else passes through so that
ringserve refuses it and the test fails naming it: a real difference, not hidden here.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

# Set by perf/conformance.py: CONFORMANCE_REPO (the ringserve checkout under test),
# CONFORMANCE_REPO_PYTHON (its .venv's python), CONFORMANCE_LOG_DIR (each server's output),
# CONFORMANCE_SUITE ("vllm" or "sglang"), CONFORMANCE_SUITE_ROOT (the peer's tests' root) and
# CONFORMANCE_TOKENIZER_DIR (the served model's tokenizer).
START_TIMEOUT_S = 300.0
USES_RINGSERVE = "uses_ringserve"  # the JUnit property saying whether a test reached a ringserve

# CONFORMANCE_SET_ASIDE: the names (set_aside_match's) of the file's tests the runner sets aside,
# each ended by a newline ("" names the whole file): they are skipped, not run (many would run
# to their timeout).
SET_ASIDE_SKIP = "set aside by the conformance runner"


def set_aside_match(name: str, test: str) -> bool:
    """Whether `test` (a pytest item's name) is what a SET_ASIDE entry's `name` names: a test
    function without its parameters, a prefix ending in "_" or "-", or "" (the whole file)."""
    return test.split("[")[0] == name or (name.endswith(("_", "-")) or not name) and test.startswith(name)


def pytest_collection_modifyitems(items: list) -> None:
    names = os.environ.get("CONFORMANCE_SET_ASIDE", "").split("\n")[:-1]
    for item in items:
        if any(set_aside_match(name, item.name) for name in names):
            item.add_marker(pytest.mark.skip(reason=SET_ASIDE_SKIP))


servers_started = 0  # ringserve servers this process started: a test that starts none, and uses
server_fixtures: set[str] = set()  # no fixture that did, tests the peer's own code, not ringserve
SERVERS_BEFORE = pytest.StashKey[int]()

# vLLM's or SGLang's spelling -> ringserve's, where the setting is the same but the name is not.
RENAMED = {
    "--seed": "--random-seed",
    "--no-enable-prefix-caching": "--disable-radix-cache",
    "--structured-outputs-config.backend": "--grammar-backend",
}

# Flags that tune the peer's engine (memory, kernels, compilation, weights' format) or name
# another model's files, and change nothing ringserve's API answers: dropped, value and all.
# A flag here never hides a difference a test checks; one that does belongs in no list.
DROPPED_WITH_VALUE = {
    "--dtype": "the weights' type of the peer's model; ringserve serves its own model in its dtype",
    "--gpu-memory-utilization": "a GPU's share; ringserve on a CPU sizes its KV cache itself",
    "--mem-fraction-static": "a GPU's share; ringserve on a CPU sizes its KV cache itself",
    "--load-format": "how the peer loads weights (dummy, tensorizer)",
    "--hf-overrides": "the peer's model config overrides",
    "--tokenizer": "the peer model's tokenizer; ringserve serves its own model's",
    "--tokenizer-path": "the peer model's tokenizer; ringserve serves its own model's",
    "--compilation-config": "torch.compile settings",
    "--cuda-graph-max-bs": "CUDA graphs",
    "--attention-backend": "the peer's kernels",
    "--kv-cache-dtype": "the peer's KV cache type",
    "--block-size": "the peer's KV page size",
    "--device": "the peer's device",
}
# LoRA is set aside (another model's adapters, from the hub): its flags are dropped, so that
# the base model's tests of a module whose server also loads adapters still run, and the
# fixtures that download the adapters give a path naming what was not downloaded.
LORA_FLAGS_WITH_VALUE = ("--lora-modules", "--max-lora-rank", "--max-cpu-loras", "--max-loras", "--lora-paths")
LORA_FIXTURE_SUFFIX = "_lora_files"
CONTEXT_FLAGS = ("--max-model-len", "--context-length")


def served_positions() -> int:
    """The served model's positions (its config.json's), which ringserve's --context-length may not pass."""
    with open(os.path.join(os.environ["CONFORMANCE_TOKENIZER_DIR"], "config.json")) as f:
        return int(json.load(f)["max_position_embeddings"])


DROPPED_FLAGS = {
    "--enable-lora": "LoRA is set aside",
    "--enforce-eager": "CUDA graphs off",
    "--disable-cuda-graph": "CUDA graphs off",
    "--enable-chunked-prefill": "ringserve always chunks long prefills",
    "--enable-auto-tool-choice": "ringserve reads `tool_choice: auto` answers whenever tools are given",
    "--disable-log-requests": "logging",
    "--disable-log-stats": "logging",
    "--trust-remote-code": "ringserve runs its own model code",
    "--skip-server-warmup": "SGLang's warm-up request",
    "--enable-prefix-caching": "ringserve caches prefixes by default",
    "--enable-prompt-tokens-details": "ringserve's usage always carries prompt_tokens_details (cached tokens)",
}


def translate_flags(args: list[str]) -> list[str]:
    """The peer's launch flags as ringserve's `serve` flags (see the module docstring)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        flag, value = args[i], None
        if flag.startswith("--") and "=" in flag:
            flag, value = flag.split("=", 1)
        flag = flag.replace("_", "-") if flag.startswith("--") else flag  # vLLM's parser reads both spellings
        takes_value = value is None and i + 1 < len(args) and not args[i + 1].startswith("--")
        if flag in DROPPED_FLAGS:
            i += 1
            continue
        if flag in CONTEXT_FLAGS:  # another model's context: the served model's positions at most
            given = value if value is not None else args[i + 1]
            out += [flag, str(min(int(given), served_positions()))]
            i += 1 if value is not None else 2
            continue
        if flag in LORA_FLAGS_WITH_VALUE:  # a list: --lora-modules a=x b=y
            i += 1
            while value is None and i < len(args) and not args[i].startswith("--"):
                i += 1
            continue
        if flag in DROPPED_WITH_VALUE:
            i += 1 if value is not None else 2
            continue
        if flag == "--reasoning-parser":  # vLLM spells ringserve's parser names with "_"
            value = (value if value is not None else args[i + 1]).replace("_", "-")
            takes_value = False
            i += 1 if "=" not in args[i] else 0
        out.append(RENAMED.get(flag, flag))
        if value is not None:
            out.append(value)
        i += 1
        while takes_value and i < len(args) and not args[i].startswith("--"):  # lists: --served-model-name a b
            out.append(args[i])
            i += 1
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def names_flag(model: str, flags: list[str]) -> list[str]:
    """`--served-model-name`: the peer's served names (first: what responses report), then the model."""
    if "--served-model-name" not in flags:
        return [*flags, "--served-model-name", model]
    i = flags.index("--served-model-name") + 1
    while i < len(flags) and not flags[i].startswith("--"):
        i += 1
    return [*flags[:i], model, *flags[i:]]


def log_path(port: int) -> str:
    return os.path.join(os.environ["CONFORMANCE_LOG_DIR"], f"server-{port}.log")


def launch(model: str, flags: list[str], env_extra: dict[str, str] | None, port: int) -> subprocess.Popen[bytes]:
    """`python -m runtime serve` on `port` (granian: its pid is the server's)."""
    python = os.environ["CONFORMANCE_REPO_PYTHON"]
    argv = [python, "-m", "runtime", "serve", "--port", str(port), *names_flag(model, flags)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}
    env.update(env_extra or {})
    if "VLLM_API_KEY" in env:  # vLLM's documented way to set its --api-key
        env["RINGSERVE_API_KEY"] = env["VLLM_API_KEY"]
    log = open(log_path(port), "wb")  # the child writes to it
    log.write((" ".join(argv) + "\n").encode())
    log.flush()
    repo = os.environ["CONFORMANCE_REPO"]
    return subprocess.Popen(argv, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def last_line(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else ""


def wait_healthy(proc: subprocess.Popen[bytes], url: str, headers: dict[str, str], log: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ringserve exited with status {proc.returncode} at start-up: {last_line(log)}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("ringserve did not become healthy in time")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to granian (it stops its workers and engine), then SIGKILL to its group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


class RingserveOpenAIServer:
    """vLLM's RemoteOpenAIServer's interface (tests/utils.py), serving ringserve."""

    DUMMY_API_KEY = "token-abc123"  # vLLM's, for clients of a server without --api-key

    def __init__(
        self,
        model: str,
        vllm_serve_args: list[str],
        *,
        env_dict: dict[str, str] | None = None,
        seed: int | None = 0,
        auto_port: bool = True,
        max_wait_seconds: float | None = None,
        override_hf_configs: dict[str, Any] | None = None,
    ) -> None:
        flags = translate_flags(list(vllm_serve_args))
        self.host = "127.0.0.1"
        if "--port" in flags:
            self.port = int(flags[flags.index("--port") + 1])
            del flags[flags.index("--port") : flags.index("--port") + 2]
        else:
            self.port = free_port()
        if seed is not None and "--random-seed" not in flags:
            flags += ["--random-seed", str(seed)]
        api_key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
        self.proc = launch(model, flags, env_dict, self.port)
        global servers_started
        servers_started += 1
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            wait_healthy(self.proc, self.url_for("health"), headers, log_path(self.port))
        except Exception:
            stop(self.proc)
            raise

    def __enter__(self) -> RingserveOpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self.proc)

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        return self.url_root + "/" + "/".join(p.strip("/") for p in parts if p)

    def get_client(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: Any) -> Any:
        import openai

        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)


def popen_launch_server(
    model: str,
    base_url: str,
    timeout: float,
    api_key: str | None = None,
    other_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    return_stdout_stderr: tuple[Any, Any] | None = None,
    device: str = "auto",
    **_: Any,
) -> subprocess.Popen[bytes]:
    """SGLang's popen_launch_server (sglang/test/test_utils.py), serving ringserve at base_url."""
    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    flags = translate_flags([str(a) for a in (other_args or [])])
    if api_key:
        flags += ["--api-key", api_key]
    proc = launch(model, flags, env, port)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    global servers_started
    servers_started += 1
    try:
        wait_healthy(proc, f"{base_url}/health", headers, log_path(port))
    except Exception:
        stop(proc)
        raise
    return proc


def kill_process_tree(pid: int, *_: Any, **__: Any) -> None:
    """SGLang's teardown: ringserve's server is granian, which stops its own tree on SIGTERM;
    reaped here (popen_launch_server's Popen is this process's child), killed after 30 s."""
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
            time.sleep(0.2)
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, ChildProcessError):
        pass


def serve_the_served_tokenizer(module: Any) -> None:
    """The peer's own get_tokenizer, given the served model's tokenizer directory for whatever
    model the test names: the server serves that name with that model, so counting a prompt's
    tokens means counting them with its tokenizer (another model's vocabulary is never asked)."""
    if "CONFORMANCE_TOKENIZER_DIR" not in os.environ:
        return
    original = module.get_tokenizer

    def get_tokenizer(*args: Any, **kwargs: Any) -> Any:  # the name, first or as tokenizer_name=, replaced
        rest = args if kwargs.pop("tokenizer_name", None) is not None else args[1:]
        return original(os.environ["CONFORMANCE_TOKENIZER_DIR"], *rest, **kwargs)

    module.get_tokenizer = get_tokenizer


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: Any, parser: Any, args: Any) -> None:
    """Put the shim in place of the peer's launcher before any conftest.py or test module
    imports it (vLLM's responses/conftest.py does). The peers' modules are imported by name:
    they exist only in the conformance venv, and `tests.utils` here is vLLM's tests package
    (their sdist's), not this project's."""
    suite = os.environ["CONFORMANCE_SUITE"]
    early_config.pluginmanager.register(LoraAdapterFixtures())
    sys.path.insert(0, os.environ["CONFORMANCE_SUITE_ROOT"])
    if suite == "vllm":
        vllm_test_utils = importlib.import_module("tests.utils")  # whole: tests use its other helpers
        vllm_test_utils.RemoteOpenAIServer = RingserveOpenAIServer
        serve_the_served_tokenizer(importlib.import_module("vllm.tokenizers"))
    else:
        serve_the_served_tokenizer(importlib.import_module("sglang.srt.utils.hf_transformers_utils"))
        sglang_test_utils = importlib.import_module("sglang.test.test_utils")
        sglang_test_utils.popen_launch_server = popen_launch_server
        sglang_test_utils.kill_process_tree = kill_process_tree
        importlib.import_module("sglang.srt.utils").kill_process_tree = kill_process_tree


class LoraAdapterFixtures:
    """The LoRA adapters' download fixtures (`zephyr_lora_files`, ...): not downloaded (LoRA is
    set aside); the path they give names that, and no flag passes it to ringserve. A plugin of
    its own: this module's pytest_fixture_setup is the server-noting wrapper."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any) -> Any:
        if not fixturedef.argname.endswith(LORA_FIXTURE_SUFFIX):
            return None
        value = f"/nonexistent/{fixturedef.argname}: LoRA is set aside"
        fixturedef.cached_result = (value, fixturedef.cache_key(request), None)
        return value


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Any:
    """Notes the fixtures that start a ringserve (vLLM's `server` fixtures, by whatever name)."""
    before = servers_started
    yield
    if servers_started != before:
        server_fixtures.add(fixturedef.argname)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Any:
    item.stash[SERVERS_BEFORE] = servers_started
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    """Marks in the JUnit XML (which takes the teardown report's properties) whether the test
    used a ringserve: through a fixture that started one (SGLang's setUpClass is one too), or by
    starting one itself (vLLM's `with RemoteOpenAIServer(...)` in a test's body)."""
    if call.when == "teardown":
        started = servers_started != item.stash[SERVERS_BEFORE]
        used = started or bool(server_fixtures & set(getattr(item, "fixturenames", ())))
        item.user_properties.append((USES_RINGSERVE, str(used)))
    yield
