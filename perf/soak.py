"""Chaos soak: a real server under N concurrent streams for a given time (mixed lengths,
clients that leave mid-stream, /abort_request calls) while faults take turns, one at a time,
with calm between them (`--calm` s, then the next fault of `--faults`, in rotation):

    scheduler-kill     kill -9 of the scheduler: in-flight requests fail at once, /health is 503
    detokenizer-kill   while a new engine starts, then requests succeed again, same server
    scheduler-stop     SIGSTOP of the scheduler: the workers see its heartbeat stop
                       (--watchdog-timeout), kill it and start a new engine
    worker-stop        SIGSTOP of one HTTP worker (of --workers 2): killed after
                       --worker-stall-timeout, granian starts another
    hostile-shm        a directory, a symlink and a fifo appear in /dev/shm under names shaped
                       like ringserve's (a huge pid, and a dead one), then kill -9 of the scheduler:
                       the heal's sweep must skip them and leave them as they are
    grammar-bomb       guided_regex `(a{0,700}){0,700}b` x --bombs at once (each ends with a 400
                       or its length; the token path must keep serving the others)
    slow-body          --slow-clients requests whose bodies trickle in over --slow-body-s
    disconnect         a burst of streams that leave after their first event, and connections
                       that send half a request and close

A fault's window runs from its start to its recovery (a probe request on a new connection
served after the fault's process is replaced, or the fault's own requests answered) plus
WINDOW_SLACK_S. Every load request that failed (an HTTP error, an error event, a transport
error, a stream without usage) is charged to the window it overlapped, else to "outside":
outside must be 0.

Reports: requests by outcome, failures by window, tokens lost (a finished stream's usage
completion_tokens against the tokens it streamed, counted from its logprobs), each fault's
recovery time and the RSS change of the HTTP workers and granian's main process across it,
and the RSS of each process at the start, once warm (a quarter of the way in: the
allocator's arenas and lazy imports have grown by then) and at the end, by role (the
engine's processes and a replaced worker are new).

    python -m perf.soak --duration 1800                              # 30 minutes, every fault
    python -m perf.soak --duration 60 --streams 8 --calm 2 --whole-rotation   # about CI's minute
    python -m perf.soak --faults scheduler-kill,detokenizer-kill     # the engine kills only
Writes perf/results/soak.json and soak.md (perf/report.py), the server's log beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import shlex
import signal
import socket
import stat
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import orjson

from perf import report
from perf import serving_bench as sb
from runtime.supervise.files import process_start_time

ENGINE_ROLES = ("ringserve::scheduler", "ringserve::detokenizer")
FAULTS = (
    "scheduler-kill",
    "detokenizer-kill",
    "scheduler-stop",
    "worker-stop",
    "hostile-shm",
    "grammar-bomb",
    "slow-body",
    "disconnect",
)
RECOVERY_TIMEOUT_S = 120.0  # a fault not recovered from by then is reported as such
WINDOW_SLACK_S = 2.0  # a request that failed this soon after a recovery was sent before it
WORKERS = 2  # worker-stop stops one: the other serves meanwhile
STALL_TIMEOUT_S = 5  # the server's --watchdog-timeout and --worker-stall-timeout: stops are found this fast
GRAMMAR_BOMB = "(a{0,700}){0,700}b"
HUGE_PID = "9" * 20  # no process has it; it does not fit the kernel's pid nor an int64
SHM_DIR = Path("/dev/shm")
NOT_FAILURES = ("served", "aborted", "left mid-stream")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def server_pids(server: sb.Server) -> dict[int, str]:
    """Each live process of the server by role: granian's tree, and the engine named in the
    server's files (its processes run in sessions of their own: a replaced worker's engine is
    no longer in granian's tree)."""
    from runtime.supervise.files import ServerFiles

    pids = {pid: sb.role_of(sb.proc_title(pid), pid, server.proc.pid) for pid in sb.descendants(server.proc.pid)}
    try:
        for proc in json.loads(ServerFiles.of(server.proc.pid).info.read_text()):
            role = "ringserve::" + proc["role"]  # its process title's
            if sb.proc_title(proc["pid"]).startswith(role):
                pids[proc["pid"]] = role
    except (FileNotFoundError, ValueError):
        pass  # between engines
    return pids


