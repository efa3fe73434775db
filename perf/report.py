"""Where every benchmark in perf/ writes its results: perf/results/<name>.json and <name>.md,
the latest run of each (overwritten), both naming what the numbers came from: the commit
(and '+dirty' when tracked files differ from it), the date, the machine, the load before
the run, the library versions and the exact command. A table copied by hand cannot say any
of that; these files can be traced to a run.

    from perf import report

    report.add_arguments(parser, "ipc")  # --out and --allow-dirty
    args = parser.parse_args()
    started = report.start(args)         # before measuring: the load, the commit
    ...
    report.write_results("ipc", data, report.table(columns, rows), started, out=args.out)

A commit names the code measured only when the tree is clean, so a run bound for
perf/results/ from a tree whose tracked files differ from HEAD is refused before it measures
anything, unless --allow-dirty is given; the results then say so. Elsewhere (--out) any tree
may write.

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
    """What is known before the run: the load average, the time, the command, the code."""

    loadavg: tuple[float, float, float]
    utc: datetime
    monotonic: float
    command: str
    commit: str
    dirty_files: tuple[str, ...]
    allow_dirty: bool


class DirtyTree(SystemExit):
    """A run bound for perf/results/ from a tree with uncommitted changes, without --allow-dirty."""


def start(args: argparse.Namespace, argv: Sequence[str] | None = None) -> Started:
    """Call once the flags (add_arguments) are parsed, before measuring anything; raises
    DirtyTree for a dirty tree's run bound for perf/results/ without --allow-dirty. `argv`: the
    script's arguments when main() was given them rather than reading sys.argv (the script
    itself is sys.argv[0])."""
    commit, dirty = git_state()
    if dirty and not args.allow_dirty and writes_into_results(args.out):
        shown = ", ".join(dirty[:5]) + (f" and {len(dirty) - 5} more" if len(dirty) > 5 else "")
        raise DirtyTree(
            f"refusing to write into perf/results/: {len(dirty)} tracked files differ from "
            f"{commit.removesuffix('+dirty')} ({shown}), so the commit would not name the code measured. "
            "Commit them (or run from a clean worktree), "
            "write elsewhere with --out, or pass --allow-dirty (the results then say so)."
        )
    rest = sys.argv[1:] if argv is None else list(argv)
    return Started(
        os.getloadavg(),
        datetime.now(timezone.utc),
        time.monotonic(),
        command_line([*script_argv(sys.argv[0]), *rest]),
        commit,
        tuple(dirty),
        args.allow_dirty,
    )


def writes_into_results(out: Path | str | None) -> bool:
    """Whether --out lands in perf/results/ (None: the default, which does)."""
    return out is None or Path(out).resolve().is_relative_to(RESULTS.resolve())


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


def add_arguments(parser: argparse.ArgumentParser, name: str | None) -> None:
    """The flags of every benchmark: --out, where the JSON goes (the Markdown beside it; name
    None: the default is left to the script, which writes more than one result), and
    --allow-dirty."""
    default = None if name is None else RESULTS / f"{name}.json"
    parser.add_argument(
        "--out",
        type=Path,
        default=default,
        help=f"the JSON results, the .md beside it (default perf/results/{name or '<result>'}.json)",
    )
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="write into perf/results/ even when tracked files differ from the commit (the results say so)",
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
    return {
        "commit": started.commit,
        "dirty_files": list(started.dirty_files),
        "allow_dirty": started.allow_dirty,
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


def script_argv(path: str) -> list[str]:
    """How the script is run again: `-m perf.<name>` for a benchmark here, else its path."""
    script = Path(path).resolve()
    if script.suffix == ".py" and script.parent == ROOT / "perf":
        return ["-m", f"perf.{script.stem}"]
    return [path]


def command_line(argv: Sequence[str]) -> str:
    """The command that reruns it, the interpreter written `python`, secrets redacted."""
    return shlex.join(["python", *redact_argv(argv)])


def header(name: str, meta: dict) -> str:
    m, load = meta["machine"], meta["load"]
    coretype = load["openblas_coretype"]
    v = meta["versions"]
    notes = [f"{len(meta['dirty_files'])} tracked files changed"] if meta["dirty_files"] else []
    if meta["allow_dirty"]:
        notes.append("written with --allow-dirty")
    return "\n".join(
        [
            f"# {name}",
            "",
            f"- commit: `{meta['commit']}`" + (f" ({'; '.join(notes)})" if notes else ""),
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
