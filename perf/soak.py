"""Soak: a real server under N concurrent streams for a given time, with mixed lengths,
clients that leave mid-stream, /abort_request calls, and kill -9 of an engine process
(the scheduler and the detokenizer in turn) every few minutes. The engine is expected to
heal itself: in-flight requests fail at once, /health is 503 while a new engine starts,
and requests succeed again without restarting the server.

Reports: requests served, failures by kind, tokens lost (a finished stream's usage
completion_tokens against the tokens it streamed, counted from its logprobs), the RSS of
each process at the start, once warm (a quarter of the way in: the allocator's arenas and
lazy imports have grown by then) and at the end (by role: a restarted engine's processes
are new); a leak shows as growth from warm to end,
and each kill's recovery time (from the kill to the first request that succeeds again).

    python -m perf.soak --duration 1800 --streams 32 --kill-every 300        # 30 minutes
    python -m perf.soak --duration 60 --streams 8 --kill-every 20            # CI's minute
    python -m perf.soak --server-args "--workers 2"
Writes perf/results/soak.json and soak.md (perf/report.py), the server's log beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

from perf import report
from perf import serving_bench as sb

ENGINE_ROLES = ("ringserve::scheduler", "ringserve::detokenizer")
RECOVERY_TIMEOUT_S = 120.0  # a kill not recovered from by then is reported as such
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def rss_by_role(server: sb.Server) -> dict[str, int]:
    """Resident set (kB) of each live process of the server's tree, summed by role."""
    out: Counter[str] = Counter()
    for pid in sb.descendants(server.proc.pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        out[sb.role_of(sb.proc_title(pid), pid, server.proc.pid)] += rss
    return dict(out)


def engine_pid(server: sb.Server, role: str) -> int | None:
    for pid in sb.descendants(server.proc.pid):
        if sb.proc_title(pid).startswith(role):
            return pid
    return None


class Soak:
    def __init__(self, server: sb.Server, model: str, args: argparse.Namespace) -> None:
        self.server, self.model, self.args = server, model, args
        self.base = f"http://127.0.0.1:{server.port}"
        self.rng = random.Random(args.seed)
        self.counts: Counter[str] = Counter()  # outcomes by kind
        self.tokens_streamed = 0
        self.tokens_lost = 0  # finished streams whose usage differs from what they streamed
        self.rss_warm: dict[str, int] = {}  # rss_by_role a quarter of the way in
        self.kills: list[dict] = []
        self.pending_recovery: list[dict] = []  # kills awaiting their first success after
        self.deadline = 0.0

    def body(self) -> dict:
        words = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(4, 200)))
        return {
            "model": self.model,
            "prompt": words,
            "max_tokens": self.rng.choice((1, 8, 32, 64, 128, 256)),
            "ignore_eos": True,
            "temperature": 0.0,
            "logprobs": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def one(self, client: httpx.AsyncClient) -> None:
        leave_after = self.rng.randint(1, 20) if self.rng.random() < self.args.disconnect_rate else None
        abort = self.rng.random() < self.args.abort_rate
        started = time.monotonic()
        streamed, usage, events, request_id, finish = 0, None, 0, None, None
        try:
            async with client.stream("POST", "/v1/completions", json=self.body()) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    self.counts[f"http {resp.status_code}"] += 1
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        self.counts["error event"] += 1
                        return
                    request_id = chunk.get("id", request_id)
                    for choice in chunk.get("choices", ()):
                        streamed += len((choice.get("logprobs") or {}).get("tokens") or ())
                        finish = choice.get("finish_reason") or finish
                    usage = chunk.get("usage") or usage
                    events += 1
                    if abort and events == 2 and request_id:
                        await client.post("/abort_request", json={"rid": request_id})
                    if leave_after is not None and events >= leave_after:
                        self.counts["left mid-stream"] += 1
                        self.tokens_streamed += streamed
                        return
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            self.counts[f"client error {type(e).__name__}"] += 1
            return
        self.tokens_streamed += streamed
        if usage is None:
            self.counts["no usage"] += 1
            return
        self.counts["aborted" if finish == "abort" else "served"] += 1
        self.tokens_lost += abs(usage["completion_tokens"] - streamed)
        for kill in self.pending_recovery:
            if started > kill["at"]:
                kill["recovered_s"] = time.monotonic() - kill["at_wall"]
        self.pending_recovery = [k for k in self.pending_recovery if "recovered_s" not in k]

    async def stream_loop(self, client: httpx.AsyncClient) -> None:
        while time.monotonic() < self.deadline:
            await self.one(client)

    async def killer(self) -> None:
        turn = 0
        while True:
            await asyncio.sleep(self.args.kill_every)
            if time.monotonic() >= self.deadline - 1:
                return
            role = ENGINE_ROLES[turn % len(ENGINE_ROLES)]
            turn += 1
            pid = engine_pid(self.server, role)
            if pid is None:
                self.kills.append({"role": role, "pid": None, "note": "no such process running"})
                continue
            os.kill(pid, signal.SIGKILL)
            now = time.monotonic()
            kill = {"role": role, "pid": pid, "at": now, "at_wall": now}
            self.kills.append(kill)
            self.pending_recovery.append(kill)
            print(f"[soak] kill -9 {role} (pid {pid}) at {now - self.started:.0f} s", flush=True)

    async def run(self) -> None:
        self.started = time.monotonic()
        self.deadline = self.started + self.args.duration
        limits = httpx.Limits(max_connections=self.args.streams + 8)
        timeout = httpx.Timeout(self.args.request_timeout)
        async with httpx.AsyncClient(base_url=self.base, limits=limits, timeout=timeout) as client:
            killer = asyncio.create_task(self.killer()) if self.args.kill_every > 0 else None
            warm = asyncio.create_task(self.read_warm_rss())
            await asyncio.gather(*(self.stream_loop(client) for _ in range(self.args.streams)))
            for task in (killer, warm):
                if task is not None:
                    task.cancel()

    async def read_warm_rss(self) -> None:
        await asyncio.sleep(self.args.duration / 4)
        self.rss_warm = rss_by_role(self.server)
        for kill in self.pending_recovery:
            kill["recovered_s"] = None  # not recovered before the end


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    ap.add_argument("--streams", type=int, default=32, help="concurrent streams")
    ap.add_argument("--kill-every", type=float, default=300.0, help="seconds between kills (0: none)")
    ap.add_argument("--disconnect-rate", type=float, default=0.1, help="share of clients that leave mid-stream")
    ap.add_argument("--abort-rate", type=float, default=0.05, help="share of requests aborted by /abort_request")
    ap.add_argument("--model", choices=("null", "real"), default="null")
    ap.add_argument("--server-args", default="", help="more `runtime serve` flags")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    report.add_arguments(ap, "soak")
    args = ap.parse_args(argv)
    started = report.start(args, argv)

    extra = [*(["--null-model"] if args.model == "null" else []), *shlex.split(args.server_args)]
    log = args.out.with_name("soak_server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    server = sb.Server(extra, log)
    try:
        startup_s = server.wait_healthy()
        soak = Soak(server, server.model_name(), args)
        rss_start = rss_by_role(server)
        asyncio.run(soak.run())
        time.sleep(1.0)  # the last aborts reach the scheduler
        rss_end = rss_by_role(server)
        healthy_at_end = server.get("/health")[0] == 200
    finally:
        leftovers = server.stop()

    kills = [{k: v for k, v in kill.items() if k not in ("at", "at_wall")} for kill in soak.kills]
    recoveries = [k["recovered_s"] for k in kills if k.get("pid")]
    data = {
        "duration_s": args.duration,
        "streams": args.streams,
        "model": args.model,
        "server_args": extra,
        "startup_s": startup_s,
        "outcomes": dict(soak.counts),
        "tokens_streamed": soak.tokens_streamed,
        "tokens_lost": soak.tokens_lost,
        "rss_kb_start": rss_start,
        "rss_kb_warm": soak.rss_warm,
        "rss_kb_end": rss_end,
        "kills": kills,
        "all_recovered": all(r is not None for r in recoveries),
        "healthy_at_end": healthy_at_end,
        "leftovers": leftovers,
    }
    md = "\n\n".join(
        [
            f"{args.streams} streams for {args.duration:.0f} s, {args.model} model, "
            + (f"kill -9 of an engine process every {args.kill_every:.0f} s" if args.kill_every > 0 else "no kills")
            + f"; tokens streamed {soak.tokens_streamed}, lost {soak.tokens_lost}; "
            f"healthy at the end: {healthy_at_end}.",
            report.table(("outcome", "requests"), sorted(soak.counts.items())),
            report.table(
                ("process", "RSS start (MiB)", "RSS warm (MiB)", "RSS end (MiB)"),
                [
                    (role, *(report.fmt(rss.get(role, 0) / 1024) for rss in (rss_start, soak.rss_warm, rss_end)))
                    for role in sorted(set(rss_start) | set(rss_end))
                ],
            ),
            report.table(
                ("kill", "pid", "recovered in (s)"),
                [(k["role"], k.get("pid"), report.fmt(k.get("recovered_s"))) for k in kills] or [("none", "-", "-")],
            ),
        ]
    )
    print(md)
    report.write_results("soak", data, md, started, out=args.out)
    return 0 if healthy_at_end and data["all_recovered"] and soak.tokens_lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
