"""What LoRA adapters cost a server: 32 concurrent streams spread over 8 adapters against the
same 32 streams on the base model alone, both on one server started with the 8 adapters, the
two workloads alternating round by round (the order rotating), the ratios taken per round.

- the null model (instant tokens, `--null-model --enable-lora`: the adapters are registered,
  checked and held by their requests, no delta is computed): the server's own CPU per streamed
  token, adapters ÷ base (target: at most 1.2);
- the model (`--model-path`, default the embedded SmolLM2-135M-Instruct GGUF, served in its
  default mode): output tokens/s, adapters ÷ base (target: at least 0.7).

The adapters are random PEFT adapters (rank `--rank`, every attention and MLP projection,
random non-zero A and B) written for the model's shapes into a temporary directory.

    python -m perf.lora_bench                       # about 5 minutes on 2 cores
    python -m perf.lora_bench --parts null --rounds 5
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import tempfile
from pathlib import Path

import orjson
import torch

from gpu.models.model_config import ModelConfig
from perf import report
from perf import serving_bench as sb

TARGET_CPU_RATIO = 1.2  # null model: server CPU per token with adapters / without, at most
TARGET_THROUGHPUT_RATIO = 0.7  # the model: output tok/s with adapters / without, at least
BASE, ADAPTERS = "base", "adapters"
PEFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_config(model_path: str | None) -> ModelConfig:
    """The config of the model at `model_path` (None: the embedded one)."""
    from gpu.models.model_files import resolve_model_dir

    return ModelConfig.from_dir(resolve_model_dir(model_path), None)


def write_random_adapter(path: Path, cfg: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) of `rank` on every
    projection of a model of `cfg`, A and B random."""
    from safetensors.torch import save_file

    q, kv = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {  # module -> (in, out)
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, i),
        "mlp.up_proj": (h, i),
        "mlp.down_proj": (i, h),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module, (k, n) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(n, rank, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    conf = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PEFT_TARGETS)}
    (path / "adapter_config.json").write_bytes(orjson.dumps(conf))  # the adapter's, not a result
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="null,model", help="which servers: null, model (comma-separated)")
    ap.add_argument("--model-path", default=None, help="the model (default: the embedded SmolLM2-135M GGUF)")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=64, help="per request, the model's part")
    ap.add_argument("--null-output-tokens", type=int, default=1024, help="per request, the null model's part")
    ap.add_argument("--requests", type=int, default=64, help="per workload and round, the model's part")
    ap.add_argument("--null-requests", type=int, default=256, help="per workload and round, the null model's part")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--server-args", default="", help="more ringserve flags, one string")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    report.add_arguments(ap, "lora")
    return ap.parse_args(argv)


def run_part(part: str, args: argparse.Namespace, adapter_flags: list[str], prompts: list[str], loop) -> dict:
    """Both workloads, `args.rounds` rounds each, on one server of `part` (null or model)."""
    null = part == "null"
    w = sb.Workload(args.prompt_tokens, args.null_output_tokens if null else args.output_tokens)
    requests = args.null_requests if null else args.requests
    flags = [
        *(["--null-model"] if null else []),
        *(["--model-path", args.model_path] if args.model_path else []),
        "--enable-lora",
        "--max-loras-per-batch",
        str(args.adapters),
        "--max-running-requests",
        str(max(64, args.concurrency)),
        *adapter_flags,
        *shlex.split(args.server_args),
    ]
    server = sb.Server(flags, args.out.with_name(f"lora_server_{part}.log"))
    out: dict = {"server_args": flags, "requests": requests, "output_tokens": w.output_tokens, "rounds": []}
    try:
        out["startup_s"] = server.wait_healthy()
        base = server.model_name()
        names = {BASE: [base], ADAPTERS: [f"a{k}" for k in range(args.adapters)]}
        bodies = {
            kind: [sb.request_body(models[j % len(models)], prompts[j % len(prompts)], w) for j in range(requests)]
            for kind, models in names.items()
        }
        warm = bodies[ADAPTERS][: args.adapters] + bodies[BASE][:4]  # every adapter resident once
        loop.run_until_complete(
            sb.run_closed_loop("127.0.0.1", server.port, warm, 4, args.request_timeout, lambda: None, lambda: None)
        )
        for r in range(args.rounds):
            order = [BASE, ADAPTERS] if r % 2 == 0 else [ADAPTERS, BASE]
            rnd = {
                kind: sb.measure_level(loop, server, bodies[kind], args.concurrency, w, args.request_timeout)
                for kind in order
            }
            out["rounds"].append(rnd)
            print(
                f"[{part}] round {r + 1}/{args.rounds}: "
                + ", ".join(
                    f"{k} {rnd[k]['output_throughput']:.0f} tok/s, {rnd[k]['server_cpu_us_per_token']:.1f} µs/token"
                    f" ({rnd[k]['failed']} failed)"
                    for k in (BASE, ADAPTERS)
                ),
                flush=True,
            )
    finally:
        sb.cancel_pending(loop)
        out["leftovers"] = server.stop()
    rounds = out["rounds"]
    out["summary"] = {
        kind: {
            "output_tok_s": statistics.median(x[kind]["output_throughput"] for x in rounds),
            "server_cpu_us_per_token": statistics.median(x[kind]["server_cpu_us_per_token"] for x in rounds),
            "failed": sum(x[kind]["failed"] for x in rounds),
        }
        for kind in (BASE, ADAPTERS)
    }
    out["throughput_ratio"] = statistics.median(
        x[ADAPTERS]["output_throughput"] / x[BASE]["output_throughput"] for x in rounds
    )
    out["cpu_ratio"] = statistics.median(
        x[ADAPTERS]["server_cpu_us_per_token"] / x[BASE]["server_cpu_us_per_token"] for x in rounds
    )
    return out


