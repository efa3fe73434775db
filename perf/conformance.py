"""The peers' own OpenAI-server test suites, run against ringserve (issue 29's target).

    python -m perf.conformance --allow-dirty                 # vLLM's tests/entrypoints/openai
    python -m perf.conformance --sglang-tests DIR            # and SGLang's test/srt/openai_server

Not part of CI: it downloads the peers' code, runs for tens of minutes and measures
conformance, not a property the project's tests hold it to. Nothing of the peers' is
vendored: vLLM's tests come from its sdist on PyPI and SGLang's from a checkout of its
repository (its sdist has no tests; `--sglang-tests` names the `test/srt/openai_server`
folder of one, or the runner downloads the tagged tarball from GitHub when it can), both
into a cache outside the repository (`--cache-dir`). Their tests run in a separate venv
(`--venv`: their client packages and the peers' wheels, for the imports their tests
make; the project's .venv is never touched) with perf/conformance_shim.py, which
hands their server fixtures a ringserve on the embedded model named as the tests' models.

Each test ends as passed, failed (with its cause: the assertion or error's first line) or
set aside, each set-aside test by a listed reason (SET_ASIDE below, or the suite's own skip
with its message); a whole file is set aside when it starts no server (unit tests of the
peer's own classes). Results: perf/results/conformance.md and .json.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from gpu.models.model_files import resolve_model_dir
from perf import report
from perf.conformance_shim import USES_RINGSERVE, set_aside_match

ROOT = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.33.0"
SGLANG_VERSION = "0.5.10.post1"  # the newest on PyPI when this runner was written
SGLANG_TESTS_IN_REPO = "test/srt/openai_server"
PYPI_SIMPLE = "https://pypi.org/simple"
# What the peers' test files import besides the peers themselves: the client side and the
# plugins their suites use. vLLM's wheel comes with its dependencies (its tests/utils.py,
# which the shim keeps, imports most of them); SGLang's without (its test helpers need
# little beyond what vLLM brought: SGLANG_IMPORT_DEPS).
CLIENT_PACKAGES = ["pytest", "pytest-asyncio", "pytest-timeout", "openai", "requests", "jsonschema", "regex", "httpx"]
SGLANG_IMPORT_DEPS = ["ipython", "datasets"]
TEST_TIMEOUT_S = 120  # one test; a hang is a failure with its cause, not a stuck run
FILE_TIMEOUT_S = 1800  # one file, servers' start-ups included

# Tests set aside, by a reason each: (suite, path relative to the suite's folder, a test's name
# without its parameters, a prefix ending in "_", a name and its first parameters ending in "-",
# or "" for the whole file) -> reason. Only tests that depend on another model's exact output or
# vocabulary, LoRA, images or audio, a GPU, or the peer's own internals belong here; anything
# else that fails is counted as failed, with its cause.
OTHER_MODEL = "depends on another model's exact output or vocabulary"
LORA = "LoRA adapters of another model"
MEDIA = "images, audio or prompt embeddings"
GPU = "needs a GPU or the peer's kernels"
INTERNALS = "the peer's internals (its engine, its Python classes, its env vars)"
# A test that loads another model's files (its tokenizer, its chat template, adapters) from the
# Hugging Face hub depends on that model's vocabulary or format; offline here, it fails at the
# download, which is how it is recognised (the run sets HF_HUB_OFFLINE=1).
HUB_FILES = "another model's files from the Hugging Face hub (its tokenizer or template: its vocabulary)"
HUB_ERRORS = (
    "LocalEntryNotFoundError",
    "OfflineModeIsEnabled",
    "couldn't connect to 'https://huggingface.co'",
    "Provide a valid Hugging Face repository ID",
)
NO_SERVER = INTERNALS + ": the test used no server (it runs the peer's own classes)"
HARMONY = "gpt-oss's Harmony format (another model's output format)"
NO_LIMIT = OTHER_MODEL + ": no max_tokens, and it relies on its model ending the answer soon"
REASONING = OTHER_MODEL + " (a reasoning model's <think> part; the embedded model does not think)"
# tool_choice auto leaves the call to the model, and these tests set no max_output_tokens: the
# embedded model may answer in text, at temperature 1 up to the context's end (minutes on a CPU)
AUTO_CALL = NO_LIMIT + ": the model choosing to call the tool (tool_choice auto)"
FORCED_CALLS = NO_LIMIT + ": how many calls the model makes before it closes a forced call's array"
SET_ASIDE: dict[tuple[str, str, str], str] = {
    ("vllm", "correctness/test_lmeval.py", ""): OTHER_MODEL + " (GSM8K accuracy of Qwen2-1.5B)",
    ("vllm", "completion/test_tensorizer_entrypoint.py", ""): INTERNALS + " (tensorizer weights)",
    ("vllm", "completion/test_completion_with_prompt_embeds.py", ""): MEDIA,
    ("vllm", "chat_completion/test_chat_completion_with_prompt_embeds.py", ""): MEDIA,
    ("vllm", "chat_completion/test_extra_content_fields.py", ""): MEDIA + " (translategemma's images)",
    ("vllm", "models/test_models.py", ""): LORA + " (listed in /v1/models)",
    ("vllm", "chat_completion/test_chat.py", "test_structured_outputs_choice_chat"): OTHER_MODEL,
    ("vllm", "chat_completion/test_chat.py", "test_response_format_json_"): OTHER_MODEL + ' ({"result": 2})',
    ("vllm", "chat_completion/test_chat.py", "test_complex_message_content"): OTHER_MODEL + ' ("2", exactly)',
    ("vllm", "chat_completion/test_chat.py", "test_custom_role"): NO_LIMIT,
    ("vllm", "chat_completion/test_chat.py", "test_more_than_one_prompt_logprobs_chat"): OTHER_MODEL
    + " (whether a prompt token is the model's top-1)",
    ("vllm", "chat_completion/test_chat.py", "test_single_chat_session"): OTHER_MODEL + " (zephyr's token counts)",
    ("vllm", "chat_completion/test_completion_with_function_calling.py", ""): REASONING + " and tool calls",
    ("vllm", "completion/test_completion.py", "test_completion_streaming"): OTHER_MODEL
    + " (an answer that runs past 5 tokens: finish_reason length; the embedded model's greedy first token"
    + " after 'What is an LLM?' is its end of turn)",
    ("vllm", "responses/test_basic.py", "test_simple_input"): OTHER_MODEL + " (13 * 24 = 312: a model's arithmetic)",
    ("vllm", "responses/test_basic.py", "test_instructions"): OTHER_MODEL + " (13 * 24 = 312: a model's arithmetic)",
    ("vllm", "responses/test_basic.py", "test_chat"): OTHER_MODEL + " (a model's answer: 30)",
    ("vllm", "responses/test_function_call.py", "test_function_tool_use"): REASONING
    + ": a reasoning item beside the call",
    ("vllm", "responses/test_function_call.py", "test_named_tool_use"): NO_LIMIT
    + " (its second answer, unforced, at temperature 1)",
    ("vllm", "responses/test_function_call.py", "test_function_calling_with_streaming_expected_arguments"): OTHER_MODEL
    + " (the model choosing to call both tools, tool_choice auto)",
    ("vllm", "responses/test_function_call.py", "test_function_calling_with_streaming_types[True-auto-"): AUTO_CALL,
    ("vllm", "responses/test_function_call.py", "test_function_calling_with_streaming_types[False-auto-"): AUTO_CALL,
    # tool_choice required with parallel_tool_calls: the call array ends when the model closes it
    ("vllm", "responses/test_function_call.py", "test_function_calling_with_streaming_types[True-required-"): (
        FORCED_CALLS
    ),
    ("vllm", "responses/test_function_call.py", "test_function_calling_with_streaming_types[False-required-"): (
        FORCED_CALLS
    ),
    ("vllm", "responses/test_function_call.py", "test_function_calling_with_streaming_forced_tool_choice[required-"): (
        FORCED_CALLS
    ),
    ("vllm", "responses/test_namespace_tool_separator.py", ""): AUTO_CALL,
    ("vllm", "chat_completion/test_batched_chat_completions.py", "test_batched_chat_completions"): NO_LIMIT
    + " ('Reply with exactly the word: alpha' at temperature 1, in its client's 60 s)",
    ("vllm", "responses/test_simple.py", "test_enable_response_messages"): OTHER_MODEL
    + " (an answer to 'Hello?' longer than 10 characters, at temperature 1; the embedded model may say 'Hello.')",
    ("vllm", "test_return_token_ids.py", "test_comparison_with_prompt_logprobs_and_logprobs"): OTHER_MODEL
    + " (an answer that runs past 20 tokens: one that ends on its end-of-turn token decodes with it, the text without)",
    ("vllm", "responses/test_function_call.py", "test_function_calling_with_streaming_forced_tool_choice[auto-"): (
        AUTO_CALL
    ),
    ("vllm", "responses/test_stateful.py", "test_previous_response_id"): OTHER_MODEL
    + " (a model recalling a name from the earlier turns)",
    ("vllm", "responses/test_stateful.py", "test_two_responses_with_same_prev_id"): OTHER_MODEL
    + " (a model recalling a name from the earlier turns)",
    ("vllm", "responses/test_structured_output.py", ""): OTHER_MODEL
    + " (a model's extraction inside the schema: 'science fair', 'Friday')",
    ("vllm", "responses/test_simple.py", "test_reasoning_item"): REASONING,
    ("vllm", "responses/test_simple.py", "test_streaming_logprobs"): NO_LIMIT
    + " (at temperature 1 the embedded model's answer to 'Say hello.' can run to the end of its context)",
    ("vllm", "responses/test_simple.py", "test_max_tokens"): OTHER_MODEL
    + " (an answer past 30 tokens; the embedded model's to 'What is the first paragraph of Moby Dick?' is shorter)",
    ("vllm", "responses/test_simple.py", "test_streaming_reasoning_tokens_e2e"): REASONING,
    ("vllm", "responses/test_simple.py", "test_non_streaming_reasoning_tokens_e2e"): REASONING,
    ("vllm", "test_return_token_ids.py", "test_chat_completion_with_tool_use"): OTHER_MODEL
    + " (whether the model calls the tool unforced, in Qwen2.5's <tool_call> text)",
    ("vllm", "chat_completion/test_serving_chat.py", "test_gpt_oss_"): HARMONY,
    ("vllm", "chat_completion/test_include_reasoning.py", "test_include_reasoning_true_"): REASONING,
    ("vllm", "chat_completion/test_include_reasoning.py", "test_reasoning_tokens_in_usage"): REASONING,
    ("vllm", "chat_completion/test_include_reasoning.py", "test_default_includes_reasoning"): REASONING,
    ("vllm", "responses/test_harmony.py", ""): HARMONY,
    ("vllm", "responses/test_mcp_tools.py", ""): HARMONY + " and MCP tool servers",
    ("vllm", "responses/test_parsable_context.py", ""): INTERNALS + " (VLLM_USE_EXPERIMENTAL_PARSER_CONTEXT)",
    ("sglang", "validation/test_matched_stop.py", "test_finish_stop_eos"): OTHER_MODEL + " (Llama 3's <|eot_id|>)",
}


@dataclass
class FileRun:
    suite: str
    suite_root: Path  # where pytest runs (vLLM's: the sdist's root, whose tests/ is a package)
    folder: Path  # the suite's test folder
    path: Path

    @property
    def rel(self) -> str:
        return self.path.relative_to(self.folder).as_posix()


@dataclass
class Outcome:
    suite: str
    file: str
    test: str
    status: str  # passed, failed, set aside
    detail: str  # a failure's cause, a set-aside's reason


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ringserve-conformance"


def sdist_url(package: str, version: str) -> tuple[str, str]:
    """(url, sha256) of a package's sdist, from PyPI's simple index (what pip reads)."""
    with urllib.request.urlopen(f"{PYPI_SIMPLE}/{package}/", timeout=60) as r:
        page = r.read().decode()
    name = f"{package}-{version}.tar.gz"
    found = re.search(r'href="([^"]*/' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', page)
    if not found:
        raise SystemExit(f"no sdist {name} on {PYPI_SIMPLE}")
    return found.group(1), found.group(2)


def vllm_suite(cache: Path) -> Path:
    """vLLM's tests, extracted from its sdist (downloaded once, checked against its sha256)."""
    root = cache / f"vllm-{VLLM_VERSION}"
    if (root / "tests" / "entrypoints" / "openai").is_dir():
        return root
    archive = cache / f"vllm-{VLLM_VERSION}.tar.gz"
    url, sha256 = sdist_url("vllm", VLLM_VERSION)
    if not archive.exists():
        urllib.request.urlretrieve(url, archive)
    if hashlib.sha256(archive.read_bytes()).hexdigest() != sha256:
        archive.unlink()
        raise SystemExit(f"{archive.name}: sha256 differs from PyPI's; removed, run again")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"vllm-{VLLM_VERSION}/tests/")]
        tar.extractall(cache, members=members, filter="data")
    return root


