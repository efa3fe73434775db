"""Where the server's CPU per streamed token goes: by process, thread and stage, with the null
model (instant tokens, so that all the CPU left is the server's own path), at 1, 32, 256 and
1,024 streams, with the defaults and beside them speculation off, `--workers 4` and the same
server over ZMQ + pickle (the baseline the rings are measured against).

serving_bench's workload and client (streamed chat completions, ~110-token prompts, 64 output
tokens, ignore_eos; closed loops of C keep-alive connections). Each level runs twice:
  - alone, for the numbers: each process's utime+stime over the window (/proc);
  - with py-spy attached (a sampling profiler reading the processes from outside: nothing runs
    in them, but its own CPU would crowd the server's on two cores), for the split: it samples
    every Python thread at --rate Hz; a sample is put in the stage of the innermost frame that
    a rule of the process's role names (STAGES), a sample waiting in poll/epoll is dropped;
    each thread's CPU over that window (/proc/<pid>/task/<tid>/stat) is split over its stages
    in proportion to its samples, and threads that run no Python (granian's tokio I/O
    threads) are their own stage. Each process's shares then split its CPU of the first pass.
So a table's numbers are measured CPU; only the split of a process's CPU between stages is
sampled (~1/sqrt(samples) of a stage's share). Each window is long enough for the 10 ms CPU
ticks and the samples (--requests).

    python -m perf.token_path                          # the whole set (~6 min on 2 cores)
    python -m perf.token_path --configs defaults --levels 256
Writes perf/results/token_path.json and token_path.md (perf/report.py), the servers' logs
beside them (not committed). Needs py-spy (`pip install py-spy`; the dev extra has it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from perf import report
from perf import serving_bench as sb

LEVELS = (1, 32, 256, 1024)
# requests a level: windows of a few seconds at the rates the null model serves them
REQUESTS = {1: 512, 32: 4096, 256: 8192, 1024: 8192}
ROLES = ("http worker", "ringserve::scheduler", "ringserve::detokenizer", "granian main")
NATIVE_THREADS = "native threads (granian I/O)"
UNSAMPLED = "unsampled"


@dataclass(frozen=True)
class Config:
    name: str
    transport: str
    args: tuple[str, ...]
    levels: tuple[int, ...]


CONFIGS = (
    Config("defaults", "ring", (), LEVELS),
    Config("speculation off", "ring", ("--speculative-algorithm", "none"), (256,)),
    Config("workers 4", "ring", ("--workers", "4"), (256, 1024)),
    Config("zmq+pickle", "zmq", (), (256,)),
)

# (stage, pattern on a frame "function (path:line)"), per role, tried on the frames from the
# innermost outwards: the first frame some rule matches names the sample's stage
_RINGS = ("rings: push/pop, wakeups", r"\(ipc/")
STAGES: dict[str, list[tuple[str, str]]] = {
    "http worker": [
        _RINGS,
        ("prompt: chat template, tokens", r"chat_template\.py|prompt_encoder\.py|jinja2/|tokenizers"),
        (
            "request parse, sampling fields",
            r"\(httpapi/(chat_request|fields|sampling|request_fields|requests|grammar_fields)\.py|read_body|orjson",
        ),
        ("request records out", r"request_records\.py|TokenizerManager\.dispatch"),
        (
            "text in, SSE encode",
            r"\(httpapi/(sse|responses|chat_output|logprobs)\.py|streaming\.py|req_state\.py|HTTPWorkerProcess\._read_loop|text_out",
        ),
        ("metrics, request log", r"metrics\.py|request_log\.py|engine_stats\.py"),
        ("ASGI glue (app, routes)", r"runtime/http_worker/(asgi|routes|core|disconnect)\.py|runtime/app\.py"),
        ("event loop (uvloop, granian's Python side)", r"granian/|asyncio/|uvloop"),
    ],
    "ringserve::scheduler": [
        _RINGS,
        ("drafting (n-gram)", r"speculative\.py|ngram\.py|ReqTable\.draft"),
        ("model step (null)", r"null_model\.py"),
        ("token records out", r"token_out\.py|record_bytes\.py|SchedulerProcess\._publish"),
        ("request records in", r"request_records\.py|SchedulerProcess\._handle_requests"),
        ("bookkeeping: batch, KV pages, radix cache", r"runtime/scheduler/|gpu/kvcache/"),
    ],
    "ringserve::detokenizer": [
        _RINGS,
        ("stop strings", r"stop_strings\.py"),
        ("incremental decode", r"incremental\.py|tokenizers"),
        ("text records out", r"text_out\.py|record_bytes\.py|payloads\.py"),
        ("worker watch, pacing", r"worker_watch\.py|Pacing"),
        ("bookkeeping", r"runtime/detokenizer/"),
    ],
    "granian main": [],
}
# a sample whose innermost frame is one of these waits in the kernel: no CPU
IDLE = re.compile(r"^(Waker\._sleep|\w*Selector\.select|select|poll|Event\.wait|Condition\.wait|sleep) \(")


def thread_ticks(pids: list[int]) -> dict[tuple[int, int], tuple[str, int]]:
    """(pid, tid) -> (thread name, utime+stime ticks) of every thread of the processes."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            except (FileNotFoundError, ProcessLookupError):
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            out[(pid, int(tid))] = (name, int(fields[11]) + int(fields[12]))
    return out