def markdown(data: dict) -> str:
    rows, sizes = [], []
    for part, res in data["parts"].items():
        sizes.append(f"{part}: {res['requests']} requests of {res['output_tokens']} tokens")
        s = res["summary"]
        rows.append(
            (
                part,
                report.fmt(s[BASE]["output_tok_s"]),
                report.fmt(s[ADAPTERS]["output_tok_s"]),
                report.fmt(res["throughput_ratio"], ".2f"),
                report.fmt(s[BASE]["server_cpu_us_per_token"]),
                report.fmt(s[ADAPTERS]["server_cpu_us_per_token"]),
                report.fmt(res["cpu_ratio"], ".2f"),
                s[BASE]["failed"] + s[ADAPTERS]["failed"],
            )
        )
    lines = [
        report.table(
            [
                "server",
                "base tok/s",
                "adapters tok/s",
                "tok/s ratio",
                "base server CPU µs/token",
                "adapters server CPU µs/token",
                "CPU ratio",
                "failed",
            ],
            rows,
        ),
        "",
        f"{data['concurrency']} concurrent streams (chat completions, {data['prompt_tokens']}-token prompts, "
        f"ignore_eos): `base` all on the base model, `adapters` spread over {data['adapters']} adapters of rank "
        f"{data['rank']} (every attention and MLP projection), all resident (--max-loras-per-batch "
        f"{data['adapters']}). {data['rounds']} rounds per workload ({'; '.join(sizes)}), the two "
        "alternating; a value is the median over rounds, a ratio the median of the rounds' ratios. "
        f"Targets: the model's tok/s ratio at least {TARGET_THROUGHPUT_RATIO}, the null model's CPU ratio at "
        f"most {TARGET_CPU_RATIO}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = report.start(args, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    parts = [p for p in args.parts.split(",") if p]
    tokenizer = sb.load_tokenizer(args.model_path)
    prompts, _ = sb.make_prompts(tokenizer, args.requests, args.prompt_tokens, seed=0)
    loop, _ = sb.new_event_loop()
    data: dict = {
        "adapters": args.adapters,
        "rank": args.rank,
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "parts": {},
    }
    cfg = model_config(args.model_path)
    with tempfile.TemporaryDirectory(prefix="lora_bench") as tmp:
        paths = [write_random_adapter(Path(tmp) / f"a{k}", cfg, args.rank, seed=k) for k in range(args.adapters)]
        adapter_flags = ["--lora-paths", *(f"a{k}={p}" for k, p in enumerate(paths))]
        for part in parts:
            data["parts"][part] = run_part(part, args, adapter_flags, prompts, loop)
    loop.close()
    md = markdown(data)
    json_path, md_path = report.write_results("lora", data, md, started, out=args.out)
    print(md)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