def sglang_suite(cache: Path, given: Path | None) -> Path | None:
    """SGLang's openai_server tests: `given` (a checkout's folder), else the tagged tarball's
    from GitHub, once; None (said why) when neither is to be had."""
    if given is not None:
        return given
    folder = cache / f"sglang-{SGLANG_VERSION}-tests" / SGLANG_TESTS_IN_REPO
    if folder.is_dir():
        return folder
    url = f"https://codeload.github.com/sgl-project/sglang/tar.gz/refs/tags/v{SGLANG_VERSION}"
    try:
        archive, _ = urllib.request.urlretrieve(url)
    except OSError as e:
        print(f"SGLang's tests not run: {url}: {e}; pass --sglang-tests DIR", file=sys.stderr)
        return None
    with tarfile.open(archive) as tar:
        prefix = f"sglang-{SGLANG_VERSION}/{SGLANG_TESTS_IN_REPO}/"
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name.removeprefix(f"sglang-{SGLANG_VERSION}/")
        tar.extractall(folder.parents[2], members=members, filter="data")
    return folder


def peer_wheel(cache: Path, venv_python: Path, package: str, version: str) -> Path:
    wheels = cache / "wheels"
    found = sorted(wheels.glob(f"{package}-{version}-*.whl"))
    if not found:
        pip = [str(venv_python), "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:"]
        subprocess.run([*pip, "-d", str(wheels), f"{package}=={version}"], check=True)
        found = sorted(wheels.glob(f"{package}-{version}-*.whl"))
    return found[0]