def rss_by_role(server: sb.Server) -> dict[str, int]:
    """Resident set (kB) of each live process of the server, summed by role."""
    out: Counter[str] = Counter()
    for pid, role in server_pids(server).items():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[role] += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return dict(out)


def pid_of(server: sb.Server, role: str) -> int | None:
    return next((pid for pid, r in server_pids(server).items() if r == role), None)


def running(pid: int) -> bool:
    """Neither gone nor a zombie."""
    return process_start_time(pid) is not None


class HostileNames:
    """Names any local user may put in /dev/shm, shaped like ringserve's segments
    (`ringserve.<pid>.<16 hex>`): a directory, a symlink and a fifo, each with a pid no
    process can have and with a dead pid in range (which the sweep treats as an orphan's).
    Every name is new (mkdir, symlink and mkfifo fail on an existing one): only these are
    removed afterwards."""

    def __init__(self) -> None:
        self.made: dict[str, tuple[Path, int]] = {}  # shape -> (path, file type)
        self.outside = Path(tempfile.mkdtemp(prefix="ringserve-soak-"))
        self.target = self.outside / "target"
        self.target.write_text("not to be touched")
        dead = dead_pid()
        for pid in (HUGE_PID, str(dead)):
            make = {
                "directory": lambda p: p.mkdir(),
                "symlink": lambda p: p.symlink_to(self.target),
                "fifo": lambda p: os.mkfifo(p, 0o600),
            }
            for shape, create in make.items():
                path = SHM_DIR / f"ringserve.{pid}.{secrets.token_hex(8)}"
                create(path)
                self.made[f"{shape}, pid {'huge' if pid == HUGE_PID else 'dead'}"] = (
                    path,
                    stat.S_IFMT(path.lstat().st_mode),
                )

    def untouched(self) -> list[str]:
        """The shapes that are gone or changed (none, if nothing touched them)."""
        bad = []
        for shape, (path, kind) in self.made.items():
            try:
                if stat.S_IFMT(path.lstat().st_mode) != kind:
                    bad.append(shape)
            except FileNotFoundError:
                bad.append(shape)
        if self.target.read_text() != "not to be touched":
            bad.append("symlink target")
        return bad

    def remove(self) -> None:
        for path, kind in self.made.values():
            try:
                path.rmdir() if kind == stat.S_IFDIR else path.unlink()
            except FileNotFoundError:
                pass
        self.target.unlink(missing_ok=True)
        self.outside.rmdir()


def dead_pid() -> int:
    """A pid within the kernel's limit that no process has now."""
    pid = 4_000_000
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


