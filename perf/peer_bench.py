"""Peer benchmark: ringserve against llama.cpp's server on the same machine, all
servers up at once, each workload sent to each server in turn, rounds interleaved (the
servers' order rotates round by round), so that every server sees the same spells of a
machine whose speed moves.

Servers:
  llama.cpp   `llama-server` (--llama-server PATH, else $LLAMA_SERVER, else `llama-server` on
              PATH; not a dependency: without one the ringserve servers run alone and the
              results say llama.cpp was skipped) on the same GGUF file as ringserve's
              embedded model, `-np 32 -t 2 -c 32 x --llama-slot-context` (by default the least
              that holds the workloads' requests)
  ringserve   `python -m runtime serve` with its defaults (no mode flags)
  ringserve + each --ringserve-args configuration (default: speculation off)
  ringserve @ each --ringserve-tree: the defaults of another code tree (a git worktree of an
              earlier commit: what a change of the code did, measured beside it)

Every request is a streamed /v1/completions with `ignore_eos`, temperature 0, `logprobs: 1`
and `stream_options.include_usage`, on both servers. Workloads:
  random         ~110-token prompts of random words, 64 output tokens, at concurrency 1, 8, 32
                 (closed loops, serving_bench's client)
  shared_prefix  SGLang's bench_serving --dataset-name generated-shared-prefix: 4 groups x 16
                 prompts, a 1,024-token system prompt per group, a 64-token question, 32
                 output tokens, concurrency 16 (random whole words rather than random token
                 ids, so that a text re-encodes to its token count)
  multi_turn     conversations whose next turn's prompt holds the previous turns and this
                 server's own answers; TTFT of the first turn against the later ones shows
                 the prefix reuse
  repetitive     rewrite a ~300-token code file with one identifier renamed, 128 output
                 tokens, concurrency 1: what n-gram speculation should speed up; the texts of
                 every ringserve configuration are compared with the defaults' (greedy)

Counting (the same on both servers): a streamed chunk's tokens are its logprobs entries
(ringserve: `logprobs.tokens`, llama.cpp: `logprobs.content`), and each request's total must
be usage's completion_tokens, which must be the requested count (else the request failed).
  TTFT  request written -> first chunk with text or a token
  ITL   per token, as SGLang's bench_serving counts speculative decoding: a chunk of n tokens
        after a gap g adds n latencies of g / n
  TPOT  (e2e - TTFT) / (completion_tokens - 1)
A token whose text ends inside a UTF-8 character gets no chunk of its own on llama.cpp (its
logprobs are lost from the stream): such tokens are reported as `uncounted_tokens`, and the
gap they spanned counts as one token's.

Memory: the resident MB (VmRSS) of each process of every server, by role, at three times:
healthy (before any request), end (after the last round) and idle (--idle-s later, the
servers idle: after the scheduler's trim of its heap), and each tree's peak (VmHWM).

Per workload and server: medians over the rounds; ratios ringserve / llama.cpp (and each
extra configuration / the defaults) are medians of the rounds' ratios; the targets (TARGET_*)
are checked for ringserve's defaults (n-gram speculation on), the speculation target against
each configuration with `--speculative-algorithm none`.

    python -m perf.peer_bench --llama-server /path/to/llama-server      # default sizes: ~29 min, quiet
    python -m perf.peer_bench --rounds 3 --ringserve-args "--stream-interval 4"   # another extra configuration
    python -m perf.peer_bench --null-model --workloads random --concurrency 1 --num-requests 4   # smoke
    git worktree add /tmp/before HEAD~2
    python -m perf.peer_bench --ringserve-tree /tmp/before --ringserve-args "--kv-cache-dtype float32" \
        --workloads random --concurrency 1,32                       # memory and speed: this tree vs before
Writes perf/results/peer.json and peer.md (perf/report.py), each server's log beside them
(not committed).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson

from perf import report
from perf import serving_bench as sb

WORKLOADS = ("random", "shared_prefix", "multi_turn", "repetitive")
COMPLETIONS = "/v1/completions"
LLAMA = "llama.cpp"
RINGSERVE = "ringserve"
OFF_ARGS = "--speculative-algorithm none"  # speculation off: the baseline of the defaults' (NGRAM)
LLAMA_SLOTS = 32

# Targets: ringserve's defaults ahead of llama.cpp at c=1, in batches (issue 28's: 3x at c=8,
# 4x at c=32) and on shared prefixes; n-gram speculation's ITL on the repetitive workload
# against speculation off
TARGET_C1_TOKENS_RATIO = 1.5
TARGET_C1_ITL_RATIO = 0.8
TARGET_C1_TTFT_RATIO = 1.0
TARGET_BATCH_TOKENS_RATIOS = {8: 3.0, 32: 4.0}  # concurrency -> output tok/s over llama.cpp's
TARGET_SHARED_TOKENS_RATIO = 5.0
TARGET_SHARED_TTFT_RATIO = 0.3
TARGET_SPEC_ITL_RATIO = 0.5
TARGET_OFF_C1_TOKENS_RATIO = 1.0  # speculation off must still match llama.cpp at c=1
TARGET_RSS_RATIO = 1.5  # all processes' RSS at the end, same slots and context
TARGET_STARTUP_RATIO = 2.0  # time to healthy

# the repetitive workload's file: the prompt asks for it again with one identifier renamed
CODE = '''import time
from collections import OrderedDict


class LRUCache:
    """A mapping that keeps at most `capacity` entries, dropping the least recently used."""

    def __init__(self, capacity: int, ttl: float | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.ttl = ttl
        self.entries: OrderedDict[str, tuple[float, object]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str, default: object = None) -> object:
        entry = self.entries.get(key)
        if entry is None or self.expired(entry[0]):
            self.misses += 1
            return default
        self.entries.move_to_end(key)
        self.hits += 1
        return entry[1]

    def put(self, key: str, value: object) -> None:
        self.entries[key] = (time.monotonic(), value)
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def expired(self, stamp: float) -> bool:
        return self.ttl is not None and time.monotonic() - stamp > self.ttl

    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
'''
RENAMES = (
    ("LRUCache", "RecentCache"),
    ("entries", "items"),
    ("capacity", "limit"),
    ("expired", "is_stale"),
    ("hit_rate", "hit_ratio"),
    ("misses", "faults"),
    ("ttl", "max_age"),
    ("stamp", "written"),
)


# ---------------------------------------------------------------- prompts


class RawCounter:
    """Tokens of a raw /v1/completions prompt, as the servers count them (no chat template)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])