def conformance_venv(cache: Path, venv: Path) -> Path:
    """The venv the peers' tests run in: created once, apart from the project's .venv."""
    python = venv / "bin" / "python"
    if (venv / ".conformance-ready").exists():
        return python
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, *CLIENT_PACKAGES, str(peer_wheel(cache, python, "vllm", VLLM_VERSION))], check=True)
    subprocess.run([*pip, *SGLANG_IMPORT_DEPS], check=True)
    subprocess.run([*pip, "--no-deps", str(peer_wheel(cache, python, "sglang", SGLANG_VERSION))], check=True)
    (venv / ".conformance-ready").touch()
    return python


LAUNCHERS = ("RemoteOpenAIServer", "popen_launch_server")  # what the shim replaces


def starts_a_server(path: Path, folder: Path) -> bool:
    """Whether a test file may start a server through what the shim replaces: itself, or
    through a fixture of a conftest.py of its folders that starts one (directly or through
    another such fixture: vLLM's responses/conftest.py's `client` over `server_with_store`)."""
    words = set(re.findall(r"\w+", path.read_text()))
    if words & set(LAUNCHERS):
        return True
    serving: set[str] = set(LAUNCHERS)
    for conftest in (d / "conftest.py" for d in path.parents if d.is_relative_to(folder)):
        if not conftest.exists():
            continue
        source = conftest.read_text()
        functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        grew = True
        while grew:  # to a fixed point: fixtures over fixtures that start a server
            found = {
                f.name for f in functions if set(re.findall(r"\w+", ast.get_source_segment(source, f) or "")) & serving
            }
            grew = not found <= serving
            serving |= found
    return bool(words & serving)


