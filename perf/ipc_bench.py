"""IPC microbenchmark: shared-memory rings vs ZMQ + pickle (SGLang) vs ZMQ + msgpack (vLLM v1),
in one run, between two real processes, through the same channel API the server uses.

Messages: token-out batches of 1, 64 and 256 records (one scheduler step) and request
messages carrying 1k and 8k prompt tokens. Consumer modes: spin, sleep on the eventfd
(ZMQ: blocking poll), spin briefly then sleep (the server's mode).

Per (transport, mode, message), three runs:
  latency     one-way, producer's clock before push to consumer's clock after pop (and
              decode), CLOCK_MONOTONIC in both processes. One message at a time: the
              consumer acks each on a side socket (outside the timed path) and the
              producer waits --gap-us more, so the consumer is idle when the next one
              comes, as between scheduler steps; nothing queues
  CPU µs/msg  thread CPU time inside push (producer) and inside pop, decoding included
              (consumer), in a second run paced the same way. Not in the latency run:
              each thread_time_ns is a syscall (~1-2 µs here), which would land in the
              timed path
  msgs/s      back-to-back pushes (back-pressure included) until the consumer popped them all

    python -m perf.ipc_bench [--latency-messages 1000] [--gap-us 300] [--spin-us 50]
Prints a table; writes perf/results/ipc.json and ipc.md (perf/report.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from ipc import get_transport
from ipc.channel import ChannelSpec
from ipc.handoff import recv_channels, recv_waker, send_channels, send_waker
from ipc.memory import model
from perf import report
from protocol.records import REQUEST, TOKEN_OUT, RequestKind
from protocol.request_records import pack_control, pack_request
from protocol.sampling_params import SamplingParams

TRANSPORTS = ("ring", "zmq", "zmq-msgpack")
LABELS = {"ring": "ring", "zmq": "zmq+pickle", "zmq-msgpack": "zmq+msgpack"}
MODES = ("spin", "sleep", "spin_then_sleep")
END = 0xFFFFFFFF  # gen of the record that ends a run


@dataclass(frozen=True)
class Message:
    name: str
    layout: str  # "token_out" | "request"
    size: int  # records per token-out batch, or prompt tokens per request
    throughput_messages: int


MESSAGES = (
    Message("tokens x1", "token_out", 1, 5000),
    Message("tokens x64", "token_out", 64, 3000),
    Message("tokens x256", "token_out", 256, 2000),
    Message("request 1k", "request", 1024, 2000),
    Message("request 8k", "request", 8192, 500),
)
SPECS = {"token_out": ChannelSpec(TOKEN_OUT, 4096, 1 << 20), "request": ChannelSpec(REQUEST, 256, 16 << 20)}


def build(message: Message, rng: np.random.Generator) -> tuple[np.ndarray, bytes]:
    """One message as the server would send it. Records carry (phase, index) in (gen, slot);
    token-out records carry their position in prompt_tokens and the batch size in
    completion_tokens so the consumer knows when a whole batch arrived."""
    if message.layout == "request":
        params = SamplingParams(max_new_tokens=256, temperature=0.7, top_p=0.95, stop=("\n\nUser:", "</s>"))
        return pack_request(1, 0, 0, params, rng.integers(0, 49152, message.size), time.monotonic_ns())
    recs = np.zeros(message.size, TOKEN_OUT.dtype)
    recs["worker"] = rng.integers(0, 4, message.size)
    recs["token"] = rng.integers(0, 49152, message.size)
    recs["prompt_tokens"] = np.arange(message.size)
    recs["completion_tokens"] = message.size
    recs["cached_tokens"] = rng.integers(0, 512, message.size)
    recs["logprob"] = -rng.random(message.size, np.float32) * 5
    return recs, b""


# ---------------------------------------------------------------- consumer process


def consumer_main(sock_path: str, transport_name: str, mode: str, out: str) -> None:
    transport = get_transport(transport_name)
    waker = transport.make_waker()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sock_path)
    send_waker(sock, waker)
    channels, meta = recv_channels(sock, waker)
    spin_us = {"spin": float("inf"), "sleep": 0.0, "spin_then_sleep": meta["spin_us"]}[mode]
    phases, kinds = meta["phases"], meta["kinds"]  # per phase: messages, "latency" | "cpu" | "throughput"
    recv_ns = [np.zeros(n, np.int64) for n in phases]
    received = np.zeros(len(phases), np.int64)
    cpu_ns = np.zeros(len(phases), np.int64)
    coming = 0  # the phase of the next message: phases run one after the other
    while True:
        got = False
        for ch in channels:
            probe = coming < len(kinds) and kinds[coming] == "cpu"
            cpu0 = time.thread_time_ns() if probe else 0
            batch = ch.pop()
            if batch is None:
                continue
            now = time.monotonic_ns()
            popped_cpu = time.thread_time_ns() - cpu0 if probe else 0
            got = True
            recs = batch.records
            if ch.spec.layout is TOKEN_OUT:
                last = recs[recs["prompt_tokens"] == recs["completion_tokens"] - 1]
            else:
                last = recs
                if last["gen"][-1] == END:
                    np.savez(
                        out,
                        cpu_ns=cpu_ns,
                        wakeups=getattr(waker, "wakeups", 0),
                        **{f"phase{p}": r for p, r in enumerate(recv_ns)},
                    )
                    sock.close()
                    return
            phase = int(recs["gen"][0])
            recv_ns[phase][last["slot"]] = now
            cpu_ns[phase] += popped_cpu
            received[phase] += len(last)
            if received[phase] == phases[phase]:
                coming = phase + 1
            if kinds[phase] != "throughput" and len(last):
                sock.send(b"a")  # paced phase: the producer may send the next message
            elif received[phase] == phases[phase]:
                sock.send(b"d")  # throughput phase complete
        if not got:
            waker.wait_readable(channels, spin_us=spin_us)


# ---------------------------------------------------------------- producer (this process)


def run_pair(transport_name: str, mode: str, args: argparse.Namespace) -> list[dict]:
    transport = get_transport(transport_name)
    waker = transport.make_waker()
    rng = np.random.default_rng(0)
    phases = []  # (message, kind, n_messages)
    for message in MESSAGES:
        phases.append((message, "latency", args.latency_messages))
        phases.append((message, "cpu", args.latency_messages))
        phases.append((message, "throughput", max(1, int(message.throughput_messages * args.throughput_scale))))
    with tempfile.TemporaryDirectory() as tmp:
        sock_path, out = os.path.join(tmp, "bench.sock"), os.path.join(tmp, "consumer.npz")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(sock_path)
        listener.listen(1)
        consumer = subprocess.Popen(
            [sys.executable, "-m", "perf.ipc_bench", "--consumer", sock_path, transport_name, mode, out],
            cwd=report.ROOT,
        )
        conn, _ = listener.accept()
        _, peer_fd = recv_waker(conn)
        channels = {name: transport.create_channel(spec, "producer", waker, peer_fd) for name, spec in SPECS.items()}
        if peer_fd is not None:
            os.close(peer_fd)
        send_channels(
            conn,
            list(channels.values()),
            {"spin_us": args.spin_us, "phases": [p[2] for p in phases], "kinds": [p[1] for p in phases]},
        )
        send_ns, cpu_ns, elapsed_ns = [], [], []
        for phase, (message, kind, n) in enumerate(phases):
            ch = channels[message.layout]
            recs, blob = build(message, rng)
            recs["gen"] = phase
            sent = np.zeros(n, np.int64)
            cpu = 0
            start = time.monotonic_ns()
            for m in range(n):
                recs["slot"] = m
                if kind == "cpu":
                    cpu0 = time.thread_time_ns()
                    ch.push_all(recs, blob, timeout=60)
                    cpu += time.thread_time_ns() - cpu0
                else:
                    t = time.monotonic_ns()
                    ch.push_all(recs, blob, timeout=60)
                    sent[m] = t
                if kind != "throughput":
                    _expect(conn, b"a")
                    time.sleep(args.gap_us * 1e-6)
            if kind == "throughput":
                _expect(conn, b"d")
            elapsed_ns.append(time.monotonic_ns() - start)
            send_ns.append(sent)
            cpu_ns.append(cpu)
        channels["request"].push_all(_end_record(), None, timeout=60)
        consumer.wait(timeout=60)
        got = np.load(out)
        for ch in channels.values():
            ch.close()
        waker.close()
        listener.close()
        conn.close()
    rows: dict[str, dict] = {}
    for phase, (message, kind, n) in enumerate(phases):
        row = rows.setdefault(
            message.name,
            {
                "transport": LABELS[transport_name],
                "mode": mode,
                "message": message.name,
                "consumer_wakeups": int(got["wakeups"]),
            },
        )
        if kind == "latency":
            lat_us = (got[f"phase{phase}"] - send_ns[phase])[args.warmup :] / 1e3
            row.update(
                p50_us=float(np.percentile(lat_us, 50)),
                p99_us=float(np.percentile(lat_us, 99)),
                mean_us=float(lat_us.mean()),
            )
        elif kind == "cpu":
            row.update(producer_cpu_us=cpu_ns[phase] / n / 1e3, consumer_cpu_us=int(got["cpu_ns"][phase]) / n / 1e3)
        else:
            last_recv = int(got[f"phase{phase}"].max())
            row["msgs_per_s"] = n / ((last_recv - int(send_ns[phase][0])) / 1e9)
    return list(rows.values())


def _expect(conn: socket.socket, token: bytes) -> None:
    if conn.recv(1) != token:
        raise RuntimeError("the consumer process died")


def _end_record() -> np.ndarray:
    rec = pack_control(RequestKind.FLUSH_CACHE)
    rec["gen"] = END
    return rec


def targets(rows: list[dict]) -> dict:
    by = {(r["transport"], r["mode"], r["message"]): r for r in rows}
    out = {}
    for mode in MODES:
        ring, pickle_ = by.get(("ring", mode, "tokens x256")), by.get(("zmq+pickle", mode, "tokens x256"))
        if ring and pickle_:
            out[f"{mode}: zmq+pickle p50 / ring p50 at batch 256 (>= 10)"] = pickle_["p50_us"] / ring["p50_us"]
        beats = [
            by[("ring", mode, m.name)]["p50_us"] < by[("zmq+msgpack", mode, m.name)]["p50_us"]
            for m in MESSAGES
            if ("ring", mode, m.name) in by and ("zmq+msgpack", mode, m.name) in by
        ]
        if beats:
            out[f"{mode}: ring p50 beats zmq+msgpack at every size"] = all(beats)
    stts = [by[k]["p99_us"] for k in by if k[0] == "ring" and k[1] == "spin_then_sleep"]
    if stts:
        out["spin_then_sleep: ring worst p99 µs (< 100)"] = max(stts)
    return out


def markdown(rows: list[dict], checks: dict) -> str:
    """One line per (mode, message), the three transports side by side; then the targets."""
    by = {(r["transport"], r["mode"], r["message"]): r for r in rows}
    names = [LABELS[t] for t in TRANSPORTS]
    lines = [
        "| mode | message | "
        + " | ".join(f"{n} p50 / p99 µs" for n in names)
        + " | "
        + " | ".join(f"{n} msgs/s" for n in names)
        + " | "
        + " | ".join(f"{n} producer CPU µs/msg" for n in names)
        + " |",
        "|" + "---|" * (2 + 3 * len(names)),
    ]
    for mode in MODES:
        for m in MESSAGES:
            cells = [by.get((n, mode, m.name)) for n in names]
            if not any(cells):
                continue
            lat = [f"{c['p50_us']:.0f} / {c['p99_us']:.0f}" if c else "" for c in cells]
            rate = [f"{c['msgs_per_s']:.0f}" if c else "" for c in cells]
            cpu = [f"{c['producer_cpu_us']:.1f}" if c else "" for c in cells]
            lines.append(f"| {mode} | {m.name} | " + " | ".join(lat + rate + cpu) + " |")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {line}" for line in target_lines(checks))


def target_lines(checks: dict) -> list[str]:
    return [
        f"{name}: {value:.1f}" if isinstance(value, float) else f"{name}: {value}" for name, value in checks.items()
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latency-messages", type=int, default=1000)
    ap.add_argument("--throughput-scale", type=float, default=1.0, help="scales the back-to-back message counts")
    ap.add_argument("--gap-us", type=float, default=300.0, help="pause after each latency message's ack")
    ap.add_argument("--spin-us", type=float, default=50.0, help="spin window of spin_then_sleep")
    ap.add_argument("--warmup", type=int, default=20, help="latency messages left out of the statistics")
    ap.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=TRANSPORTS)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    report.add_arguments(ap, "ipc")
    args = ap.parse_args()
    if args.latency_messages <= args.warmup:
        ap.error("--latency-messages must exceed --warmup")
    started = report.start(args)
    rows = []
    for mode in args.modes:
        for transport_name in args.transports:
            rows += run_pair(transport_name, mode, args)
    print(
        f"{'transport':<12} {'mode':<16} {'message':<12} {'p50 µs':>8} {'p99 µs':>8} {'msgs/s':>9} "
        f"{'prod CPU µs':>11} {'cons CPU µs':>11}"
    )
    for r in rows:
        print(
            f"{r['transport']:<12} {r['mode']:<16} {r['message']:<12} {r['p50_us']:>8.1f} {r['p99_us']:>8.1f} "
            f"{r['msgs_per_s']:>9.0f} {r['producer_cpu_us']:>11.1f} {r['consumer_cpu_us']:>11.1f}"
        )
    checks = targets(rows)
    for line in target_lines(checks):
        print(f"  {line}")
    mm = model()
    result = {
        "memory_model": {"counters": mm.counters, "barrier": mm.barrier},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "targets": checks,
        "rows": rows,
    }
    print(
        "wrote "
        + " and ".join(map(str, report.write_results("ipc", result, markdown(rows, checks), started, out=args.out)))
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--consumer":
        consumer_main(*sys.argv[2:6])
    else:
        main()