class Profilers:
    """One `py-spy record` per process for the length of a window (SIGINT writes its samples)."""

    def __init__(self, pids: list[int], rate: int, folder: Path) -> None:
        self.files = {pid: folder / f"{pid}.txt" for pid in pids}
        self.procs = [
            subprocess.Popen(
                [
                    shutil.which("py-spy") or "py-spy",
                    "record",
                    "-p",
                    str(pid),
                    "-r",
                    str(rate),
                    "--threads",
                    "--nonblocking",
                    "--format",
                    "raw",
                    "-o",
                    str(path),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for pid, path in self.files.items()
        ]

    def stop(self) -> dict[int, dict[int, Counter]]:
        """pid -> tid -> Counter of stacks (tuples of frames, outermost first)."""
        for p in self.procs:
            p.send_signal(signal.SIGINT)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        samples: dict[int, dict[int, Counter]] = {}
        for pid, path in self.files.items():
            per_thread: dict[int, Counter] = defaultdict(Counter)
            if path.exists():
                for line in path.read_text().splitlines():
                    stack, _, count = line.rpartition(" ")
                    frames = stack.split(";")
                    m = re.match(r"thread \((\d+)\)", frames[0])
                    if m and count.isdigit():
                        per_thread[int(m.group(1))][tuple(frames[1:])] += int(count)
            samples[pid] = per_thread
        return samples


def stage_of(role: str, frames: tuple[str, ...]) -> str | None:
    """The sample's stage, or None when it waits in the kernel."""
    if not frames or IDLE.match(frames[-1]):
        return None
    rules = [(stage, re.compile(pattern)) for stage, pattern in STAGES.get(role, [])]
    for frame in reversed(frames):
        for stage, pattern in rules:
            if pattern.search(frame):
                return stage
    return "other Python"


def split_cpu(role_of_pid: dict[int, str], ticks0: dict, ticks1: dict, samples: dict) -> dict[str, dict[str, float]]:
    """role -> stage -> CPU seconds: each thread's measured CPU over its sampled stages."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (pid, tid), (name, t1) in ticks1.items():
        cpu = (t1 - ticks0.get((pid, tid), (name, 0))[1]) / sb.CLK_TCK
        if cpu <= 0:
            continue
        role = role_of_pid.get(pid, "?")
        stages = Counter()
        for frames, n in samples.get(pid, {}).get(tid, Counter()).items():
            stage = stage_of(role, frames)
            if stage is not None:
                stages[stage] += n
        total = sum(stages.values())
        if not total:
            out[role][NATIVE_THREADS if name.startswith("tokio") else UNSAMPLED] += cpu
            continue
        for stage, n in stages.items():
            out[role][stage] += cpu * n / total
    return {role: dict(stages) for role, stages in out.items()}


def measure(
    loop,
    server: sb.Server,
    bodies: list[bytes],
    profiled_bodies: list[bytes],
    concurrency: int,
    w: sb.Workload,
    rate: int,
    timeout: float,
    keep: Path | None,
) -> dict:
    """One level, twice: serving_bench's measurement alone (`bodies`: the numbers), then with
    py-spy over the window (`profiled_bodies`: each process's split over stages, which scales
    the first pass's CPU of that process; py-spy's own CPU would otherwise crowd the server on
    two cores). py-spy's raw samples stay in `keep` when given (a file a process, by pid)."""
    level = sb.measure_level(loop, server, bodies, concurrency, w, timeout)
    pids = sb.descendants(server.proc.pid)
    role_of_pid = {pid: sb.role_of(sb.proc_title(pid), pid, server.proc.pid) for pid in pids}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        if keep is not None:
            folder = keep / f"c{concurrency}-{time.strftime('%H%M%S')}"
            folder.mkdir(parents=True)
        profilers = Profilers(pids, rate, folder)
        time.sleep(0.5)  # attached
        ticks0 = thread_ticks(pids)
        profiled = sb.measure_level(loop, server, profiled_bodies, concurrency, w, timeout)
        ticks1 = thread_ticks(pids)
        samples = profilers.stop()
    stages = split_cpu(role_of_pid, ticks0, ticks1, samples)
    tokens = level["output_tokens"] or 1
    level["stages_us_per_token"] = {}
    for role, per in stages.items():
        cpu = level["server_cpu_by_process_s"].get(role, 0.0)
        total = sum(per.values()) or 1.0
        level["stages_us_per_token"][role] = {
            stage: cpu * share / total / tokens * 1e6 for stage, share in sorted(per.items(), key=lambda kv: -kv[1])
        }
    level["profiled_server_cpu_us_per_token"] = profiled["server_cpu_us_per_token"]
    level["failed"] += profiled["failed"]
    level["samples"] = sum(sum(c.values()) for per in samples.values() for c in per.values())
    return level


def markdown(result: dict) -> str:
    fmt = report.fmt
    runs = result["runs"]
    summary_rows = []
    for run in runs:
        for lv in run["levels"]:
            per_role = {r: lv["server_cpu_by_process_s"].get(r, 0.0) / max(lv["output_tokens"], 1) * 1e6 for r in ROLES}
            summary_rows.append(
                (
                    run["config"],
                    lv["concurrency"],
                    lv["num_requests"],
                    f"{lv['request_throughput']:.0f}",
                    fmt(lv["tokens_per_event"]),
                    fmt(lv["tokens_per_step"]),
                    fmt(lv["server_cpu_us_per_token"], ".2f"),
                    *(fmt(per_role[r], ".2f") for r in ROLES[:3]),
                    lv["failed"],
                )
            )
    parts = [
        "Server CPU per streamed token (µs), by process",
        report.table(
            (
                "config",
                "streams",
                "requests",
                "req/s",
                "tok/event",
                "tok/step",
                "server",
                "HTTP worker(s)",
                "scheduler",
                "detokenizer",
                "failed",
            ),
            summary_rows,
        ),
    ]
    for role in ROLES[:3]:
        columns = [f"{run['config']} c={lv['concurrency']}" for run in runs for lv in run["levels"]]
        stages: list[str] = []
        for run in runs:
            for lv in run["levels"]:
                for stage in lv["stages_us_per_token"].get(role, {}):
                    if stage not in stages:
                        stages.append(stage)
        rows = [
            (
                stage,
                *(
                    fmt(lv["stages_us_per_token"].get(role, {}).get(stage), ".2f")
                    for run in runs
                    for lv in run["levels"]
                ),
            )
            for stage in stages
        ]
        parts += [f"{role}: µs of CPU per streamed token, by stage", report.table(("stage", *columns), rows)]
    parts.append(
        "Measured CPU of every thread over each level's window, split over stages by py-spy's samples "
        f"({result['rate']} Hz); the null model; {result['workload']}."
    )
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--configs", default=",".join(c.name for c in CONFIGS), help="which of: " + ", ".join(c.name for c in CONFIGS)
    )
    ap.add_argument("--levels", default="", help="only these stream counts (default: each config's own)")
    ap.add_argument("--requests", default="", help=f"requests a level, as c:n,c:n (default: {REQUESTS})")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples a second")
    ap.add_argument("--warmup", type=int, default=256)
    ap.add_argument("--samples", type=Path, help="keep py-spy's raw samples in this folder")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    report.add_arguments(ap, "token_path")
    args = ap.parse_args(argv)
    if shutil.which("py-spy") is None:
        ap.error("py-spy is not installed (pip install py-spy)")
    started = report.start(args, argv)
    wanted = set(args.configs.split(","))
    unknown = wanted - {c.name for c in CONFIGS}
    if unknown:
        ap.error(f"unknown configs: {sorted(unknown)}")
    only = {int(x) for x in args.levels.split(",") if x}
    counts = dict(REQUESTS)
    counts.update({int(k): int(v) for k, v in (kv.split(":") for kv in args.requests.split(",") if kv)})
    w = sb.Workload(sb.Workload.prompt_tokens, sb.Workload.output_tokens, 0.0, 0)
    configs = [c for c in CONFIGS if c.name in wanted]
    plan = [(c, [lv for lv in c.levels if not only or lv in only]) for c in configs]
    # each config starts a server of its own (an empty prefix cache): they take the same prompts
    total = max(args.warmup + 2 * sum(counts.get(lv, 4 * lv) for lv in lvs) for _, lvs in plan)
    prompts, _ = sb.make_prompts(sb.load_tokenizer(None), total, w.prompt_tokens, 0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "rate": args.rate,
        "workload": f"{w.prompt_tokens}-token prompts, {w.output_tokens} output tokens, streamed chat, ignore_eos",
        "runs": [],
    }
    failed = 0
    loop, _ = sb.new_event_loop()
    try:
        for config, levels in plan:
            if not levels:
                continue
            extra = ["--transport", config.transport, "--null-model", *config.args]
            server = sb.Server(extra, args.out.with_name(f"token_path_{config.name.replace(' ', '_')}.log"))
            run = {"config": config.name, "server_args": extra, "levels": []}
            try:
                run["startup_s"] = server.wait_healthy()
                name = server.model_name()
                warm = [sb.request_body(name, p, w) for p in prompts[: args.warmup]]
                at = args.warmup
                loop.run_until_complete(
                    sb.run_closed_loop(
                        "127.0.0.1", server.port, warm, 16, args.request_timeout, lambda: None, lambda: None
                    )
                )
                for c in levels:
                    n = counts.get(c, 4 * c)
                    bodies = [sb.request_body(name, p, w) for p in prompts[at : at + 2 * n]]
                    at += 2 * n
                    lv = measure(
                        loop, server, bodies[:n], bodies[n:], c, w, args.rate, args.request_timeout, args.samples
                    )
                    failed += lv["failed"]
                    run["levels"].append(lv)
                    print(
                        f"{config.name} c={c}: {lv['server_cpu_us_per_token'] or 0:.2f} µs/token "
                        f"{lv['request_throughput']:.0f} req/s {lv['tokens_per_event'] or 0:.1f} tok/event",
                        flush=True,
                    )
                    for role, stages in lv["stages_us_per_token"].items():
                        print(f"  {role}: " + ", ".join(f"{s} {v:.2f}" for s, v in stages.items()), flush=True)
            finally:
                sb.cancel_pending(loop)
                run["leftovers"] = server.stop()
            result["runs"].append(run)
    finally:
        loop.close()
        report.write_results("token_path", result, markdown(result), started, out=args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