def set_aside_reason(suite: str, file: str, test: str) -> str | None:
    for (s, f, name), reason in SET_ASIDE.items():
        if s == suite and f == file and set_aside_match(name, test):
            return reason
    if "lora" in test.lower():  # vLLM's tests parametrized with an adapter's name ("zephyr-lora")
        return LORA
    return None


def test_names(path: Path) -> list[str]:
    """The test functions and methods a file defines (for counting a file set aside whole)."""
    tree = ast.parse(path.read_text())
    return [
        n.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")
    ]


SGLANG_RETRY = "retry() exceed maximum number of retries"  # CustomTestCase's wrapper of the real failure


def cause_of(case: ET.Element) -> str:
    """A failed test's cause: its failure's or error's message, first lines, trimmed. Under
    SGLang's retry wrapper, the first failure inside it, and the error body the server sent
    if the test printed one."""
    for tag in ("failure", "error"):
        node = case.find(tag)
        if node is None:
            continue
        message = (node.get("message") or node.text or "").strip()
        if SGLANG_RETRY in message:
            inner = [line[1:].strip() for line in (node.text or "").splitlines() if line.startswith("E ")]
            said = [line for line in (case.findtext("system-out") or "").splitlines() if line.startswith('{"error"')]
            message = "\n".join(inner[:1] + said[:1]) or message
        lines = [line for line in message.splitlines() if line.strip()][:3]
        return " / ".join(lines)[:400]
    return ""


