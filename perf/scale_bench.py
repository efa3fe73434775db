"""How cost grows with the model, against llama.cpp's server: random-weight Llamas shaped like
Llama-3.2-1B and -3B (perf/random_gguf.py), quantized to Q4_K_M by llama.cpp's own
`llama-quantize`, each served by ringserve (defaults) and llama-server side by side through
perf/peer_bench.py: output tok/s at c=1 and c=8 (~110-token prompts), TTFT of ~1,000-token
prompts, RSS of every process and time to healthy. A table, and a plot (PNG) when matplotlib
is installed.

    python -m perf.scale_bench --llama-server /path/to/build/bin/llama-server   # ~30 min on 2 cores

The files are made once into --cache (several GB); llama-quantize is looked for beside
llama-server. Random weights: the text is noise, the cost is the real shape's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from perf import peer_bench as pb
from perf import report
from perf.random_gguf import SHAPES, write_random_gguf

QUANT = "Q4_K_M"


def model_file(shape: str, cache: Path, quantize: Path) -> Path:
    """The shape's Q4_K_M file, made (F16, then llama-quantize) if the cache lacks it."""
    from gpu.models.model_files import default_model_path

    out = cache / f"random-{shape}-{QUANT.lower()}.gguf"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    f16 = cache / f"random-{shape}-f16.gguf"
    if not f16.exists():
        write_random_gguf(SHAPES[shape], f16.with_suffix(".part"), default_model_path()).rename(f16)
    subprocess.run([str(quantize), str(f16), str(out.with_suffix(".part")), QUANT, "2"], check=True)
    out.with_suffix(".part").rename(out)
    f16.unlink()  # the F16 file is only llama-quantize's input
    return out


def peer_run(llama_server: str, gguf: Path, out: Path, rounds: int, flags: list[str]) -> dict:
    """One perf/peer_bench.py run (llama.cpp and ringserve's defaults only); its JSON."""
    argv = [
        "--llama-server",
        llama_server,
        "--gguf",
        str(gguf),
        "--workloads",
        "random",
        "--ringserve-args",
        "",
        "--rounds",
        str(rounds),
        "--warmup",
        "1",
        "--out",
        str(out),
        "--allow-dirty",  # the run's own results, named by commit in this benchmark's
        *flags,
    ]
    pb.main(argv)
    return json.loads(out.read_text())


