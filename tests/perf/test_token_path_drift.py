"""The perf tier (`scripts/test.sh --perf`; not in CI, whose machines are shared): the token
path's cost must not drift. The README's headline comes from perf/results/token_path.json
(perf/headline.py); here the code of the commit that result names (the last release of the
number) and this checkout serve the null model side by side through perf/serving_ab.py,
interleaved, and this checkout may cost at most DRIFT_LIMIT times the released one's server CPU
per streamed token (the median of the rounds' ratios). Where the code measured is not the
code here any more, the headline is stale: rerun perf/token_path.py and perf/headline.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from perf.headline import RESULT, STREAMS
from perf.report import ROOT

# a change that costs more than this per token fails; the rounds' own spread on this VM is
# ~5% (perf/results/serving_ab.md), so a smaller limit would fail on noise
DRIFT_LIMIT = 1.10
CODE = ("runtime", "ipc", "protocol", "httpapi", "gpu", "structured", "cbuild.py")


def released_commit() -> str:
    return json.loads(RESULT.read_text())["run"]["commit"]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def test_the_headline_was_measured_on_the_code_here():
    changed = git("diff", "--name-only", released_commit(), "--", *CODE).split()
    assert not changed, (
        f"the server's code changed since {RESULT.name} was measured ({len(changed)} files, e.g. {changed[:3]}): "
        "rerun `python -m perf.token_path` on a clean tree, then `python -m perf.headline --write`"
    )


def test_the_token_path_costs_no_more_than_the_released_one(tmp_path: Path):
    base = tmp_path / "released"
    git("worktree", "add", "--detach", str(base), released_commit())
    try:
        out = tmp_path / "serving_ab.json"
        cmd = [
            sys.executable,
            "-m",
            "perf.serving_ab",
            "--a",
            str(base),
            "--b",
            str(ROOT),
            "--concurrency",
            str(STREAMS),
            "--requests",
            "4096",
            "--rounds",
            "6",
            "--out",
            str(out),
        ]
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=1200)
        ratio = json.loads(out.read_text())["median_ratio"]["server_cpu_us_per_token"]
    finally:
        git("worktree", "remove", "--force", str(base))
    assert ratio <= DRIFT_LIMIT, f"server CPU per token is {ratio:.3f}x the released code's (limit {DRIFT_LIMIT})"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