def word_text(words: list[str], rng: np.random.Generator, n_tokens: int, count: Callable[[str], int]) -> str:
    """Random words of `n_tokens` tokens (the next count above when one word more jumps past it)."""
    pool = [words[i] for i in rng.integers(0, len(words), n_tokens * 2)]
    k = n_tokens  # each " word" is one token; the loops correct the first word's and any other
    while count(" ".join(pool[:k])) < n_tokens and k < len(pool):
        k += 1
    while k > 1 and count(" ".join(pool[: k - 1])) >= n_tokens:
        k -= 1
    return " ".join(pool[:k])


def shared_prefix_prompts(
    tokenizer, groups: int, per_group: int, system_tokens: int, question_tokens: int, seed: int
) -> list[str]:
    """SGLang's generated-shared-prefix prompts, group after group: `system\\n\\nquestion`."""
    count, words, rng = RawCounter(tokenizer), sb.vocab_words(tokenizer), np.random.default_rng(seed)
    systems = [word_text(words, rng, system_tokens, count) for _ in range(groups)]
    return [f"{s}\n\n{word_text(words, rng, question_tokens, count)}" for s in systems for _ in range(per_group)]


def repetitive_prompts(n: int, seed: int) -> list[str]:
    """Prompts asking for CODE again with one identifier renamed, each its own rename (the
    instruction first, so that the prompts share no long prefix; the new name's number
    differs from round to round)."""
    rng = np.random.default_rng(seed)
    offset = int(rng.integers(len(RENAMES)))
    out = []
    for i in range(n):
        old, new = RENAMES[(offset + i) % len(RENAMES)]
        new = f"{new}_{int(rng.integers(2, 1000))}"
        out.append(
            f"Rename `{old}` to `{new}` in the Python file below and write the whole file again.\n\n"
            f"```python\n{CODE}```\n\nThe same file with `{old}` renamed to `{new}`:\n\n```python\n"
        )
    return out


def conversation_turns(
    tokenizer, n: int, turns: int, first_tokens: int, next_tokens: int, seed: int
) -> list[list[str]]:
    """`n` conversations of `turns` user messages: a long first one, shorter ones after."""
    count, words, rng = RawCounter(tokenizer), sb.vocab_words(tokenizer), np.random.default_rng(seed)
    return [
        [
            "Read these words and say which are nouns: " + word_text(words, rng, first_tokens, count),
            *("Now these ones: " + word_text(words, rng, next_tokens, count) for _ in range(turns - 1)),
        ]
        for _ in range(n)
    ]


def transcript(history: list[tuple[str, str]], message: str) -> str:
    """A conversation as one raw completions prompt: the earlier turns, then the new message."""
    text = "".join(f"User: {q}\nAssistant:{a}\n" for q, a in history)
    return f"{text}User: {message}\nAssistant:"


def completion_body(model: str, prompt: str, max_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 1,  # one entry per token in every chunk: how the chunk's tokens are counted
            "stream_options": {"include_usage": True},
        }
    )


# ---------------------------------------------------------------- llama.cpp's server


def find_llama_server(given: str | None) -> str | None:
    path = given or os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
    return path if path and Path(path).is_file() and os.access(path, os.X_OK) else None