def rows_of(shape: str, gguf: Path, decode: dict, prefill: dict) -> list[dict]:
    rows = []
    for server in (pb.LLAMA, pb.RINGSERVE):
        levels = {r["concurrency"]: r["servers"].get(server, {}) for r in decode["summary"]}
        first = prefill["summary"][0]["servers"].get(server, {})
        facts = decode["servers"].get(server, {})
        rows.append(
            {
                "shape": shape,
                "parameters": SHAPES[shape].num_parameters,
                "file_gib": gguf.stat().st_size / 2**30,
                "server": server,
                "c1_tok_s": levels.get(1, {}).get("output_throughput"),
                "c8_tok_s": levels.get(8, {}).get("output_throughput"),
                "ttft_1k_ms": first.get("ttft_p50"),
                "rss_mb": facts.get("rss_mb", {}).get("rss"),
                "startup_s": facts.get("startup_s"),
                "failed": sum(v.get("failed", 0) for v in levels.values()) + first.get("failed", 0),
                "argv": facts.get("argv"),
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    table = report.table(
        ["model", "parameters", "file GiB", "server", "c=1 tok/s", "c=8 tok/s", "TTFT 1k p50 ms", "RSS MB", "start s"],
        [
            (
                r["shape"],
                f"{r['parameters'] / 1e9:.2f}B",
                report.fmt(r["file_gib"], ".2f"),
                r["server"],
                report.fmt(r["c1_tok_s"]),
                report.fmt(r["c8_tok_s"]),
                report.fmt(r["ttft_1k_ms"], ".0f"),
                report.fmt(r["rss_mb"], ".0f"),
                report.fmt(r["startup_s"]),
            )
            for r in rows
        ],
    )
    ratios = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        llama, ours = (
            next(r for r in rows if r["shape"] == shape and r["server"] == s) for s in ("llama.cpp", "ringserve")
        )

        def ratio(key: str, llama=llama, ours=ours) -> str:
            return report.fmt(ours[key] / llama[key], ".2f") if ours[key] and llama[key] else "-"

        ratios.append((shape, *(ratio(k) for k in ("c1_tok_s", "c8_tok_s", "ttft_1k_ms", "rss_mb", "startup_s"))))
    return (
        table
        + "\n\nringserve ÷ llama.cpp\n\n"
        + report.table(["model", "c=1 tok/s", "c=8 tok/s", "TTFT 1k", "RSS", "start"], ratios)
    )


def plot(rows: list[dict], path: Path) -> bool:
    """tok/s (c=1, c=8) and TTFT against parameters, per server; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in zip(
        axes,
        ("c1_tok_s", "c8_tok_s", "ttft_1k_ms"),
        ("output tok/s, c=1", "output tok/s, c=8", "TTFT p50, 1k prompt (ms)"),
    ):
        for server in dict.fromkeys(r["server"] for r in rows):
            pts = [(r["parameters"] / 1e9, r[key]) for r in rows if r["server"] == server and r[key] is not None]
            ax.plot(*zip(*pts), marker="o", label=server)
        ax.set_title(title)
        ax.set_xlabel("parameters (billions)")
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: $LLAMA_SERVER, then PATH)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "ringserve-scale-bench")
    ap.add_argument("--rounds", type=int, default=2)
    report.add_arguments(ap, "scale")
    args = ap.parse_args(argv)
    started = report.start(args, argv)
    llama_server = pb.find_llama_server(args.llama_server)
    if llama_server is None:
        raise SystemExit("no llama-server (--llama-server, $LLAMA_SERVER or PATH): nothing to compare with")
    quantize = Path(llama_server).with_name("llama-quantize")
    if not quantize.exists():
        raise SystemExit(f"no llama-quantize beside {llama_server}")
    runs = args.out.parent / "scale_runs"
    runs.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        t0 = time.monotonic()
        gguf = model_file(shape, args.cache, quantize)
        print(f"{shape}: {gguf} ready in {time.monotonic() - t0:.0f} s", flush=True)
        decode = peer_run(
            llama_server,
            gguf,
            runs / f"{shape}_decode.json",
            args.rounds,
            ["--concurrency", "1,8", "--num-requests", "4,16", "--output-tokens", "32", "--llama-slot-context", "1536"],
        )
        prefill = peer_run(
            llama_server,
            gguf,
            runs / f"{shape}_prefill.json",
            args.rounds,
            ["--concurrency", "1", "--num-requests", "3", "--prompt-tokens", "1000", "--output-tokens", "4"]
            + ["--llama-slot-context", "1536"],
        )
        rows += rows_of(shape, gguf, decode, prefill)
    md = markdown(rows)
    png = args.out.with_suffix(".png")
    if plot(rows, png):
        md += f"\n\n![tok/s and TTFT against parameters]({png.name})"
    md += (
        "\n\nEach model: two perf/peer_bench.py runs (their JSON in scale_runs/), llama.cpp and ringserve's defaults "
        f"up at once, {args.rounds} interleaved rounds: the random workload at c=1 (4 requests a round) and c=8 (16), "
        "~110-token prompts, 32 output tokens; then 3 prompts of ~1,000 tokens at c=1, 4 output tokens, for TTFT. "
        "llama.cpp: `-np 32 -t 2 -c 49152`. RSS: every process of the server after the decode run."
    )
    report.write_results("scale", {"rows": rows}, md, started, out=args.out)
    print(md)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
