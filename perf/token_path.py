"""Where the server's CPU per streamed token goes: by process, thread and stage, with the null
model (instant tokens, so that all the CPU left is the server's own path), at 1, 32, 256 and
1,024 streams, with the defaults and beside them speculation off, `--workers 4` and the same
server over ZMQ + pickle (the baseline the rings are measured against).

serving_bench's workload and client (streamed chat completions, ~110-token prompts, 64 output
tokens, ignore_eos; closed loops of C keep-alive connections). Every configuration's server is
up at once and the levels run in --rounds rounds, in an order that rotates, so that all see
the same spells of a machine whose speed moves; each number is the median of its rounds, each
ratio the median of the rounds' ratios. Each level runs in two ways:
  - alone, for the numbers: each process's utime+stime over the window (/proc);
  - with py-spy attached (a sampling profiler reading the processes from outside: nothing runs
    in them, but its own CPU would crowd the server's on two cores), for the split: it samples
    every Python thread at --rate Hz; a sample is put in the stage of the innermost frame that
    a rule of the process's role names (STAGES), a sample waiting in poll/epoll is dropped;
    each thread's CPU over that window (/proc/<pid>/task/<tid>/stat) is split over its stages
    in proportion to its samples, and threads that run no Python (granian's tokio I/O
    threads) are their own stage; once, after the rounds. Each process's shares then split its
    median CPU per token.
So a table's numbers are measured CPU; only the split of a process's CPU between stages is
sampled (~1/sqrt(samples) of a stage's share). Each window is long enough for the 10 ms CPU
ticks and the samples (--requests).

    python -m perf.token_path                          # the whole set (~5 min on 2 cores)
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
import statistics
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
REQUESTS = {1: 256, 32: 2048, 256: 4096, 1024: 4096}
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


def profile(
    loop,
    server: sb.Server,
    bodies: list[bytes],
    concurrency: int,
    w: sb.Workload,
    rate: int,
    timeout: float,
    keep: Path | None,
) -> tuple[dict[str, dict[str, float]], int, int]:
    """One more window of a level with py-spy attached: (role -> stage -> share of that role's
    CPU, samples taken, requests failed). py-spy's raw samples stay in `keep` when given."""
    pids = sb.descendants(server.proc.pid)
    role_of_pid = {pid: sb.role_of(sb.proc_title(pid), pid, server.proc.pid) for pid in pids}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        if keep is not None:
            folder = keep / f"{server.port}-c{concurrency}"
            folder.mkdir(parents=True, exist_ok=True)
        profilers = Profilers(pids, rate, folder)
        time.sleep(0.5)  # attached
        ticks0 = thread_ticks(pids)
        level = sb.measure_level(loop, server, bodies, concurrency, w, timeout)
        ticks1 = thread_ticks(pids)
        samples = profilers.stop()
    shares = {}
    for role, per in split_cpu(role_of_pid, ticks0, ticks1, samples).items():
        total = sum(per.values()) or 1.0
        shares[role] = {stage: cpu / total for stage, cpu in sorted(per.items(), key=lambda kv: -kv[1])}
    count = sum(sum(c.values()) for per in samples.values() for c in per.values())
    return shares, count, level["failed"]


def summarize(config: Config, concurrency: int, rounds: list[dict], shares: dict[str, dict[str, float]]) -> dict:
    """A level's medians over its rounds, and its stages: the profiled shares of each process's
    median CPU per token."""
    med = statistics.median
    per_process = {
        role: med(lv["server_cpu_by_process_s"].get(role, 0.0) / max(lv["output_tokens"], 1) * 1e6 for lv in rounds)
        for role in ROLES
    }
    return {
        "config": config.name,
        "concurrency": concurrency,
        "requests_a_round": rounds[0]["num_requests"],
        "server_cpu_us_per_token": med(lv["server_cpu_us_per_token"] for lv in rounds),
        "process_us_per_token": per_process,
        "request_throughput": med(lv["request_throughput"] for lv in rounds),
        "tokens_per_event": med(lv["tokens_per_event"] or 0.0 for lv in rounds),
        "tokens_per_step": med(lv["tokens_per_step"] or 0.0 for lv in rounds),
        "failed": sum(lv["failed"] for lv in rounds),
        "stages_us_per_token": {
            role: {stage: share * per_process.get(role, 0.0) for stage, share in per.items()}
            for role, per in shares.items()
        },
        "rounds": rounds,
    }


# ratios of two levels taken round by round: (name, (config, streams) over (config, streams))
RATIOS = (
    ("zmq+pickle / defaults, 256 streams", ("zmq+pickle", 256), ("defaults", 256)),
    ("workers 4 / defaults, 256 streams", ("workers 4", 256), ("defaults", 256)),
    ("workers 4 / defaults, 1,024 streams", ("workers 4", 1024), ("defaults", 1024)),
    ("defaults 1,024 / 256 streams", ("defaults", 1024), ("defaults", 256)),
    ("speculation off / defaults, 256 streams", ("speculation off", 256), ("defaults", 256)),
)


def round_ratios(levels: dict[tuple[str, int], dict]) -> dict[str, dict]:
    out = {}
    for name, top, bottom in RATIOS:
        if top in levels and bottom in levels:
            pairs = zip(levels[top]["rounds"], levels[bottom]["rounds"])
            values = [a["server_cpu_us_per_token"] / b["server_cpu_us_per_token"] for a, b in pairs]
            out[name] = {"median": statistics.median(values), "rounds": values}
    return out