def run_file(suite: str, suite_root: Path, folder: Path, path: Path, python: Path, logs: Path) -> list[Outcome]:
    """One test file under pytest with the shim; its outcomes, from its JUnit XML."""
    rel = path.relative_to(folder).as_posix()
    xml = logs / (rel.replace("/", "__") + ".xml")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("RINGSERVE_", "VIRTUAL_ENV"))},
        "PYTHONPATH": str(ROOT / "perf"),
        "HF_HUB_OFFLINE": "1",
        "CONFORMANCE_SUITE": suite,
        "CONFORMANCE_SUITE_ROOT": str(suite_root),
        "CONFORMANCE_REPO": str(ROOT),
        "CONFORMANCE_REPO_PYTHON": str(ROOT / ".venv" / "bin" / "python"),
        "CONFORMANCE_LOG_DIR": str(logs),
        "CONFORMANCE_TOKENIZER_DIR": str(resolve_model_dir(None)),
        "CONFORMANCE_SET_ASIDE": "".join(name + "\n" for s, f, name in SET_ASIDE if s == suite and f == rel),
    }
    argv = [str(python), "-m", "pytest", "-p", "conformance_shim", str(path), f"--junitxml={xml}", "-q"]
    argv += ["-p", "no:cacheprovider", f"--timeout={TEST_TIMEOUT_S}", "--rootdir", str(suite_root)]
    argv += ["-o", "junit_logging=system-out", "-o", "junit_log_passing_tests=false"]  # what a failed test printed
    if suite == "vllm":  # vLLM's top conftest.py sets up its engine; the suite's own stay
        argv += ["--confcutdir", str(suite_root / "tests" / "entrypoints")]
    with open(logs / (rel.replace("/", "__") + ".log"), "wb") as out:
        try:
            subprocess.run(argv, cwd=suite_root, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=FILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return [Outcome(suite, rel, "*", "failed", f"the file ran past {FILE_TIMEOUT_S} s")]
    if not xml.exists():
        return [Outcome(suite, rel, "*", "failed", "pytest wrote no results (see its log)")]
    outcomes = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("name", "")
        reason = set_aside_reason(suite, rel, name)
        skipped = case.find("skipped")
        used = case.find(f"properties/property[@name='{USES_RINGSERVE}']")
        if reason is not None:  # skipped by the shim (a name containing "lora" is run, then counted here)
            status, detail = "set aside", reason
        elif skipped is not None:
            status, detail = "set aside", "skipped by the suite: " + (skipped.get("message") or "")[:200]
        elif (used is None or used.get("value") != "True") and "failed on setup" not in cause_of(case):
            status, detail = "set aside", NO_SERVER
        elif case.find("failure") is not None or case.find("error") is not None:
            status, detail = "failed", cause_of(case)
            if any(e in ET.tostring(case, encoding="unicode") for e in HUB_ERRORS):
                status, detail = "set aside", HUB_FILES
        else:
            status, detail = "passed", ""
        outcomes.append(Outcome(suite, rel, name, status, detail))
    if not outcomes:  # collection failed: the file's error is its one outcome
        outcomes.append(Outcome(suite, rel, "*", "failed", collection_error(logs / (rel.replace("/", "__") + ".log"))))
    return outcomes


def collection_error(log: Path) -> str:
    errors = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("E ")]
    return (errors[-1][2:].strip() if errors else "collection failed (see its log)")[:400]


