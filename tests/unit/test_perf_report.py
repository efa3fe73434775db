"""perf/report.py, where every benchmark writes its results: both files written, the run's
facts in them (commit, date, machine, load, versions, command), secrets redacted, a dirty
tree's run kept out of perf/results/ unless --allow-dirty says so; and every benchmark in
perf/ goes through it."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from perf import report

ROOT = report.ROOT
PERF = ROOT / "perf"
SECRETS = ("sk-one", "sk-two", "sk-three", "sk-four", "sk-five", "sk-six")


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def flags(out, allow_dirty=False) -> argparse.Namespace:
    return argparse.Namespace(out=out, allow_dirty=allow_dirty)


def write(tmp_path, monkeypatch, argv=("--levels", "1,2"), data=None, markdown="| a |\n|---|\n| 1 |"):
    monkeypatch.setattr(sys, "argv", [str(PERF / "ipc_bench.py"), *argv])
    started = report.start(flags(tmp_path / "demo.json"))
    return report.write_results("demo", data or {"rows": [{"x": 1}]}, markdown, started, out=tmp_path / "demo.json")


def test_writes_json_and_markdown_with_the_run_facts(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    json_path, md_path = write(tmp_path, monkeypatch)
    assert (json_path, md_path) == (tmp_path / "demo.json", tmp_path / "demo.md")
    result = json.loads(json_path.read_text())
    assert result["benchmark"] == "demo" and result["rows"] == [{"x": 1}]
    run = result["run"]
    assert {"commit", "dirty_files", "date", "duration_s", "command", "machine", "load", "versions"} <= run.keys()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", run["date"])
    assert run["command"] == "python -m perf.ipc_bench --levels 1,2"  # the interpreter as `python`, run as a module
    machine = run["machine"]
    assert machine["cpu"] and machine["logical_cores"] >= 1 and machine["memory_gib"] > 0
    assert len(run["load"]["loadavg_before"]) == 3 and run["load"]["openblas_coretype"] == "Haswell"
    assert run["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert run["versions"]["numpy"] and run["versions"]["torch"]


def test_commit_is_the_checkouts_short_hash(tmp_path, monkeypatch):
    commit = json.loads(write(tmp_path, monkeypatch)[0].read_text())["run"]["commit"]
    assert commit.removesuffix("+dirty") == git(ROOT, "rev-parse", "--short", "HEAD")


def checkout(tmp_path, monkeypatch) -> tuple[Path, str]:
    """A committed checkout with perf/results/ in it, the report's root; (its path, its short hash)."""
    repo = tmp_path / "repo"
    (repo / "perf" / "results").mkdir(parents=True)
    (repo / "code.py").write_text("x = 1\n")
    (repo / "perf" / "results" / "old.json").write_text("{}\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "one")
    monkeypatch.setattr(report, "ROOT", repo)
    monkeypatch.setattr(report, "RESULTS", repo / "perf" / "results")
    return repo, git(repo, "rev-parse", "--short", "HEAD")


def test_dirty_means_tracked_changes_outside_the_results(tmp_path, monkeypatch):
    repo, head = checkout(tmp_path, monkeypatch)
    (repo / "untracked.py").write_text("")
    assert report.git_state() == (head, [])  # untracked files do not count
    (repo / "perf" / "results" / "old.json").write_text('{"new": 1}\n')
    assert report.git_state() == (head, [])  # nor earlier results not yet committed
    (repo / "code.py").write_text("x = 2\n")
    assert report.git_state() == (f"{head}+dirty", ["code.py"])
    monkeypatch.setattr(report, "ROOT", tmp_path / "nowhere")
    assert report.git_state() == ("unknown", [])


def test_a_dirty_tree_may_not_write_into_the_results(tmp_path, monkeypatch):
    repo, head = checkout(tmp_path, monkeypatch)
    results = repo / "perf" / "results"
    assert report.start(flags(None)).commit == head  # a clean tree: the default place is fine
    (repo / "code.py").write_text("x = 2\n")
    for out in (None, results / "bench.json"):
        with pytest.raises(report.DirtyTree, match="--allow-dirty") as refused:
            report.start(flags(out))
        assert "code.py" in str(refused.value) and head in str(refused.value)
    started = report.start(flags(tmp_path / "elsewhere.json"))  # out of perf/results/: written, marked dirty
    json_path, _ = report.write_results("bench", {"x": 1}, "", started, out=tmp_path / "elsewhere.json")
    run = json.loads(json_path.read_text())["run"]
    assert (run["commit"], run["dirty_files"], run["allow_dirty"]) == (f"{head}+dirty", ["code.py"], False)


def test_allow_dirty_is_recorded_in_both_files(tmp_path, monkeypatch):
    repo, head = checkout(tmp_path, monkeypatch)
    (repo / "code.py").write_text("x = 2\n")
    monkeypatch.setattr(sys, "argv", [str(repo / "perf" / "sse_bench.py"), "--allow-dirty"])
    started = report.start(flags(None, allow_dirty=True))
    json_path, md_path = report.write_results("bench", {"x": 1}, "", started)
    assert json_path == repo / "perf" / "results" / "bench.json"
    run = json.loads(json_path.read_text())["run"]
    assert (run["commit"], run["allow_dirty"], run["command"]) == (
        f"{head}+dirty",
        True,
        "python -m perf.sse_bench --allow-dirty",
    )
    commit_line = md_path.read_text().splitlines()[2]
    assert commit_line == f"- commit: `{head}+dirty` (1 tracked files changed; written with --allow-dirty)"


def test_every_benchmark_takes_the_report_flags():
    parser = argparse.ArgumentParser()
    report.add_arguments(parser, "bench")
    args = parser.parse_args([])
    assert (args.out, args.allow_dirty) == (report.RESULTS / "bench.json", False)
    assert parser.parse_args(["--allow-dirty"]).allow_dirty


def test_api_key_values_are_redacted_everywhere(tmp_path, monkeypatch):
    argv = [
        "--api-key",
        "sk-one",
        "--server-args",
        "--api-key=sk-two --max-running-requests 8",
        "--output-tokens",
        "16",
    ]
    data = {
        "server_args": ["--transport", "ring", "--api-key", "sk-three"],
        "note": "ran with --api-key 'sk-four'",
        "runs": [{"args": "--hf-token=sk-six"}],
    }
    json_path, md_path = write(tmp_path, monkeypatch, argv, data, "| args |\n|---|\n| `--api-key sk-five` |")
    text = json_path.read_text() + md_path.read_text()
    for secret in SECRETS:
        assert secret not in text
    result = json.loads(json_path.read_text())
    assert result["run"]["command"] == (
        "python -m perf.ipc_bench --api-key '<redacted>' --server-args "
        "'--api-key=<redacted> --max-running-requests 8' --output-tokens 16"
    )
    assert result["server_args"] == ["--transport", "ring", "--api-key", "<redacted>"]
    assert "--output-tokens 16" in md_path.read_text()  # a flag that only looks like one stays


def test_markdown_has_the_header_then_the_tables(tmp_path, monkeypatch):
    _, md_path = write(tmp_path, monkeypatch, markdown=report.table(("name", "µs"), [("ring", "1.5"), ("zmq", None)]))
    lines = md_path.read_text().splitlines()
    assert lines[0] == "# demo"
    head = "\n".join(lines[:10])
    for fact in (
        "- commit: `",
        "- date: ",
        "- machine: ",
        "logical cores",
        "- load average before",
        "OPENBLAS_CORETYPE",
        "- versions: Python ",
        "- command: `python -m perf.ipc_bench --levels 1,2`",
    ):
        assert fact in head, fact
    at = lines.index("| name | µs |")
    assert lines[at : at + 4] == ["| name | µs |", "|---|---|", "| ring | 1.5 |", "| zmq | - |"]
    assert all(line.startswith("- ") for line in lines[2:at] if line)


def test_default_path_and_reserved_keys(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    started = report.start(flags(None, allow_dirty=True), [])
    paths = report.write_results("bench", {"x": 1}, "", started)
    assert paths == (tmp_path / "results" / "bench.json", tmp_path / "results" / "bench.md")
    with pytest.raises(ValueError, match="run"):
        report.write_results("bench", {"run": 1}, "", started)


# perf/headline.py measures nothing: it writes the README's headline from a result;
# perf/conformance_shim.py is the pytest plugin perf/conformance.py loads into the peers' tests;
# perf/random_gguf.py writes the model files perf/scale_bench.py measures
NOT_BENCHMARKS = ("report.py", "__init__.py", "headline.py", "conformance_shim.py", "random_gguf.py")
SCRIPTS = sorted(p for p in PERF.glob("*.py") if p.name not in NOT_BENCHMARKS)


def test_there_are_benchmarks():
    assert len(SCRIPTS) >= 9, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_writes_through_the_report(script):
    """A new benchmark cannot skip perf/report.py (nor its flags: the dirty-tree guard), nor keep
    a JSON writer of its own."""
    text = script.read_text()
    assert re.search(r"^from perf import report\b", text, re.M), f"{script.name} does not import report"
    for call in ("report.add_arguments(", "report.start(", "write_results("):
        assert call in text, f"{script.name} does not call {call}"
    assert "sys.path" not in text, f"{script.name} edits sys.path: run it as python -m perf.{script.stem}"
    assert not re.search(r"\bjson\.dumps?\(", text), f"{script.name} writes JSON itself"


def test_cuda_decode_bench_without_cuda_says_so(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    out = tmp_path / "cuda.json"
    proc = subprocess.run(
        [sys.executable, "-m", "perf.cuda_decode_bench", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "needs a CUDA device" in proc.stderr, proc.stdout + proc.stderr
    assert not out.exists()