def markdown(result: dict) -> str:
    fmt = report.fmt
    levels = result["levels"]
    summary = [
        (
            lv["config"],
            lv["concurrency"],
            lv["requests_a_round"],
            f"{lv['request_throughput']:.0f}",
            fmt(lv["tokens_per_event"]),
            fmt(lv["tokens_per_step"]),
            fmt(lv["server_cpu_us_per_token"], ".2f"),
            *(fmt(lv["process_us_per_token"][r], ".2f") for r in ROLES[:3]),
            " / ".join(f"{x['server_cpu_us_per_token']:.1f}" for x in lv["rounds"]),
            lv["failed"],
        )
        for lv in levels
    ]
    columns = (
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
        "server, each round",
        "failed",
    )
    parts = [
        f"Server CPU per streamed token (µs), by process: medians of {result['rounds']} interleaved rounds "
        "(every server up at once, the levels in a rotating order)",
        report.table(columns, summary),
        "Ratios of server CPU per token, round by round (median; each round)",
        report.table(
            ("ratio", "median", "rounds"),
            [
                (name, f"{r['median']:.2f}", " / ".join(f"{x:.2f}" for x in r["rounds"]))
                for name, r in result["ratios"].items()
            ],
        ),
    ]
    names = [f"{lv['config']} c={lv['concurrency']}" for lv in levels]
    for role in ROLES[:3]:
        stages: list[str] = []
        for lv in levels:
            stages += [s for s in lv["stages_us_per_token"].get(role, {}) if s not in stages]
        rows = [
            (stage, *(fmt(lv["stages_us_per_token"].get(role, {}).get(stage), ".2f") for lv in levels))
            for stage in stages
        ]
        parts += [f"{role}: µs of CPU per streamed token, by stage", report.table(("stage", *names), rows)]
    parts.append(
        "Each process's median CPU per token, split over stages by py-spy's samples of one more window "
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
    ap.add_argument("--rounds", type=int, default=3)
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
    plan = [(c, lvs) for c, lvs in plan if lvs]
    counts.update({lv: counts.get(lv, 4 * lv) for _, lvs in plan for lv in lvs})
    # each config has a server of its own (a prefix cache of its own): they take the same prompts
    total = max(args.warmup + (args.rounds + 1) * sum(counts[lv] for lv in lvs) for _, lvs in plan)
    prompts, _ = sb.make_prompts(sb.load_tokenizer(None), total, w.prompt_tokens, 0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "rate": args.rate,
        "workload": f"{w.prompt_tokens}-token prompts, {w.output_tokens} output tokens, streamed chat, ignore_eos",
    }
    servers: dict[str, sb.Server] = {}
    cursor: dict[str, int] = {}
    names: dict[str, str] = {}
    result: dict = {**result, "rounds": args.rounds, "servers": {}, "levels": [], "ratios": {}}
    loop, _ = sb.new_event_loop()

    def take(config: str, n: int) -> list[bytes]:
        at = cursor[config]
        cursor[config] = at + n
        return [sb.request_body(names[config], p, w) for p in prompts[at : at + n]]

    try:
        for config, _ in plan:
            extra = ["--transport", config.transport, "--null-model", *config.args]
            servers[config.name] = sb.Server(
                extra, args.out.with_name(f"token_path_{config.name.replace(' ', '_').replace('+', '_')}.log")
            )
            result["servers"][config.name] = {"server_args": extra}
        for name, server in servers.items():
            result["servers"][name]["startup_s"] = server.wait_healthy()
            names[name], cursor[name] = server.model_name(), 0
            loop.run_until_complete(
                sb.run_closed_loop(
                    "127.0.0.1",
                    server.port,
                    take(name, args.warmup),
                    16,
                    args.request_timeout,
                    lambda: None,
                    lambda: None,
                )
            )
        order = [(config, c) for config, levels in plan for c in levels]
        rounds: dict[tuple[str, int], list[dict]] = {(config.name, c): [] for config, c in order}
        for r in range(args.rounds):
            k = r % len(order)
            for config, c in order[k:] + order[:k]:
                lv = sb.measure_level(
                    loop, servers[config.name], take(config.name, counts[c]), c, w, args.request_timeout
                )
                rounds[(config.name, c)].append(lv)
                print(
                    f"round {r} {config.name} c={c}: {lv['server_cpu_us_per_token'] or 0:.2f} µs/token "
                    f"{lv['request_throughput']:.0f} req/s {lv['tokens_per_event'] or 0:.1f} tok/event",
                    flush=True,
                )
        levels = {}
        for config, c in order:
            shares, count, failed = profile(
                loop,
                servers[config.name],
                take(config.name, counts[c]),
                c,
                w,
                args.rate,
                args.request_timeout,
                args.samples,
            )
            lv = levels[(config.name, c)] = summarize(config, c, rounds[(config.name, c)], shares)
            lv["samples"], lv["failed"] = count, lv["failed"] + failed
            result["levels"].append(lv)
            print(f"{config.name} c={c}: median {lv['server_cpu_us_per_token']:.2f} µs/token", flush=True)
            for role, stages in lv["stages_us_per_token"].items():
                print(f"  {role}: " + ", ".join(f"{s} {v:.2f}" for s, v in stages.items()), flush=True)
        result["ratios"] = round_ratios(levels)
        for name, ratio in result["ratios"].items():
            print(f"{name}: {ratio['median']:.2f}", flush=True)
    finally:
        sb.cancel_pending(loop)
        loop.close()
        for name, server in servers.items():
            result["servers"][name]["leftovers"] = server.stop()
        report.write_results("token_path", result, markdown(result), started, out=args.out)
    return 1 if any(lv["failed"] for lv in result["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
