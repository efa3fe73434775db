"""cbuild.build: one compile of a source however many threads and processes ask for it at once."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from cbuild import BuildError, build


def counting_compiler(tmp_path: Path) -> Path:
    """A compiler that logs each run and takes a while (so that the callers overlap), then runs cc."""
    log = tmp_path / "runs.log"
    cc = tmp_path / "cc-counting"
    cc.write_text(f'#!/bin/sh\necho run >> {log}\nsleep 0.5\nexec cc "$@"\n')
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    return cc


def test_concurrent_builds_compile_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "one.c"
    source.write_text("int one(void) { return 1; }\n")
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(counting_compiler(tmp_path)))
    paths: list[Path] = []
    threads = [
        threading.Thread(target=lambda: paths.append(build("one", [source], ("-shared", "-fPIC")))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(paths)) == 1 and paths[0].is_file()
    assert (tmp_path / "runs.log").read_text().split() == ["run"]
    assert build("one", [source], ("-shared", "-fPIC")) == paths[0]  # found: no compile
    assert (tmp_path / "runs.log").read_text().split() == ["run"]
    assert [p.name for p in paths[0].parent.iterdir() if not p.name.endswith((".so", ".lock"))] == []


def test_a_failed_build_leaves_nothing_and_the_next_caller_tries_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "bad.c"
    source.write_text("this is not C\n")
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(counting_compiler(tmp_path)))
    for _ in range(2):
        with pytest.raises(BuildError, match="building bad.c failed"):
            build("bad", [source], ("-shared", "-fPIC"))
    assert (tmp_path / "runs.log").read_text().split() == ["run", "run"]
    left = os.listdir(tmp_path / "cache" / "ringserve" / "kernels")
    assert len(left) == 1 and left[0].endswith(".lock")  # no library, no temporary file