class LlamaServer:
    """`llama-server` on a free port, in a session of its own, its output in `log`; the same
    interface as serving_bench.Server for measure_level (one process: its threads' CPU is
    in its /proc stat)."""

    def __init__(self, binary: str, gguf: str, extra_args: list[str], log: Path) -> None:
        self.port = sb.free_port()
        self.extra_args = extra_args
        self.argv = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), *extra_args]
        self._launch(None, log, None)

    _launch = sb.Server._launch
    get = sb.Server.get
    model_name = sb.Server.model_name

    def wait_healthy(self) -> float:
        """/health answers 503 while the model loads, 200 once slots are ready."""
        while time.monotonic() - self.started < sb.START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with status {self.proc.returncode}; see {self.log}")
            try:
                if self.get("/health")[0] == 200:
                    return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"llama-server was not healthy within {sb.START_TIMEOUT_S:.0f} s; see {self.log}")

    def engine_counters(self) -> dict[str, float]:
        return {}

    def cpu_ticks(self) -> dict[int, int]:
        stat = sb.proc_stat(self.proc.pid)
        return {} if stat is None else {self.proc.pid: stat[1]}

    def cpu_by_role(self, before: dict[int, int], after: dict[int, int]) -> dict[str, float]:
        return {"llama-server": sum(t - before.get(p, 0) for p, t in after.items()) / sb.CLK_TCK}

    def stop(self) -> dict:
        t0 = time.monotonic()
        clean = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(sb.STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            clean = False
            self.proc.kill()
            self.proc.wait()
        return {
            "exit_status": self.proc.returncode,
            "stopped_by_sigint": clean,
            "stop_s": time.monotonic() - t0,
            "processes": [],
            "shm_segments": [],
            "engine_files": [],
        }


def process_role(server, pid: int) -> str:
    """What the process `pid` of `server`'s tree is: llama-server, or ringserve's role."""
    if isinstance(server, LlamaServer):
        return "llama-server"
    return sb.role_of(sb.proc_title(pid), pid, server.proc.pid)


def rss_by_role(server) -> dict[str, float]:
    """Resident MB (VmRSS) of each live process of `server`'s tree, by role, and their total."""
    out: dict[str, float] = {}
    for pid in server.cpu_ticks():
        role = process_role(server, pid)
        out[role] = round(out.get(role, 0.0) + tree_rss_mb({pid: 0})["rss"], 1)
    out["total"] = round(sum(out.values()), 1)
    return out


def tree_rss_mb(pids: dict[int, int]) -> dict[str, float]:
    """Resident and peak-resident MB (VmRSS, VmHWM) of a server's processes, summed: what the
    server holds after the rounds, every process counted (shared pages once per process)."""
    total = {"rss": 0.0, "peak": 0.0}
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        total["rss"] += int(fields.get("VmRSS", "0 kB").split()[0]) / 1024
        total["peak"] += int(fields.get("VmHWM", "0 kB").split()[0]) / 1024
    return {"rss": round(total["rss"], 1), "peak": round(total["peak"], 1), "processes": len(pids)}


def llama_version(binary: str) -> str:
    try:
        proc = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    return " ".join((proc.stdout + proc.stderr).split())[:200]


OTHER_BACKENDS = re.compile(
    r"GGML_(CUDA|HIP|OPENCL|SYCL|WEBGPU|VULKAN|METAL|MUSA|CANN|RPC|RV|LASX|LSX|ACCELERATE|CCACHE)"
)


def llama_build(binary: str) -> str:
    """The CMake options llama.cpp was built with (the GGML_* switches that pick its CPU
    kernels, and the build type), read from the CMakeCache.txt of the build folder the binary
    sits in: a peer is compared at a configuration the reader can repeat."""
    for folder in Path(binary).resolve().parents:
        cache = folder / "CMakeCache.txt"
        if cache.is_file():
            break
    else:
        return "unknown (no CMakeCache.txt above the binary)"
    entry = re.compile(r"^(GGML_[A-Z0-9_]+|CMAKE_BUILD_TYPE):[A-Z]+=(.*)$")
    values = dict(m.groups() for line in cache.read_text().splitlines() if (m := entry.match(line)))
    # Which CPU switches are on says which kernels it has (GGML_NATIVE off: the list is the whole
    # story); other backends' and architectures' switches change nothing on this CPU.
    shown = {
        k: v
        for k, v in values.items()
        if (v == "ON" and not OTHER_BACKENDS.match(k)) or k in ("GGML_NATIVE", "CMAKE_BUILD_TYPE") or "_AMX" in k
    }
    return " ".join(f"{k}={v}" for k, v in sorted(shown.items())) or "unknown (no GGML_ options)"


def log_tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------- measuring


class Bench:
    """The servers up at once, the client's loop, and what a workload sends to one server."""

    def __init__(self, servers: dict[str, object], args) -> None:
        self.servers = servers
        self.args = args
        self.loop, self.loop_name = sb.new_event_loop()
        self.models = {name: s.model_name() for name, s in servers.items()}

    def order(self, r: int) -> list[str]:
        names = list(self.servers)
        k = r % len(names)
        return names[k:] + names[:k]

    def closed_loop(self, name: str, prompts: list[str], concurrency: int, output_tokens: int, keep=None) -> dict:
        """One closed-loop level; a new connection for each request on every server alike:
        llama.cpp's server closes the connection after a streamed response (despite its
        Keep-Alive header), and a request written on it before the close arrives is lost."""
        bodies = [completion_body(self.models[name], p, output_tokens) for p in prompts]
        w = sb.Workload(output_tokens=output_tokens)
        return sb.measure_level(
            self.loop, self.servers[name], bodies, concurrency, w, self.args.request_timeout, COMPLETIONS, keep, True
        )

    def conversations(self, name: str, convs: list[list[str]], output_tokens: int) -> dict:
        """Each conversation on a connection of its own, turn after turn, the next turn's prompt
        holding this server's answers; all conversations at once."""
        server, model, timeout = self.servers[name], self.models[name], self.args.request_timeout
        by_turn: list[list[sb.RequestResult]] = [[] for _ in range(max(map(len, convs)))]

        async def talk(messages: list[str]) -> None:
            history: list[tuple[str, str]] = []
            for turn, message in enumerate(messages):
                try:  # a fresh connection each turn: see closed_loop
                    conn = await sb.connect("127.0.0.1", server.port, COMPLETIONS)
                except OSError as e:  # the server is gone
                    by_turn[turn].append(sb.RequestResult(time.perf_counter(), error=f"cannot connect: {e}"))
                    return
                try:
                    r = await conn.request(completion_body(model, transcript(history, message), output_tokens), timeout)
                finally:
                    conn.transport.close()
                by_turn[turn].append(r)
                if r.error:
                    return
                history.append((message, "".join(r.text)))

        async def run_all() -> float:
            t0 = time.perf_counter()
            await asyncio.gather(*(talk(c) for c in convs))
            return time.perf_counter() - t0

        load0, ticks0 = os.getloadavg(), server.cpu_ticks()
        window = self.loop.run_until_complete(run_all())
        cpu = sum(server.cpu_by_role(ticks0, server.cpu_ticks()).values())
        w = sb.Workload(output_tokens=output_tokens)
        flat = [r for results in by_turn for r in results]
        level = {"concurrency": len(convs), **sb.summarize(flat, w, window), "loadavg_before": load0}
        tokens = level["output_tokens"]
        level["server_cpu_us_per_token"] = cpu / tokens * 1e6 if tokens else None
        ok = [[r for r in results if r.error is None] for results in by_turn]
        level["turns"] = [
            {
                "turn": i + 1,
                "requests": len(results),
                "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in results])) if results else None,
                "cached_tokens_mean": float(np.mean([r.cached_tokens for r in results])) if results else None,
                "ttft_ms": sb.percentiles([r.content_times[0] - r.start for r in results if r.content_times], 1e3),
            }
            for i, results in enumerate(ok)
        ]
        later = [r.content_times[0] - r.start for results in ok[1:] for r in results if r.content_times]
        level["ttft_later_turns_ms"] = sb.percentiles(later, 1e3)
        return level


def run_workload(bench: Bench, workload: str, r: int, tokenizer, args) -> dict[str, list[dict]]:
    """One round of one workload on every server, in the round's order; per server its levels."""
    seed = args.seed + 1000 * (r + 1) + WORKLOADS.index(workload)  # fresh prompts each round: no cache between them
    out: dict[str, list[dict]] = {name: [] for name in bench.servers}
    if workload == "random":
        counts = [args.request_counts[c] for c in args.levels]
        prompts, _ = sb.make_prompts(tokenizer, sum(counts), args.prompt_tokens, seed, RawCounter(tokenizer))
        for c, level_prompts in zip(args.levels, sb.split(prompts, counts)):
            for name in bench.order(r):
                out[name].append(bench.closed_loop(name, level_prompts, c, args.output_tokens))
    elif workload == "shared_prefix":
        prompts = shared_prefix_prompts(
            tokenizer, args.sp_groups, args.sp_per_group, args.sp_system_tokens, args.sp_question_tokens, seed
        )
        for name in bench.order(r):
            out[name].append(bench.closed_loop(name, prompts, args.sp_concurrency, args.sp_output_tokens))
    elif workload == "multi_turn":
        convs = conversation_turns(
            tokenizer, args.mt_conversations, args.mt_turns, args.mt_first_tokens, args.mt_next_tokens, seed
        )
        for name in bench.order(r):
            out[name].append(bench.conversations(name, convs, args.output_tokens))
    else:
        prompts = repetitive_prompts(args.rep_requests, seed)
        texts: dict[str, list[str]] = {}
        for name in bench.order(r):
            results: list[sb.RequestResult] = []
            level = bench.closed_loop(name, prompts, 1, args.rep_output_tokens, results)
            texts[name] = ["".join(x.text) if x.error is None else None for x in results]
            out[name].append(level)
        base = texts.get(RINGSERVE)
        for name in bench.servers:  # greedy: every ringserve configuration must write the defaults' text
            if name.startswith(RINGSERVE) and name != RINGSERVE and base is not None:
                pairs = [(a, b) for a, b in zip(texts[name], base) if a is not None and b is not None]
                out[name][-1]["text_compared"] = len(pairs)
                out[name][-1]["text_mismatches"] = sum(a != b for a, b in pairs)
        if LLAMA in texts and base is not None:  # for reference only: two engines' numerics differ
            pairs = [(a, b) for a, b in zip(texts[LLAMA], base) if a is not None and b is not None]
            out[LLAMA][-1]["text_compared"] = len(pairs)
            out[LLAMA][-1]["text_mismatches"] = sum(a != b for a, b in pairs)
    for name, levels in out.items():
        for lv in levels:
            print(f"  round {r} {workload} {name}: {brief(lv)}", flush=True)
    return out


def brief(lv: dict) -> str:
    fmt = report.fmt
    return (
        f"c={lv['concurrency']} failed={lv['failed']} out tok/s={lv['output_throughput']:.1f} "
        f"TTFT p50={fmt(lv['ttft_ms']['p50'])} ms ITL/token p50={fmt(lv.get('itl_token_ms', {}).get('p50'), '.2f')} "
        f"ms TPOT p50={fmt(lv['tpot_ms']['p50'], '.2f')} ms load={lv['loadavg_before'][0]:.1f}"
        + (f" mismatches={lv['text_mismatches']}/{lv['text_compared']}" if "text_compared" in lv else "")
    )


# ---------------------------------------------------------------- summary


def metric(lv: dict, key: str) -> float | None:
    """A level's number by its summary key: 'output_throughput', 'ttft_p50', 'itl_p50', ..."""
    if key in ("output_throughput", "request_throughput", "failed"):
        return lv[key]
    stat, _ = key.rsplit("_", 1)
    value = {
        "ttft": lv["ttft_ms"],
        "itl": lv.get("itl_token_ms", {}),
        "tpot": lv["tpot_ms"],
        "e2e": lv["e2e_ms"],
        "ttftlater": lv.get("ttft_later_turns_ms", {}),
    }[stat]
    return value.get("p50")


SUMMARY_KEYS = (
    "output_throughput",
    "request_throughput",
    "ttft_p50",
    "itl_p50",
    "tpot_p50",
    "e2e_p50",
    "ttftlater_p50",
)
RATIO_KEYS = ("output_throughput", "ttft_p50", "itl_p50", "tpot_p50", "ttftlater_p50")


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize_rounds(rounds: list[dict], servers: list[str]) -> list[dict]:
    """Per (workload, level): each server's medians over the rounds, and the medians of the
    rounds' ratios of each ringserve configuration to llama.cpp and to ringserve's defaults."""
    keys = []
    for rd in rounds:
        for workload, per_server in rd["workloads"].items():
            for i, lv in enumerate(next(iter(per_server.values()))):
                if (workload, i, lv["concurrency"]) not in keys:
                    keys.append((workload, i, lv["concurrency"]))
    rows = []
    for workload, i, c in keys:
        levels = {
            name: [rd["workloads"][workload][name][i] for rd in rounds if workload in rd["workloads"]]
            for name in servers
        }
        row = {"workload": workload, "concurrency": c, "servers": {}}
        for name, lvs in levels.items():
            row["servers"][name] = {
                **{k: median([metric(lv, k) for lv in lvs]) for k in SUMMARY_KEYS},
                "failed": sum(lv["failed"] for lv in lvs),
                "requests": sum(lv["num_requests"] for lv in lvs),
                "uncounted_tokens": sum(lv.get("uncounted_tokens", 0) for lv in lvs),
                "cached_tokens_mean": median([lv.get("cached_tokens_mean") for lv in lvs]),
                "server_cpu_us_per_token": median([lv.get("server_cpu_us_per_token") for lv in lvs]),
                **(
                    {
                        "text_mismatches": sum(lv["text_mismatches"] for lv in lvs),
                        "text_compared": sum(lv["text_compared"] for lv in lvs),
                    }
                    if all("text_compared" in lv for lv in lvs) and lvs
                    else {}
                ),
            }
        for base in (LLAMA, RINGSERVE):
            if base not in levels:
                continue
            for name in servers:
                if not name.startswith(RINGSERVE) or name == base:
                    continue
                row["servers"][name][f"vs_{base}"] = {
                    k: median(
                        [
                            a / b
                            for x, y in zip(levels[name], levels[base])
                            if (a := metric(x, k)) is not None and (b := metric(y, k))
                        ]
                    )
                    for k in RATIO_KEYS
                }
        rows.append(row)
    return rows


def check_targets(rows: list[dict], servers: list[str], off_configs: list[str]) -> list[dict]:
    """The TARGET_* bounds that the measured rows allow, each with its value and pass/fail."""
    out = []

    def add(name: str, value: float | None, bound: float, above: bool, failed: int = 0) -> None:
        met = value is not None and (value >= bound if above else value <= bound) and failed == 0
        out.append({"target": name, "value": value, "bound": bound, "failed": failed, "met": met})

    for row in rows:
        wl, c = row["workload"], row["concurrency"]
        rs = row["servers"].get(RINGSERVE)
        if rs is None:
            continue
        vs = rs.get(f"vs_{LLAMA}")
        if vs is not None and wl == "random" and c == 1:
            add(
                f"random c=1: output tok/s / llama.cpp's >= {TARGET_C1_TOKENS_RATIO:g}",
                vs["output_throughput"],
                TARGET_C1_TOKENS_RATIO,
                True,
            )
            add(
                f"random c=1: ITL p50 / llama.cpp's <= {TARGET_C1_ITL_RATIO:g}",
                vs["itl_p50"],
                TARGET_C1_ITL_RATIO,
                False,
            )
            add(
                f"random c=1: TTFT p50 / llama.cpp's <= {TARGET_C1_TTFT_RATIO:g}",
                vs["ttft_p50"],
                TARGET_C1_TTFT_RATIO,
                False,
            )
            for name in off_configs:
                off_vs = row["servers"].get(name, {}).get(f"vs_{LLAMA}")
                if off_vs is not None:
                    add(
                        f"random c=1, `{name}`: output tok/s / llama.cpp's >= 1.0",
                        off_vs["output_throughput"],
                        TARGET_OFF_C1_TOKENS_RATIO,
                        True,
                    )
        if vs is not None and wl == "random" and c in TARGET_BATCH_TOKENS_RATIOS:
            bound = TARGET_BATCH_TOKENS_RATIOS[c]
            add(
                f"random c={c}: output tok/s / llama.cpp's >= {bound:g}, no failed request",
                vs["output_throughput"],
                bound,
                True,
                rs["failed"],
            )
        if vs is not None and wl == "shared_prefix":
            add(
                "shared prefix: output tok/s / llama.cpp's >= 5",
                vs["output_throughput"],
                TARGET_SHARED_TOKENS_RATIO,
                True,
            )
            add("shared prefix: TTFT p50 / llama.cpp's <= 0.3", vs["ttft_p50"], TARGET_SHARED_TTFT_RATIO, False)
        if wl == "repetitive":
            for name in off_configs:  # the defaults speculate; `name` does not
                off = row["servers"].get(name, {})
                ratio = off.get(f"vs_{RINGSERVE}", {}).get("itl_p50")
                if ratio:
                    add(
                        f"repetitive c=1: the defaults' ITL p50 / `{name}`'s (speculation off) <= 0.5, same text",
                        1 / ratio,
                        TARGET_SPEC_ITL_RATIO,
                        False,
                        off.get("text_mismatches", 0) + off["failed"],
                    )
    return out


def check_server_targets(servers: dict[str, dict]) -> list[dict]:
    """Memory and start-up of ringserve's defaults against llama.cpp's (issue 28's bounds)."""
    ours, peer = servers.get(RINGSERVE, {}), servers.get(LLAMA, {})
    pairs = [
        ("RSS of all processes / llama.cpp's <= 1.5", "rss_mb", "rss", TARGET_RSS_RATIO),
        ("time to healthy / llama.cpp's <= 2", "startup_s", None, TARGET_STARTUP_RATIO),
    ]
    out = []
    for name, key, sub, bound in pairs:
        a, b = ours.get(key), peer.get(key)
        if a is None or b is None:
            continue
        a, b = (a[sub], b[sub]) if sub else (a, b)
        value = a / b if b else None
        met = value is not None and value <= bound
        out.append({"target": name, "value": value, "bound": bound, "failed": 0, "met": met})
    return out


# ---------------------------------------------------------------- output


def markdown(result: dict) -> str:
    fmt = report.fmt
    servers = list(result["servers"])
    lines = []
    if result["llama_cpp"].get("skipped"):
        lines += [f"**llama.cpp skipped**: {result['llama_cpp']['skipped']}", ""]
    lines += [
        report.table(
            ("server", "command", "start s", "RSS MB (peak), all processes", "status"),
            [
                (
                    name,
                    f"`{shlex.join(s['argv'])}`",
                    fmt(s.get("startup_s")),
                    f"{fmt(s['rss_mb']['rss'])} ({fmt(s['rss_mb']['peak'])})" if "rss_mb" in s else "",
                    s.get("status", "up"),
                )
                for name, s in result["servers"].items()
            ],
        ),
        "",
    ]
    memory = rss_table(result["servers"])
    if memory:
        lines += ["Resident MB by process (VmRSS): healthy, after the rounds (end), idle after them:", "", memory, ""]
    llama = result["servers"].get(LLAMA)
    if llama is not None:
        lines += [f"llama.cpp: {llama['version']}; built with {llama.get('build', 'unknown')}", ""]
    rows = []
    for row in result["summary"]:
        for name in servers:
            s = row["servers"].get(name)
            if s is None:
                continue
            vs = s.get(f"vs_{LLAMA}", {})
            rows.append(
                (
                    row["workload"],
                    row["concurrency"],
                    name,
                    f"{s['requests'] - s['failed']}/{s['requests']}",
                    fmt(s["output_throughput"]),
                    fmt(s["ttft_p50"], ".0f"),
                    fmt(s["itl_p50"], ".2f"),
                    fmt(s["tpot_p50"], ".2f"),
                    fmt(s["e2e_p50"], ".0f"),
                    fmt(s["ttftlater_p50"], ".0f"),
                    fmt(s["cached_tokens_mean"], ".0f"),
                    fmt(s["server_cpu_us_per_token"], ".0f"),
                    fmt(vs.get("output_throughput"), ".2f"),
                    fmt(vs.get("ttft_p50"), ".2f"),
                    fmt(vs.get("itl_p50"), ".2f"),
                    f"{s['text_mismatches']}/{s['text_compared']}" if "text_compared" in s else "-",
                )
            )
    lines += [
        report.table(
            (
                "workload",
                "conc",
                "server",
                "ok",
                "out tok/s",
                "TTFT p50 ms",
                "ITL p50 ms",
                "TPOT p50 ms",
                "E2E p50 ms",
                "TTFT turns 2+ ms",
                "cached prompt tok",
                "server CPU µs/tok",
                "tok/s ÷ llama.cpp",
                "TTFT ÷ llama.cpp",
                "ITL ÷ llama.cpp",
                "text ≠ defaults'",
            ),
            rows,
        ),
        "",
    ]
    extra = [
        (row["workload"], row["concurrency"], name, *(fmt(s[f"vs_{RINGSERVE}"].get(k), ".2f") for k in RATIO_KEYS))
        for row in result["summary"]
        for name, s in row["servers"].items()
        if f"vs_{RINGSERVE}" in s
    ]
    if extra:
        lines += [
            "Each extra ringserve configuration against ringserve's defaults (medians of the rounds' ratios):",
            "",
            report.table(
                ("workload", "conc", "server", "tok/s", "TTFT p50", "ITL p50", "TPOT p50", "TTFT turns 2+"), extra
            ),
            "",
        ]
    if result["targets"]:
        lines += [
            report.table(
                ("target", "value", "failed", "result"),
                [
                    (t["target"], fmt(t["value"], ".2f"), t["failed"], "pass" if t["met"] else "**FAIL**")
                    for t in result["targets"]
                ],
            ),
            "",
        ]
    per_turn = [
        (
            name,
            t["turn"],
            fmt(t["prompt_tokens_mean"], ".0f"),
            fmt(t["cached_tokens_mean"], ".0f"),
            fmt(t["ttft_ms"]["p50"], ".0f"),
        )
        for rd in result["rounds"][-1:]
        for name, lvs in rd["workloads"].get("multi_turn", {}).items()
        for lv in lvs
        for t in lv["turns"]
    ]
    if per_turn:
        lines += [
            "Multi-turn, last round, by turn:",
            "",
            report.table(("server", "turn", "prompt tok", "cached prompt tok", "TTFT p50 ms"), per_turn),
            "",
        ]
    wl = result["workload"]
    lines += ["Workloads:", "", *(f"- {name}: {wl[name]}" for name in wl["run"])]
    lines.append(
        f"\n{result['rounds_run']} rounds, servers in rotating order; streamed /v1/completions, ignore_eos, "
        f"temperature 0, `logprobs: 1` on every server (a chunk's tokens: its logprobs entries; ITL per token as "
        f"SGLang's bench_serving splits a chunk of n tokens; TPOT (e2e - TTFT) / (tokens - 1)). Ratios are medians "
        f"of the rounds' ratios; load is in the header (a loaded 2-core machine moves absolute numbers by up to 2x)."
        + ("" if result["complete"] else " **Incomplete run.**")
    )
    return "\n".join(lines)


def rss_table(servers: dict[str, dict]) -> str:
    """Each server's resident MB by role at each time it was read, a row a server and time."""
    phases = {name: s["rss_by_role_mb"] for name, s in servers.items() if "rss_by_role_mb" in s}
    roles = list(dict.fromkeys(role for by in phases.values() for roles in by.values() for role in roles))
    roles = [r for r in roles if r != "total"] + ["total"]
    rows = [
        (name, phase, *(report.fmt(by_role.get(role), ".0f") for role in roles))
        for name, by in phases.items()
        for phase, by_role in by.items()
    ]
    return report.table(("server", "time", *roles), rows) if rows else ""


def print_summary(result: dict) -> None:
    for row in result["summary"]:
        for name, s in row["servers"].items():
            vs = s.get(f"vs_{LLAMA}", {})
            print(
                f"{row['workload']:>13} c={row['concurrency']:<3} {name:<40} "
                f"tok/s={report.fmt(s['output_throughput'])} "
                f"TTFT={report.fmt(s['ttft_p50'], '.0f')} ITL={report.fmt(s['itl_p50'], '.2f')} "
                f"failed={s['failed']} tok/s÷llama={report.fmt(vs.get('output_throughput'), '.2f')}"
            )
    for t in result["targets"]:
        print(f"  {t['target']}: {report.fmt(t['value'], '.2f')} -> {'pass' if t['met'] else 'FAIL'}")


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: $LLAMA_SERVER, then PATH)")
    ap.add_argument("--llama-args", default="", help="more llama-server flags, one string")
    ap.add_argument(
        "--llama-slot-context",
        type=int,
        default=None,
        help="context per llama.cpp slot (-c is 32 times it; default: the smallest power of two from 512 "
        "that holds the longest request of the workloads run: a larger -c slows llama.cpp's server)",
    )
    ap.add_argument(
        "--gguf", default=None, help="the GGUF file every server serves (default: ringserve's embedded model)"
    )
    ap.add_argument(
        "--ringserve-args",
        action="append",
        default=None,
        help=f"one more ringserve configuration (serve flags, one string; repeatable; default {OFF_ARGS!r}; "
        f"'' for none)",
    )
    ap.add_argument(
        "--ringserve-tree",
        action="append",
        default=[],
        type=Path,
        help="one more ringserve server, with its defaults, run from this code tree (repeatable)",
    )
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds idle after the rounds before the last RSS read")
    ap.add_argument("--null-model", action="store_true", help="ringserve servers on the null model (a smoke run)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32", help="random workload's levels")
    ap.add_argument("--num-requests", default="8,32,64", help="random workload's requests per level a round")
    ap.add_argument("--prompt-tokens", type=int, default=110)
    ap.add_argument("--output-tokens", type=int, default=64, help="random and multi-turn workloads")
    ap.add_argument("--sp-groups", type=int, default=4)
    ap.add_argument("--sp-per-group", type=int, default=16)
    ap.add_argument("--sp-system-tokens", type=int, default=1024)
    ap.add_argument("--sp-question-tokens", type=int, default=64)
    ap.add_argument("--sp-output-tokens", type=int, default=32)
    ap.add_argument("--sp-concurrency", type=int, default=16)
    ap.add_argument("--mt-conversations", type=int, default=8, help="multi-turn: conversations at once")
    ap.add_argument("--mt-turns", type=int, default=4)
    ap.add_argument("--mt-first-tokens", type=int, default=400, help="multi-turn: the first message's words")
    ap.add_argument("--mt-next-tokens", type=int, default=32)
    ap.add_argument("--rep-requests", type=int, default=4, help="repetitive: requests a round (concurrency 1)")
    ap.add_argument("--rep-output-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=4, help="requests per server before the first round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    report.add_arguments(ap, "peer")  # the servers' logs go beside it too
    args = ap.parse_args(argv)
    try:
        args.levels = sb.parse_list(args.concurrency, int)
        counts = sb.parse_list(args.num_requests, int)
    except ValueError:
        ap.error("--concurrency and --num-requests must be comma lists of integers")
    if len(counts) == 1:
        counts *= len(args.levels)
    if len(counts) != len(args.levels):
        ap.error("--num-requests needs one count or one per --concurrency level")
    args.request_counts = dict(zip(args.levels, counts))
    args.workload_list = sb.parse_list(args.workloads)
    if not args.workload_list or not set(args.workload_list) <= set(WORKLOADS):
        ap.error(f"--workloads must be a comma list of {', '.join(WORKLOADS)}")
    for name in ("rounds", "prompt_tokens", "output_tokens", "rep_requests", "sp_groups", "mt_turns"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.levels + counts) < 1:
        ap.error("--concurrency and --num-requests must be at least 1")
    if args.llama_slot_context is None:
        args.llama_slot_context = slot_context(args)
    extra = [OFF_ARGS] if args.ringserve_args is None else [a for a in args.ringserve_args if a.strip()]
    # name -> (serve flags, code tree: None for this one)
    args.ringserve_configs = {
        RINGSERVE: ([], None),
        **{f"{RINGSERVE} {a}": (shlex.split(a), None) for a in extra},
        **{f"{RINGSERVE} @{tree_name(t)}": ([], t) for t in args.ringserve_tree},
    }
    return args


def tree_name(tree: Path) -> str:
    """A code tree's commit (short hash), else its path."""
    proc = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else str(tree)


def slot_context(args: argparse.Namespace) -> int:
    """The smallest power of two from 512 that holds the longest request (prompt, template and
    output tokens) of the workloads run, so that llama.cpp runs at its best: its server slows
    with -c even where the requests use a fraction of it."""
    longest = {
        "random": args.prompt_tokens + args.output_tokens,
        "shared_prefix": args.sp_system_tokens + args.sp_question_tokens + args.sp_output_tokens,
        "multi_turn": args.mt_first_tokens
        + (args.mt_turns - 1) * args.mt_next_tokens
        + args.mt_turns * args.output_tokens,
        # code tokenizes to fewer tokens than it has characters by half
        "repetitive": max(len(p) for p in repetitive_prompts(1, args.seed)) // 2 + args.rep_output_tokens,
    }
    return slot_context_for(max(longest[w] for w in args.workload_list))


def slot_context_for(longest: int) -> int:
    """The smallest power of two from 512 that holds a request of `longest` prompt and output
    tokens with room for the chat template's tokens and words' drift."""
    need = longest * 5 // 4 + 64
    return max(512, 1 << (need - 1).bit_length())


def start_servers(args, llama_bin: str | None, result: dict) -> dict[str, object]:
    """Every server started at once, then waited for; one that does not start is reported
    (llama.cpp, or an extra ringserve configuration whose flags this tree does not know yet)
    and left out. Ringserve's defaults must start."""
    from gpu.models.model_files import default_model_path

    args.out.parent.mkdir(parents=True, exist_ok=True)
    started: dict[str, object] = {}
    if llama_bin is not None:
        gguf = args.gguf or str(default_model_path())
        llama_args = [
            *("-np", str(LLAMA_SLOTS), "-t", "2", "-c", str(LLAMA_SLOTS * args.llama_slot_context)),
            *shlex.split(args.llama_args),
        ]
        started[LLAMA] = LlamaServer(llama_bin, gguf, llama_args, args.out.with_name("peer_server_llama.log"))
        result["servers"][LLAMA] = {
            "argv": started[LLAMA].argv,
            "version": llama_version(llama_bin),
            "build": llama_build(llama_bin),
        }
    for i, (name, (extra, tree)) in enumerate(args.ringserve_configs.items()):
        model = ["--model-path", args.gguf] if args.gguf and not args.null_model else []
        flags = [*(["--null-model"] if args.null_model else []), *model, *extra]
        started[name] = sb.Server(flags, args.out.with_name(f"peer_server_ringserve{i}.log"), tree)
        result["servers"][name] = {"argv": ["python", *started[name].argv[1:]]}
        if tree is not None:
            result["servers"][name]["tree"] = str(tree)
    up = {}
    try:
        for name, server in started.items():
            try:
                result["servers"][name]["startup_s"] = server.wait_healthy()
                up[name] = server
            except (RuntimeError, TimeoutError) as e:
                why = f"did not start: {e}: {log_tail(server.log)}"
                result["servers"][name]["status"] = why
                result["leftovers"][name] = server.stop()
                print(f"{name} {why}", flush=True)
                if name == RINGSERVE:
                    raise
    except BaseException:
        for name, server in started.items():
            if name not in result["leftovers"]:
                result["leftovers"][name] = server.stop()
        raise
    return up


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_at = report.start(args, argv)
    llama_bin = find_llama_server(args.llama_server)
    result: dict = {
        "llama_cpp": {},
        "servers": {},
        "workload": {
            "endpoint": COMPLETIONS,
            "null_model": args.null_model,
            "random": f"~{args.prompt_tokens}-token prompts, {args.output_tokens} output tokens, concurrency "
            f"{args.levels} with {[args.request_counts[c] for c in args.levels]} requests a round",
            "shared_prefix": f"{args.sp_groups} groups x {args.sp_per_group} prompts, {args.sp_system_tokens}-token "
            f"system prompt, {args.sp_question_tokens}-token question, {args.sp_output_tokens} output tokens, "
            f"concurrency {args.sp_concurrency}",
            "multi_turn": f"{args.mt_conversations} conversations at once x {args.mt_turns} turns, first message "
            f"~{args.mt_first_tokens} tokens, next ~{args.mt_next_tokens}, {args.output_tokens} output tokens",
            "repetitive": f"{args.rep_requests} requests a round at concurrency 1, a {len(CODE)}-character code "
            f"file to rewrite, {args.rep_output_tokens} output tokens",
            "run": args.workload_list,
        },
        "rounds_run": 0,
        "complete": False,
        "rounds": [],
        "summary": [],
        "targets": [],
        "leftovers": {},
    }
    if llama_bin is None:
        why = (
            f"no llama-server at {args.llama_server!r}"
            if args.llama_server
            else "no llama-server (--llama-server PATH, $LLAMA_SERVER or on PATH)"
        )
        result["llama_cpp"]["skipped"] = why
        print(f"llama.cpp skipped: {why}; ringserve's servers only", flush=True)
    else:
        result["llama_cpp"]["binary"] = llama_bin
    servers = start_servers(args, llama_bin, result)
    for name, server in servers.items():
        result["servers"][name]["rss_by_role_mb"] = {"healthy": rss_by_role(server)}
    bench = None
    try:
        tokenizer = sb.load_tokenizer(None if args.null_model else args.gguf)
        bench = Bench(servers, args)
        result["client_loop"] = bench.loop_name
        if args.warmup:
            warm, _ = sb.make_prompts(tokenizer, args.warmup, args.prompt_tokens, args.seed, RawCounter(tokenizer))
            for name in servers:
                bench.closed_loop(name, warm, min(args.warmup, 4), args.output_tokens)
        for r in range(args.rounds):
            rd = {"round": r, "order": bench.order(r), "workloads": {}}
            for workload in args.workload_list:
                rd["workloads"][workload] = run_workload(bench, workload, r, tokenizer, args)
            result["rounds"].append(rd)
            result["rounds_run"] = r + 1
        result["complete"] = True
    finally:
        if bench is not None:
            sb.cancel_pending(bench.loop)
            bench.loop.close()
        for name, server in servers.items():
            result["servers"][name]["rss_mb"] = tree_rss_mb(server.cpu_ticks())
            result["servers"][name]["rss_by_role_mb"]["end"] = rss_by_role(server)
        if result["complete"] and args.idle_s > 0:
            time.sleep(args.idle_s)
            for name, server in servers.items():
                result["servers"][name]["rss_by_role_mb"]["idle"] = rss_by_role(server)
        for name, server in servers.items():
            result["leftovers"][name] = server.stop()
        names = list(servers)
        off = [n for n in names if OFF_ARGS in n]
        result["summary"] = summarize_rounds(result["rounds"], names)
        result["targets"] = check_targets(result["summary"], names, off) + check_server_targets(result["servers"])
        report.write_results("peer", result, markdown(result), started_at, out=args.out)
    print_summary(result)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    left = [v for v in result["leftovers"].values() if v["processes"] or v["shm_segments"] or v["engine_files"]]
    failed = sum(s["failed"] for row in result["summary"] for s in row["servers"].values())
    return 1 if left or failed else 0


if __name__ == "__main__":
    sys.exit(main())
