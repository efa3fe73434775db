"""Where every benchmark in perf/ writes its results: perf/results/<name>.json and <name>.md,
the latest run of each (overwritten), both naming what the numbers came from: the commit
(and '+dirty' when tracked files differ from it), the date, the machine, the load before
the run, the library versions and the exact command. A table copied by hand cannot say any
of that; these files can be traced to a run.

    import report                      # perf/ is sys.path[0] when a script there runs

    started = report.start()           # first thing in main(): the load before the run
    ...
    report.write_results("ipc", data, report.table(columns, rows), started, out=args.out)

Secrets never reach the files: the value of any argument named like --api-key (in the
command, in the data, in the Markdown, also inside a quoted string of flags such as
--server-args "--api-key ...") is replaced by <redacted>.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "perf" / "results"
REDACTED = "<redacted>"
# the names of flags whose value is a secret: --api-key, --hf-token, --password, ...
_SECRET_FLAG = r"--?[\w-]*?(?:api[-_]?key|secret|password|passwd|(?:auth|access|hf)[-_]?token)"
_FLAG = re.compile(rf"{_SECRET_FLAG}", re.I)
_INLINE = re.compile(rf"(?<![\w-])({_SECRET_FLAG})(=|\s+)(\"[^\"]*\"|'[^']*'|[^\s\"'`|]+)", re.I)
META_KEYS = ("benchmark", "run")  # the JSON's own keys, beside the benchmark's data
DIRTY_IGNORED = "perf/results"  # earlier results written and not yet committed do not make a run dirty


@dataclass(frozen=True)
class Started:
    """What is known before the run: the load average, the time, the command."""

    loadavg: tuple[float, float, float]
    utc: datetime
    monotonic: float
    command: str


def start(argv: Sequence[str] | None = None) -> Started:
    """Call before measuring anything. `argv`: the script's arguments when main() was given
    them rather than reading sys.argv (the script itself is sys.argv[0])."""
    args = sys.argv[1:] if argv is None else list(argv)
    return Started(
        os.getloadavg(), datetime.now(timezone.utc), time.monotonic(), command_line([script_name(sys.argv[0]), *args])
    )


def write_results(
    name: str, data: dict, markdown: str, started: Started, *, out: Path | str | None = None
) -> tuple[Path, Path]:
    """Writes `data` (JSON-able, keys other than 'benchmark' and 'run') to <out> and the
    Markdown `markdown` (tables, headings, notes) under a header of the run's facts to the
    same path with .md; `out` defaults to perf/results/<name>.json. Returns both paths."""
    clash = set(META_KEYS) & data.keys()
    if clash:
        raise ValueError(f"{name}: the data may not have the keys {sorted(clash)} (the report's own)")
    json_path = Path(out) if out is not None else RESULTS / f"{name}.json"
    md_path = json_path.with_suffix(".md")
    meta = run_facts(started)
    body = {"benchmark": name, "run": meta, **redact_data(data)}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(body, indent=2, ensure_ascii=False) + "\n")
    md_path.write_text(header(name, meta) + "\n" + redact_text(markdown).strip() + "\n")
    return json_path, md_path


def add_out_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """The one --out flag of every benchmark: where the JSON goes, the Markdown beside it."""
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS / f"{name}.json",
        help=f"the JSON results, the .md beside it (default perf/results/{name}.json)",
    )


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table; cells are written with str() (format numbers before)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("-" if c is None else str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: Any, spec: str = ".1f") -> str:
    """A number for a table cell; '-' for None."""
    return "-" if value is None else format(value, spec)


# ---------------------------------------------------------------- the run's facts


def run_facts(started: Started) -> dict:
    commit, dirty_files = git_state()
    return {
        "commit": commit,
        "dirty_files": dirty_files,
        "date": started.utc.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "duration_s": round(time.monotonic() - started.monotonic, 1),
        "command": started.command,
        "machine": machine(),
        "load": {
            "loadavg_before": [round(x, 2) for x in started.loadavg],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
        },
        "versions": {"python": platform.python_version(), "torch": _version("torch"), "numpy": _version("numpy")},
    }


def git_state() -> tuple[str, list[str]]:
    """(short commit hash, with '+dirty' when tracked files outside perf/results/ differ from
    it; the paths that differ). 'unknown' outside a git checkout."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        status = git("status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){DIRTY_IGNORED}")
    except (OSError, subprocess.SubprocessError):
        return "unknown", []
    dirty = sorted(line[3:] for line in status.splitlines() if line.strip())
    return (f"{commit}+dirty" if dirty else commit), dirty


def machine() -> dict:
    return {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gib": memory_gib(),
        "arch": platform.machine(),
        "os": f"{platform.system()} {platform.release()}",
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "Hardware")) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _version(package: str) -> str | None:
    """The installed version, read from its metadata: importing torch for it would cost seconds."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def script_name(path: str) -> str:
    """The script as a path from the repository's root when it is inside it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def command_line(argv: Sequence[str]) -> str:
    """The command that reruns it, the interpreter written `python`, secrets redacted."""
    return shlex.join(["python", *redact_argv(argv)])


def header(name: str, meta: dict) -> str:
    m, load = meta["machine"], meta["load"]
    coretype = load["openblas_coretype"]
    v = meta["versions"]
    return "\n".join(
        [
            f"# {name}",
            "",
            f"- commit: `{meta['commit']}`"
            + (f" ({len(meta['dirty_files'])} tracked files changed)" if meta["dirty_files"] else ""),
            f"- date: {meta['date'].replace('T', ' ').rstrip('Z')} UTC, {meta['duration_s']:.0f} s",
            f"- machine: {m['cpu']}, {m['logical_cores']} logical cores ({m['usable_cores']} usable), "
            f"{m['memory_gib']} GiB",
            f"- load average before (1/5/15 min): {' / '.join(f'{x:.2f}' for x in load['loadavg_before'])}; "
            f"OPENBLAS_CORETYPE {'=' + coretype if coretype is not None else 'unset'}",
            f"- versions: Python {v['python']}, torch {v['torch']}, numpy {v['numpy']}",
            f"- command: `{meta['command']}`",
            "",
        ]
    )


# ---------------------------------------------------------------- secrets


def redact_argv(argv: Sequence[str]) -> list[str]:
    """`--api-key X` and `--api-key=X` become `--api-key <redacted>`, also inside one argument
    that holds several flags (--server-args "--api-key X")."""
    out, hide_next = [], False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif _FLAG.fullmatch(arg):
            out.append(arg)
            hide_next = True
        else:
            out.append(redact_text(arg))
    return out


def redact_text(text: str) -> str:
    return _INLINE.sub(lambda m: m[1] + m[2] + REDACTED, text)


def redact_data(value: Any) -> Any:
    """The data with every argv-like list of strings, and every string, redacted."""
    if isinstance(value, dict):
        return {k: redact_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, str) for v in value):
            return redact_argv(value)
        return [redact_data(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value