class Soak:
    def __init__(self, server: sb.Server, model: str, args: argparse.Namespace) -> None:
        self.server, self.model, self.args = server, model, args
        self.base = f"http://127.0.0.1:{server.port}"
        self.rng = random.Random(args.seed)
        self.requests: list[tuple[str, float, float]] = []  # (outcome, start, end) of each load request
        self.tokens_streamed = 0
        self.tokens_lost = 0  # finished streams whose usage differs from what they streamed
        self.rss_warm: dict[str, int] = {}  # rss_by_role a quarter of the way in
        self.faults: list[dict] = []
        self.examples: dict[str, str] = {}  # a failure's first answer, by outcome
        self.started = self.deadline = self.ended = 0.0

    # ---------------------------------------------------------------- the load

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

    async def one(self, client: httpx.AsyncClient) -> str:
        leave_after = self.rng.randint(1, 20) if self.rng.random() < self.args.disconnect_rate else None
        abort = self.rng.random() < self.args.abort_rate
        streamed, usage, events, request_id, finish = 0, None, 0, None, None
        try:
            async with client.stream("POST", "/v1/completions", json=self.body()) as resp:
                if resp.status_code != 200:
                    self.examples.setdefault(f"http {resp.status_code}", (await resp.aread()).decode()[:300])
                    return f"http {resp.status_code}"
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        self.examples.setdefault("error event", data[:300])
                        return "error event"
                    request_id = chunk.get("id", request_id)
                    for choice in chunk.get("choices", ()):
                        streamed += len((choice.get("logprobs") or {}).get("tokens") or ())
                        finish = choice.get("finish_reason") or finish
                    usage = chunk.get("usage") or usage
                    events += 1
                    if abort and events == 2 and request_id:
                        await client.post("/abort_request", json={"rid": request_id})
                    if leave_after is not None and events >= leave_after:
                        self.tokens_streamed += streamed
                        return "left mid-stream"
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            return f"client error {type(e).__name__}"
        self.tokens_streamed += streamed
        if usage is None:
            return "no usage"
        self.tokens_lost += abs(usage["completion_tokens"] - streamed)
        return "aborted" if finish == "abort" else "served"

    async def stream_loop(self, client: httpx.AsyncClient) -> None:
        while time.monotonic() < self.deadline:
            start = time.monotonic()
            outcome = await self.one(client)
            self.requests.append((outcome, start, time.monotonic()))
            if outcome not in NOT_FAILURES:
                await asyncio.sleep(0.1)  # as a client backs off a 503: no busy loop of refusals

    # ---------------------------------------------------------------- the faults

    async def probe(self) -> bool:
        """A short completion on a new connection (a frozen worker's keep-alive one would wait)."""
        body = {"model": self.model, "prompt": "probe", "max_tokens": 2, "temperature": 0}
        try:
            async with httpx.AsyncClient(base_url=self.base, timeout=10) as c:
                return (await c.post("/v1/completions", json=body)).status_code == 200
        except httpx.HTTPError:
            return False

    async def warm_workers(self, workers: int) -> bool:
        """A constrained request answered by each of `workers` HTTP workers (new connections
        until each index answered): a worker imports xgrammar, and with it torch (~200 MB), at
        its first grammar, a cost once per worker process that would otherwise show as growth
        wherever the first grammar bomb fell."""
        body = {"model": self.model, "prompt": "a", "max_tokens": 1, "guided_regex": "a"}
        seen: set[str] = set()
        for _ in range(64 * workers):
            try:
                async with httpx.AsyncClient(base_url=self.base, timeout=60) as c:
                    resp = await c.post("/v1/completions", json=body)
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                seen.add(resp.headers.get("x-ringserve-worker", ""))
            if len(seen) >= workers:
                return True
        return False

    async def until(self, condition: Callable[[], Awaitable[bool]]) -> float | None:
        """Seconds until `condition` holds (polled), None past RECOVERY_TIMEOUT_S."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < RECOVERY_TIMEOUT_S:
            if await condition():
                return time.monotonic() - t0
            await asyncio.sleep(0.2)
        return None

    async def engine_replaced(self, old: dict[str, int | None]) -> bool:
        pids = {role: pid_of(self.server, role) for role in ENGINE_ROLES}
        return all(pids[r] not in (None, old[r]) for r in ENGINE_ROLES) and await self.probe()

    def engine_pids(self) -> dict[str, int | None]:
        return {role: pid_of(self.server, role) for role in ENGINE_ROLES}

    async def engine_signal(self, role: str, sig: signal.Signals, fault: dict) -> float | None:
        old = self.engine_pids()
        pid = old[role]
        if pid is None:
            fault["note"] = f"no {role} running"
            return None
        os.kill(pid, sig)
        fault["pid"] = pid
        try:
            return await self.until(lambda: self.engine_replaced(old))
        finally:
            if running(pid):
                os.kill(pid, signal.SIGCONT)  # never leave a stopped process behind (the heal failed)

    async def fault_scheduler_kill(self, fault: dict) -> float | None:
        return await self.engine_signal("ringserve::scheduler", signal.SIGKILL, fault)

    async def fault_detokenizer_kill(self, fault: dict) -> float | None:
        return await self.engine_signal("ringserve::detokenizer", signal.SIGKILL, fault)

    async def fault_scheduler_stop(self, fault: dict) -> float | None:
        return await self.engine_signal("ringserve::scheduler", signal.SIGSTOP, fault)

    async def fault_worker_stop(self, fault: dict) -> float | None:
        workers = sorted(p for p, r in server_pids(self.server).items() if r == "http worker")
        if len(workers) < 2:
            fault["note"] = "needs --workers 2 or more"
            return None
        victim = self.rng.choice(workers)
        os.kill(victim, signal.SIGSTOP)
        fault["pid"] = victim

        async def replaced() -> bool:
            now = [p for p, r in server_pids(self.server).items() if r == "http worker" and running(p)]
            return not running(victim) and len(now) == len(workers) and await self.probe()

        try:
            recovered = await self.until(replaced)
        finally:
            if running(victim):
                os.kill(victim, signal.SIGCONT)
        fault["successor_warmed"] = recovered is not None and await self.warm_workers(len(workers))
        return recovered

    async def fault_hostile_shm(self, fault: dict) -> float | None:
        names = HostileNames()
        try:
            fault["names"] = len(names.made)
            recovered = await self.engine_signal("ringserve::scheduler", signal.SIGKILL, fault)
            fault["touched"] = names.untouched()
            return recovered
        finally:
            names.remove()

    async def fault_grammar_bomb(self, fault: dict) -> float | None:
        body = {"model": self.model, "prompt": "Say a:", "max_tokens": 32, "guided_regex": GRAMMAR_BOMB}
        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=self.base, timeout=RECOVERY_TIMEOUT_S) as c:

            async def bomb() -> str:
                try:
                    return str((await c.post("/v1/completions", json=body)).status_code)
                except httpx.HTTPError as e:
                    return type(e).__name__

            fault["answers"] = dict(Counter(await asyncio.gather(*(bomb() for _ in range(self.args.bombs)))))
        return time.monotonic() - t0 if set(fault["answers"]) <= {"200", "400"} else None

    async def fault_slow_body(self, fault: dict) -> float | None:
        body = orjson.dumps({"model": self.model, "prompt": "slow " * 40, "max_tokens": 8})
        pieces = 8

        async def trickle():
            for i in range(pieces):
                yield body[i * len(body) // pieces : (i + 1) * len(body) // pieces]
                await asyncio.sleep(self.args.slow_body_s / pieces)

        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=self.base, timeout=RECOVERY_TIMEOUT_S) as c:

            async def slow() -> str:
                headers = {"content-type": "application/json"}
                try:
                    return str((await c.post("/v1/completions", content=trickle(), headers=headers)).status_code)
                except httpx.HTTPError as e:
                    return type(e).__name__

            fault["answers"] = dict(Counter(await asyncio.gather(*(slow() for _ in range(self.args.slow_clients)))))
        return time.monotonic() - t0 if set(fault["answers"]) == {"200"} else None

    async def fault_disconnect(self, fault: dict) -> float | None:
        t0 = time.monotonic()
        body = {**self.body(), "max_tokens": 512}

        async def leave_at_first_event() -> None:
            try:
                async with httpx.AsyncClient(base_url=self.base, timeout=30) as c:
                    async with c.stream("POST", "/v1/completions", json=body) as resp:
                        async for _ in resp.aiter_lines():
                            return
            except httpx.HTTPError:
                pass

        async def half_a_request() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.server.port, family=socket.AF_INET)
            head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            writer.write(head + b"content-length: 4000\r\n\r\n" + orjson.dumps(body)[:100])
            await writer.drain()
            writer.close()

        n = self.args.disconnects
        await asyncio.gather(*(leave_at_first_event() for _ in range(n)), *(half_a_request() for _ in range(n // 4)))
        fault["clients"] = n + n // 4
        ok = await self.until(self.probe)
        return None if ok is None else time.monotonic() - t0

    async def fault_loop(self) -> None:
        try:
            await self._faults()
        finally:  # the load's end is finite again, whatever ended the rotation
            if self.deadline == math.inf:
                self.deadline = max(self.started + self.args.duration, time.monotonic())

    async def _faults(self) -> None:
        kinds = self.args.faults
        turn = 0
        while True:
            await asyncio.sleep(self.args.calm)
            if time.monotonic() >= self.deadline - self.args.calm:
                return
            kind = kinds[turn % len(kinds)]
            turn += 1
            if self.args.whole_rotation and turn == len(kinds):  # the last fault of the rotation
                self.deadline = max(self.started + self.args.duration, time.monotonic() + 2 * self.args.calm)
            rss_before = rss_by_role(self.server)
            at = time.monotonic()
            fault: dict = {"kind": kind, "at_s": at - self.started}
            self.faults.append(fault)
            print(f"[soak] {kind} at {fault['at_s']:.0f} s", flush=True)
            action = getattr(self, "fault_" + kind.replace("-", "_"))
            fault["recovered_s"] = await action(fault)
            fault["end_s"] = time.monotonic() - self.started
            rss_after = rss_by_role(self.server)
            fault["rss_kb_delta"] = {
                role: rss_after.get(role, 0) - rss_before.get(role, 0) for role in ("http worker", "granian main")
            }
            print(f"[soak] {kind}: recovered in {fault['recovered_s']} s", flush=True)
            if fault["recovered_s"] is None:
                return  # the server did not heal: the rest of the run would only measure that

    # ---------------------------------------------------------------- the run

    async def run(self) -> None:
        self.started = time.monotonic()
        # --whole-rotation: the load goes on past --duration until the rotation's last fault
        # has begun (on a loaded machine heals take longer and fewer faults fit the duration)
        whole = self.args.whole_rotation and len(self.args.faults) > 0
        self.deadline = math.inf if whole else self.started + self.args.duration
        limits = httpx.Limits(max_connections=self.args.streams + 8)
        timeout = httpx.Timeout(self.args.request_timeout)
        async with httpx.AsyncClient(base_url=self.base, limits=limits, timeout=timeout) as client:
            faults = asyncio.create_task(self.fault_loop()) if self.args.faults else None
            warm = asyncio.create_task(self.read_warm_rss())
            await asyncio.gather(*(self.stream_loop(client) for _ in range(self.args.streams)))
            warm.cancel()
            if faults is not None:
                await faults  # a fault under way ends (its recovery, its clean-up) before the server stops
        self.ended = time.monotonic()

    async def read_warm_rss(self) -> None:
        await asyncio.sleep(self.args.duration / 4)
        self.rss_warm = rss_by_role(self.server)

    def outcomes(self) -> tuple[Counter[str], dict[str, Counter[str]]]:
        """(requests by outcome, failures by window: `<kind> #<i>`, or "outside"); each fault
        gets its window's failures as "failed"."""
        windows = [
            (f"{f['kind']} #{i}", f, self.started + f["at_s"], self.started + f["end_s"] + WINDOW_SLACK_S)
            for i, f in enumerate(self.faults)
            if "end_s" in f
        ]
        by_outcome: Counter[str] = Counter()
        failures: dict[str, Counter[str]] = {}
        for outcome, start, end in self.requests:
            by_outcome[outcome] += 1
            if outcome in NOT_FAILURES:
                continue
            # the latest fault it overlapped: a window's slack may reach into the next one's
            window = next((name for name, _, a, b in reversed(windows) if start < b and end > a), "outside")
            failures.setdefault(window, Counter())[outcome] += 1
        for name, fault, _, _ in windows:
            fault["failed"] = dict(failures.get(name, Counter()))
        return by_outcome, failures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load")
    ap.add_argument("--streams", type=int, default=32, help="concurrent streams")
    ap.add_argument(
        "--faults", default=",".join(FAULTS), help=f"the rotation, comma-separated, of: {', '.join(FAULTS)}"
    )
    ap.add_argument(
        "--whole-rotation",
        action="store_true",
        help="go on past --duration until every fault of the rotation has had its turn",
    )
    ap.add_argument("--calm", type=float, default=30.0, help="seconds between a fault's recovery and the next fault")
    ap.add_argument("--disconnect-rate", type=float, default=0.1, help="share of clients that leave mid-stream")
    ap.add_argument("--abort-rate", type=float, default=0.05, help="share of requests aborted by /abort_request")
    ap.add_argument("--bombs", type=int, default=8, help="grammar bombs sent at once")
    ap.add_argument("--slow-clients", type=int, default=16, help="slow-body requests at once")
    ap.add_argument("--slow-body-s", type=float, default=5.0, help="seconds over which a slow body arrives")
    ap.add_argument("--disconnects", type=int, default=32, help="streams of a disconnect burst")
    ap.add_argument("--model", choices=("null", "real"), default="null")
    ap.add_argument("--server-args", default="", help="more `runtime serve` flags")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    report.add_arguments(ap, "soak")
    args = ap.parse_args(argv)
    args.faults = [f for f in args.faults.split(",") if f]
    if unknown := set(args.faults) - set(FAULTS):
        ap.error(f"unknown faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
    started = report.start(args, argv)

    # Stops are found within STALL_TIMEOUT_S; the soak measures healing, so restarts are not
    # used up (the default allows 5 in 10 minutes: a crash loop, not faults a minute apart).
    extra = [
        *(["--null-model"] if args.model == "null" else []),
        "--workers",
        str(WORKERS),
        "--watchdog-timeout",
        str(STALL_TIMEOUT_S),
        "--worker-stall-timeout",
        str(STALL_TIMEOUT_S),
        "--engine-max-restarts",
        "1000",
        *shlex.split(args.server_args),
    ]
    log = args.out.with_name("soak_server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    server = sb.Server(extra, log)
    try:
        startup_s = server.wait_healthy()
        soak = Soak(server, server.model_name(), args)
        if not asyncio.run(soak.warm_workers(WORKERS)):
            raise RuntimeError(f"not every HTTP worker served a constrained request; see {log}")
        rss_start = rss_by_role(server)
        asyncio.run(soak.run())
        time.sleep(1.0)  # the last aborts reach the scheduler
        rss_end = rss_by_role(server)
        healthy_at_end = server.get("/health")[0] == 200
    finally:
        leftovers = server.stop()

    by_outcome, failures = soak.outcomes()
    lost_outside = sum(failures.get("outside", Counter()).values())
    all_recovered = all(f.get("recovered_s") is not None for f in soak.faults)
    data = {
        "duration_s": soak.ended - soak.started,
        "streams": args.streams,
        "model": args.model,
        "faults_rotation": args.faults,
        "calm_s": args.calm,
        "server_args": extra,
        "startup_s": startup_s,
        "requests": len(soak.requests),
        "outcomes": dict(by_outcome),
        "failures_by_window": {w: dict(c) for w, c in failures.items()},
        "failure_examples": soak.examples,
        "lost_outside_windows": lost_outside,
        "tokens_streamed": soak.tokens_streamed,
        "tokens_lost": soak.tokens_lost,
        "rss_kb_start": rss_start,
        "rss_kb_warm": soak.rss_warm,
        "rss_kb_end": rss_end,
        "faults": soak.faults,
        "all_recovered": all_recovered,
        "healthy_at_end": healthy_at_end,
        "leftovers": leftovers,
    }
    by_kind: dict[str, list[dict]] = {}
    for f in soak.faults:
        by_kind.setdefault(f["kind"], []).append(f)
    md = "\n\n".join(
        [
            f"{args.streams} streams for {data['duration_s']:.0f} s, {args.model} model, {len(soak.faults)} faults "
            f"({', '.join(args.faults)} in turn, {args.calm:g} s of calm between); {len(soak.requests)} requests, "
            f"{lost_outside} failed outside the fault windows; tokens streamed {soak.tokens_streamed}, "
            f"lost {soak.tokens_lost}; every fault recovered: {all_recovered}; healthy at the end: {healthy_at_end}.",
            report.table(("outcome", "requests"), sorted(by_outcome.items())),
            report.table(
                (
                    "fault",
                    "times",
                    "recovered in (s): each",
                    "failed requests in its windows",
                    "http worker RSS change (MiB)",
                ),
                [
                    (
                        kind,
                        len(fs),
                        " ".join(report.fmt(f["recovered_s"]) if f["recovered_s"] is not None else "never" for f in fs),
                        sum(sum(f.get("failed", {}).values()) for f in fs),
                        report.fmt(sum(f["rss_kb_delta"]["http worker"] for f in fs) / 1024),
                    )
                    for kind, fs in by_kind.items()
                ]
                or [("none", 0, "-", 0, "-")],
            ),
            report.table(
                ("process", "RSS start (MiB)", "RSS warm (MiB)", "RSS end (MiB)"),
                [
                    (role, *(report.fmt(rss.get(role, 0) / 1024) for rss in (rss_start, soak.rss_warm, rss_end)))
                    for role in sorted(set(rss_start) | set(rss_end))
                ],
            ),
        ]
    )
    print(md)
    report.write_results("soak", data, md, started, out=args.out)
    ok = healthy_at_end and all_recovered and soak.tokens_lost == 0 and lost_outside == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
