"""Smoke run of perf/serving_bench.py: its quickest mode against a real server with the null
model (a few requests at concurrency 1 and 4), and the JSON it writes has every field, a
complete request count, no failure and nothing left behind by the server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LEVEL_FIELDS = {
    "concurrency",
    "num_requests",
    "completed",
    "failed",
    "failures",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "output_tokens",
    "prompt_tokens_mean",
    "tokens_per_event",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
    "server_cpu_s",
    "server_cpu_by_process_s",
    "server_cpu_us_per_token",
    "client_cpu_s",
    "client_cpu_us_per_token",
    "engine_steps",
    "tokens_per_step",
    "loadavg_before",
    "loadavg_after",
}
RESULT_FIELDS = {
    "benchmark",
    "command",
    "host",
    "cpus",
    "python",
    "client_loop",
    "loadavg_start",
    "loadavg_end",
    "thread_env",
    "workload",
    "complete",
    "targets",
    "runs",
}
OUTPUT_TOKENS = 16
REQUESTS = 6


def test_quick_null_model_run_writes_every_field(tmp_path):
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "perf.serving_bench",
            "--quick",
            "--models",
            "null",
            "--transports",
            "ring",
            "--concurrency",
            "1,4",
            "--num-requests",
            str(REQUESTS),
            "--warmup",
            "1",
            "--output-tokens",
            str(OUTPUT_TOKENS),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert RESULT_FIELDS <= result.keys() and result["complete"]
    assert result["workload"]["output_tokens"] == OUTPUT_TOKENS
    assert 105 <= result["workload"]["prompt_tokens_mean"] <= 115
    (run,) = result["runs"]
    assert (run["model"], run["transport"]) == ("null", "ring")
    left = run["leftovers"]
    assert (left["exit_status"], left["stopped_by_sigint"]) == (0, True)
    assert left["processes"] == left["shm_segments"] == left["engine_files"] == []
    assert [lv["concurrency"] for lv in run["levels"]] == [1, 4]
    for level in run["levels"]:
        assert LEVEL_FIELDS <= level.keys()
        assert (level["completed"], level["failed"]) == (REQUESTS, 0), level["failures"]
        assert level["output_tokens"] == REQUESTS * OUTPUT_TOKENS
        assert level["prompt_tokens_mean"] == result["workload"]["prompt_tokens_mean"]
        for latency in ("ttft_ms", "tpot_ms", "e2e_ms"):  # all tokens of one event: TPOT 0
            assert 0 <= level[latency]["p50"] <= level[latency]["p99"], latency
        if level["tokens_per_event"] == OUTPUT_TOKENS:  # the null model can finish before the first event is sent
            assert level["itl_ms"]["p50"] is None
        else:
            assert 0 <= level["itl_ms"]["p50"] <= level["itl_ms"]["p99"]
        assert 0 < level["ttft_ms"]["p50"] <= level["e2e_ms"]["p50"]
        assert level["output_throughput"] > 0 and level["tokens_per_event"] >= 1
        assert level["engine_steps"] >= OUTPUT_TOKENS and 1 <= level["tokens_per_step"] <= 4
        assert {"granian main", "http worker", "ringserve::scheduler", "ringserve::detokenizer"} == level[
            "server_cpu_by_process_s"
        ].keys()
    assert "--null-model" in run["server_args"]
    assert result["targets"] == {}  # none applies at concurrency 1 and 4
    assert "server CPU µs/tok" in proc.stdout


def test_ab_run_alternates_two_servers_and_reports_ratios(tmp_path):
    """perf/serving_ab.py: two servers up at once (one tree, two settings), rounds in turn,
    each side's levels complete, the ratios computed, nothing left behind."""
    out = tmp_path / "ab.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "perf.serving_ab",
            "--rounds",
            "2",
            "--requests",
            "16",
            "--concurrency",
            "4",
            "--output-tokens",
            str(OUTPUT_TOKENS),
            "--warmup",
            "1",
            "--b-args",
            "--stream-interval 2",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert [r["round"] for r in result["rounds"]] == [0, 1]
    for r in result["rounds"]:
        for side in ("a", "b"):
            assert (r[side]["completed"], r[side]["failed"]) == (16, 0), r[side]["failures"]
            # CPU is read in clock ticks (10 ms): one short round of the null model may take none
            assert r[side]["output_tokens"] == 16 * OUTPUT_TOKENS and r[side]["server_cpu_us_per_token"] >= 0
    assert result["sides"]["b"]["server_args"][-2:] == ["--stream-interval", "2"]
    assert result["median_ratio"]["server_cpu_us_per_token"] > 0 and 0 <= result["lower_in"] <= 2
    for left in result["leftovers"].values():
        assert left["stopped_by_sigint"] and left["processes"] == left["shm_segments"] == left["engine_files"] == []