def plan_suite(suite: str, suite_root: Path, folder: Path, only: list[str]) -> tuple[list[Outcome], list[FileRun]]:
    """A suite's files: those set aside whole (their tests' outcomes at once) and those to run."""
    aside: list[Outcome] = []
    runs: list[FileRun] = []
    for path in sorted(folder.rglob("test_*.py")):
        rel = path.relative_to(folder).as_posix()
        if only and not any(rel.startswith(o) for o in only):
            continue
        whole = set_aside_reason(suite, rel, "")
        if whole is None and not starts_a_server(path, folder):
            whole = NO_SERVER
        if whole is not None:
            aside += [Outcome(suite, rel, name, "set aside", whole) for name in test_names(path)]
        else:
            runs.append(FileRun(suite, suite_root, folder, path))
    return aside, runs


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    return {s: sum(o.status == s for o in outcomes) for s in ("passed", "failed", "set aside")}


def markdown(outcomes: list[Outcome], not_run: dict[str, str]) -> str:
    suites = sorted({o.suite for o in outcomes})
    by_suite = [[s, *counts([o for o in outcomes if o.suite == s]).values()] for s in suites]
    parts = [
        "A test is one pytest item (each parametrization); a file set aside whole is not collected,",
        "so it counts its test functions. Causes are the failures' first lines; the logs of each",
        "file and server are in the cache's logs/ folder.",
        "",
        "## Counts by suite",
        "",
        report.table(["suite", "passed", "failed", "set aside"], by_suite),
    ]
    parts += [f"\n{suite}: not run: {why}" for suite, why in not_run.items()]
    files = sorted({(o.suite, o.file) for o in outcomes})
    rows = [[s, f"`{f}`", *counts([o for o in outcomes if (o.suite, o.file) == (s, f)]).values()] for s, f in files]
    parts += ["", "## Counts by file", "", report.table(["suite", "file", "passed", "failed", "set aside"], rows)]
    failed = [[o.suite, f"`{o.file}::{o.test}`", o.detail] for o in outcomes if o.status == "failed"]
    parts += ["", "## Failures and their causes", "", report.table(["suite", "test", "cause"], failed)]
    reasons: dict[str, int] = {}
    for o in outcomes:
        if o.status == "set aside":
            reasons[o.detail] = reasons.get(o.detail, 0) + 1
    by_reason = sorted(reasons.items(), key=lambda kv: -kv[1])
    parts += ["", "## Set aside, by reason", "", report.table(["reason", "tests"], by_reason)]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    report.add_arguments(parser, "conformance")
    parser.add_argument("--cache-dir", type=Path, default=default_cache(), help="downloads and the peers' tests")
    parser.add_argument("--venv", type=Path, default=None, help="the venv the tests run in (default: <cache>/venv)")
    parser.add_argument("--sglang-tests", type=Path, default=None, help=f"a checkout's {SGLANG_TESTS_IN_REPO}")
    parser.add_argument("--suite", choices=("vllm", "sglang", "all"), default="all")
    parser.add_argument("--only", nargs="*", default=[], help="test files (path prefixes in their suite) to run")
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the earlier results (--out) of the files this run does not run (with --only: rerun a few)",
    )
    args = parser.parse_args(argv)
    started = report.start(args, argv)
    cache = args.cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    python = conformance_venv(cache, args.venv or cache / "venv")
    logs = cache / "logs"
    if not args.update:
        shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(exist_ok=True)
    outcomes: list[Outcome] = []
    runs: list[FileRun] = []
    not_run: dict[str, str] = {}
    if args.suite in ("sglang", "all"):
        folder = sglang_suite(cache, args.sglang_tests)
        if folder is None:
            not_run["sglang"] = "its tests could not be had (no --sglang-tests, GitHub unreachable)"
        else:
            aside, todo = plan_suite("sglang", folder, folder, args.only)
            outcomes, runs = outcomes + aside, runs + todo
    if args.suite in ("vllm", "all"):
        root = vllm_suite(cache)
        aside, todo = plan_suite("vllm", root, root / "tests" / "entrypoints" / "openai", args.only)
        outcomes, runs = outcomes + aside, runs + todo
    earlier: dict = {}
    if args.update:
        earlier = json.loads(Path(args.out).read_text())
        planned = {(o.suite, o.file) for o in outcomes} | {
            (r.suite, r.path.relative_to(r.folder).as_posix()) for r in runs
        }
        kept = [Outcome(**o) for o in earlier["outcomes"] if (o["suite"], o["file"]) not in planned]
        outcomes = kept + outcomes
        earlier = {"earlier_run": earlier["run"]}  # whose results of the other files were kept
    write(outcomes, not_run, runs, args, started, earlier)
    for k, run in enumerate(runs):  # the results are written after each file: a cut-short run says so
        print(f"{run.suite}: {run.path.relative_to(run.folder)}", file=sys.stderr, flush=True)
        outcomes += run_file(run.suite, run.suite_root, run.folder, run.path, python, logs)
        write(outcomes, not_run, runs[k + 1 :], args, started, earlier)


def write(
    outcomes: list[Outcome],
    not_run: dict[str, str],
    pending: list[FileRun],
    args: argparse.Namespace,
    started: report.Started,
    earlier: dict,
) -> None:
    """The results so far; `pending`: the files not run yet (none once the run is whole);
    `earlier`: the run whose results of other files --update kept."""
    if pending:
        not_run = {**not_run, "files": "not yet run: " + ", ".join(f"{r.suite} {r.path.name}" for r in pending)}
    data = {
        "versions": {"vllm": VLLM_VERSION, "sglang": SGLANG_VERSION},
        "counts": {s: counts([o for o in outcomes if o.suite == s]) for s in sorted({o.suite for o in outcomes})},
        "not_run": not_run,
        "outcomes": [o.__dict__ for o in outcomes],
        **earlier,
    }
    text = markdown(outcomes, not_run)
    if earlier:
        run = earlier["earlier_run"]
        text = (
            f"The files this command did not run keep the results of the run at {run['commit']}, {run['date']}.\n\n"
            + text
        )
    report.write_results("conformance", data, text, started, out=args.out)


if __name__ == "__main__":
    main()
