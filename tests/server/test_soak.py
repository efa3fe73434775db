"""perf/soak.py for a minute and a bit: streams with disconnects and aborts on the null model
(`--workers 2`) while every fault of its rotation takes its turn once: kill -9 of the
scheduler and of the detokenizer, SIGSTOP of the scheduler and of an HTTP worker, hostile
names in /dev/shm during a heal, grammar bombs, slow bodies, a burst of disconnects. The
server heals each time, no request fails outside a fault's window, no finished stream lost a
token, the memory of its long-lived processes stays flat, and nothing is left behind after it
stops."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from perf.soak import FAULTS

ROOT = Path(__file__).resolve().parents[2]


def test_a_minute_of_load_through_every_fault(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "perf.soak", "--duration", "75", "--streams", "8", "--calm", "1.5", "--whole-rotation"]
    proc = subprocess.run([*cmd, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    faults = result["faults"]
    assert [f["kind"] for f in faults[: len(FAULTS)]] == list(FAULTS), faults
    assert result["all_recovered"], faults
    assert result["lost_outside_windows"] == 0, result["failures_by_window"]
    assert result["healthy_at_end"]
    assert result["tokens_lost"] == 0
    assert result["outcomes"].get("served", 0) > 100, result["outcomes"]
    for f in faults:
        if f["kind"] == "hostile-shm":
            assert f["names"] == 6 and f["touched"] == [], f
        if f["kind"] in ("grammar-bomb", "slow-body", "disconnect"):
            assert f["failed"] == {}, f  # these reach no process: nobody else's request may fail
        if f["kind"] == "worker-stop":
            assert f["successor_warmed"], f
    # Once warm (a quarter in: allocator arenas grown, xgrammar imported by every worker), the
    # HTTP workers and granian's main process stay flat. The workers grew ~66 MB a minute of
    # kills here while they raised one kept 503 instance for every refused request (each raise
    # kept the request's frames alive: runtime/http_worker/core.py, APIError.fresh); without it,
    # the two workers' sum moves by a few MB (a replaced worker's successor starts smaller
    # and grows back). The engine's processes are new after each kill.
    for role, bound_mb in (("http worker", 24), ("granian main", 8)):
        assert result["rss_kb_end"][role] < result["rss_kb_warm"][role] + bound_mb * 1024, (role, result)
    left = result["leftovers"]
    assert not (left["processes"] or left["shm_segments"] or left["engine_files"]), left
    assert proc.returncode == 0, proc.stdout[-3000:]
