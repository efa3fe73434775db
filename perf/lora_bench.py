"""What LoRA adapters cost a server: 32 concurrent streams spread over 8 adapters against the
same 32 streams on the base model alone, both on one server started with the 8 adapters, the
two workloads alternating round by round (the order rotating), the ratios taken per round.

- the null model (instant tokens, `--null-model --enable-lora`: the adapters are registered,
  checked and held by their requests, no delta is computed): the server's own CPU per streamed
  token, adapters ÷ base (target: at most 1.2);
- the model (`--model-path`, default the embedded SmolLM2-135M-Instruct GGUF, served in its
  default mode): output tokens/s, adapters ÷ base (target: at least 0.7);
- the C decode loop apart (`step`): one 32-row decode step of the model (its default mode)
  with every row on an adapter (4 rows each of the 8) against the same step on the base, one
  torch thread, CPU time, the two alternating (no server);
- beside the model's server, llama.cpp's `llama-server` (--llama-server PATH, else
  $LLAMA_SERVER, else PATH; skipped without one) on the same GGUF with one of the adapters
  (`--lora`, the adapter converted to llama.cpp's GGUF LoRA form), `-np 32 -t 2` and a context
  of 32 slots sized as perf/peer_bench.py sizes them: the same 32 streams, its rounds
  interleaved with ringserve's; output tok/s, ringserve's adapters ÷ llama.cpp (target: at
  least 2).

The resident memory of every process of each server is read after the rounds. The adapters
are random PEFT adapters (rank `--rank`, every attention and MLP projection,
random non-zero A and B) written for the model's shapes into a temporary directory.

    python -m perf.lora_bench --llama-server ~/llama.cpp/build/bin/llama-server  # ~10 min, 2 cores
    python -m perf.lora_bench --parts null --rounds 5
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import tempfile
from pathlib import Path

import numpy as np
import orjson
import torch

from gpu.models.gguf_file import GGUFFile
from gpu.models.model_config import ModelConfig
from perf import peer_bench as peer
from perf import report
from perf import serving_bench as sb

TARGET_CPU_RATIO = 1.2  # null model: server CPU per token with adapters / without, at most
TARGET_THROUGHPUT_RATIO = 0.7  # the model: output tok/s with adapters / without, at least
TARGET_VS_LLAMA = 2.0  # the model: output tok/s with adapters / llama.cpp's with one, at least
BASE, ADAPTERS, LLAMA = "base", "adapters", "llama.cpp"
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


def write_gguf_adapter(
    peft_dir: Path,
    path: Path,
    cfg: ModelConfig,
    arch: str,
    type_name: str = "F32",
    general_type: str = "adapter",
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """The PEFT adapter at `peft_dir` of a model of `cfg` as llama.cpp's convert_lora_to_gguf.py
    writes it for a base of architecture `arch` (its matrices in `type_name`: F32, F16, BF16 or
    Q8_0): general.type, adapter.type, adapter.lora.alpha; each A and B named by gguf's tensor
    map with `.lora_a` / `.lora_b`, a Llama's q/k B rows permuted as the converter permutes the
    base's weights. `general_type` and `extra` tensors (written in `type_name` too) make the
    files a loader must refuse, for tests."""
    import gguf
    from safetensors.torch import load_file

    conf = orjson.loads((peft_dir / "adapter_config.json").read_bytes())
    model_arch = {name: a for a, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(model_arch, cfg.num_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string(gguf.Keys.General.TYPE, general_type)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(conf["lora_alpha"]))
    qtype = gguf.GGMLQuantizationType[type_name]
    tensors = list(load_file(str(peft_dir / "adapter_model.safetensors")).items())
    for key, t in sorted(tensors):
        base_name = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
        base_name = base_name.replace(".lora_B.weight", ".weight")
        gguf_name = names.get_name(base_name, try_suffixes=(".weight",))
        if gguf_name is None:
            raise ValueError(f"{key}: no GGUF name for it in {arch}")
        data = t.float().numpy()
        if arch == "llama" and ".lora_B." in key and base_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_q_heads if "q_proj" in base_name else cfg.num_kv_heads
            # LlamaModel.permute, which the converter runs on the LoRA tensor: B's rows
            data = data.reshape(heads, 2, -1, data.shape[1]).swapaxes(1, 2).reshape(data.shape)
        part = "a" if ".lora_A." in key else "b"
        w.add_tensor(f"{gguf_name}.lora_{part}", gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for name, data in (extra or {}).items():
        w.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="null,model,step", help="which parts: null, model, step (comma-separated)")
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
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: $LLAMA_SERVER, then PATH)")
    ap.add_argument("--llama-args", default="", help="more llama-server flags, one string")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    report.add_arguments(ap, "lora")
    return ap.parse_args(argv)


def rss_by_process(server: sb.Server | peer.LlamaServer) -> list[dict]:
    """Each live process of `server`: its role, resident and peak-resident MB."""
    root = server.proc.pid
    return [
        {
            "role": sb.role_of(sb.proc_title(pid), pid, root) if isinstance(server, sb.Server) else "llama-server",
            "pid": pid,
            **peer.tree_rss_mb({pid: 0}),
        }
        for pid in server.cpu_ticks()
    ]


def llama_build(binary: str) -> str:
    """The CMake options llama-server was built with, from the build tree's CMakeCache.txt
    (bin/ is beside it) where there is one."""
    cache = Path(binary).resolve().parent.parent / "CMakeCache.txt"
    try:
        lines = cache.read_text().splitlines()
    except OSError:
        return "unknown (no CMakeCache.txt beside its bin/)"
    wanted = (
        "CMAKE_BUILD_TYPE",
        "GGML_NATIVE",
        "GGML_AVX2",
        "GGML_AVX512",
        "GGML_AVX512_VNNI",
        "GGML_AMX_INT8",
        "GGML_OPENMP",
        "GGML_BLAS",
        "LLAMA_CURL",
    )
    options = (ln.partition("=") for ln in lines)
    return f"{cache.parent.name}: " + " ".join(
        f"-D{k.split(':')[0]}={v}" for k, _, v in options if k.split(":")[0] in wanted
    )


def start_llama(binary: str, gguf_adapter: Path, args: argparse.Namespace) -> peer.LlamaServer:
    """llama.cpp's server on the model's GGUF with `gguf_adapter` applied to every request
    (`--lora`), its 32 slots and 2 threads as perf/peer_bench.py runs it, each slot's context
    sized as peer_bench sizes it for requests of this length."""
    from gpu.models.model_files import default_model_path

    gguf = args.model_path or str(default_model_path())
    context = peer.LLAMA_SLOTS * peer.slot_context_for(args.prompt_tokens + args.output_tokens)
    flags = [
        *("-np", str(peer.LLAMA_SLOTS), "-t", "2", "-c", str(context)),
        *("--lora", str(gguf_adapter)),
        *shlex.split(args.llama_args),
    ]
    return peer.LlamaServer(binary, gguf, flags, args.out.with_name("lora_server_llama.log"))


def run_part(
    part: str,
    args: argparse.Namespace,
    adapter_flags: list[str],
    prompts: list[str],
    loop,
    llama: tuple[str, Path] | None = None,
) -> dict:
    """Both workloads, `args.rounds` rounds each, on one server of `part` (null or model); with
    `llama` (its binary and the GGUF adapter), llama.cpp's server beside it, its rounds
    interleaved with the two workloads' (the order rotating round by round)."""
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
    servers: dict[str, sb.Server | peer.LlamaServer] = {BASE: server, ADAPTERS: server}
    out: dict = {"server_args": flags, "requests": requests, "output_tokens": w.output_tokens, "rounds": []}
    llama_server = None if llama is None else start_llama(*llama, args)
    try:
        out["startup_s"] = server.wait_healthy()
        names = {BASE: [server.model_name()], ADAPTERS: [f"a{k}" for k in range(args.adapters)]}
        if llama_server is not None and llama is not None:
            out[LLAMA] = {
                "argv": llama_server.argv,
                "version": peer.llama_version(llama[0]),
                "build": llama_build(llama[0]),
                "startup_s": llama_server.wait_healthy(),
            }
            servers[LLAMA] = llama_server
            names[LLAMA] = [llama_server.model_name()]
        bodies = {
            kind: [sb.request_body(models[j % len(models)], prompts[j % len(prompts)], w) for j in range(requests)]
            for kind, models in names.items()
        }
        # every adapter resident once
        warm: dict[sb.Server | peer.LlamaServer, list[bytes]] = {
            server: bodies[ADAPTERS][: args.adapters] + bodies[BASE][:4]
        }
        if llama_server is not None:
            warm[llama_server] = bodies[LLAMA][:4]
        for target, first in warm.items():
            loop.run_until_complete(
                sb.run_closed_loop("127.0.0.1", target.port, first, 4, args.request_timeout, lambda: None, lambda: None)
            )
        kinds = list(names)
        for r in range(args.rounds):
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
            rnd = {
                kind: sb.measure_level(loop, servers[kind], bodies[kind], args.concurrency, w, args.request_timeout)
                for kind in order
            }
            out["rounds"].append(rnd)
            print(
                f"[{part}] round {r + 1}/{args.rounds}: "
                + ", ".join(
                    f"{k} {rnd[k]['output_throughput']:.0f} tok/s, {rnd[k]['server_cpu_us_per_token']:.1f} µs/token"
                    f" ({rnd[k]['failed']} failed)"
                    for k in kinds
                ),
                flush=True,
            )
        out["rss_mb"] = {"ringserve": rss_by_process(server)}
        if llama_server is not None:
            out["rss_mb"][LLAMA] = rss_by_process(llama_server)
    finally:
        sb.cancel_pending(loop)
        out["leftovers"] = server.stop()
        if llama_server is not None:
            out["llama_leftovers"] = llama_server.stop()
    rounds = out["rounds"]
    out["summary"] = {
        kind: {
            "output_tok_s": statistics.median(x[kind]["output_throughput"] for x in rounds),
            "server_cpu_us_per_token": statistics.median(x[kind]["server_cpu_us_per_token"] for x in rounds),
            "failed": sum(x[kind]["failed"] for x in rounds),
        }
        for kind in rounds[0]
    }
    out["throughput_ratio"] = statistics.median(
        x[ADAPTERS]["output_throughput"] / x[BASE]["output_throughput"] for x in rounds
    )
    out["cpu_ratio"] = statistics.median(
        x[ADAPTERS]["server_cpu_us_per_token"] / x[BASE]["server_cpu_us_per_token"] for x in rounds
    )
    if LLAMA in rounds[0]:
        out["vs_llama_ratio"] = statistics.median(
            x[ADAPTERS]["output_throughput"] / x[LLAMA]["output_throughput"] for x in rounds
        )
    return out


def run_step(args: argparse.Namespace, paths: list[Path], trials: int = 7, steps: int = 20) -> dict:
    """A decode step of `args.concurrency` rows through the C decode loop (CpuDecoder) with each
    row on an adapter (row i on adapter i mod n) against the same step on the base: CPU seconds
    per step, one torch thread, `trials` alternating batches of `steps` steps each."""
    import time

    from gpu.forward_batch import SeqInput, build_forward_batch
    from gpu.lora import LoraBatch
    from gpu.model_runner import ModelRunner, ModelRunnerConfig
    from protocol.sampling_params import SamplingParams

    torch.set_num_threads(1)
    rows = args.concurrency
    runner = ModelRunner(
        ModelRunnerConfig(
            model_path=args.model_path,
            max_total_tokens=rows * (args.prompt_tokens + 16),
            max_running_requests=rows,
            enable_lora=True,
            max_loras_per_batch=len(paths),
        )
    )
    if runner.decoder is None or runner.loras is None:
        return {"skipped": f"no C decode loop for this model in mode {runner.quantization}"}
    for lid, path in enumerate(paths, 1):
        runner.loras.register(lid, runner.loras.load(path.name, str(path)))
    rows_lora = np.arange(rows) % len(paths) + 1
    rng = np.random.default_rng(0)
    seqs = []
    with torch.inference_mode():
        for row, lid in enumerate(rows_lora.tolist()):
            prompt = rng.integers(100, 40000, args.prompt_tokens).astype(np.int32)
            pages = runner.pool.alloc(runner.pool.pages_for(args.prompt_tokens + 1))
            runner.set_request(row, SamplingParams(temperature=0.0, lora_id=lid), prompt, np.zeros(0, np.int32))
            token = runner.step([SeqInput(row, prompt, 0, pages, True)]).tokens[:1]
            seqs.append(SeqInput(row, token.astype(np.int32), args.prompt_tokens, pages, True))
        batch = build_forward_batch(seqs, runner.config.page_size, runner.model_config.context_length, runner.device)
        if not runner.decoder.takes(batch.meta):
            return {"skipped": "the C decode loop does not take this batch"}
        kinds = {BASE: None, ADAPTERS: LoraBatch(runner.loras.resident, rows_lora, runner.device)}
        cpu: dict[str, list[float]] = {BASE: [], ADAPTERS: []}
        for t in range(trials):
            for kind in kinds if t % 2 == 0 else reversed(list(kinds)):
                t0 = time.process_time()
                for _ in range(steps):
                    runner.decoder.forward(batch.input_ids, batch.meta, batch.logits_index, kinds[kind])
                cpu[kind].append((time.process_time() - t0) / steps)
    return {
        "rows": rows,
        "mode": runner.quantization,
        "trials": trials,
        "steps_per_trial": steps,
        "cpu_ms_per_step": {k: round(statistics.median(v) * 1e3, 3) for k, v in cpu.items()},
        "ratio": statistics.median(a / b for a, b in zip(cpu[ADAPTERS], cpu[BASE])),
    }


def markdown(data: dict) -> str:
    rows, sizes = [], []
    for part, res in data["parts"].items():
        if part == "step":
            continue
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
    lines = (
        []
        if not rows
        else [
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
            f"{data['adapters']}). {data['rounds']} rounds per workload ({'; '.join(sizes)}), the workloads "
            "alternating; a value is the median over rounds, a ratio the median of the rounds' ratios. "
            f"Targets: the model's tok/s ratio at least {TARGET_THROUGHPUT_RATIO}, the null model's CPU ratio at "
            f"most {TARGET_CPU_RATIO}.",
        ]
    )
    step = data["parts"].get("step")
    if step is not None:
        lines += [""] + (
            [f"Decode step apart: {step['skipped']}."]
            if "skipped" in step
            else [
                f"The C decode loop apart (`step`): one {step['rows']}-row decode step of the model "
                f"({step['mode']}), every row on an adapter, costs **{step['ratio']:.2f}x** the base's step "
                f"({step['cpu_ms_per_step'][ADAPTERS]} ms against {step['cpu_ms_per_step'][BASE]} ms of CPU; one "
                f"torch thread, {step['trials']} alternating trials of {step['steps_per_trial']} steps, the "
                "median of their ratios)."
            ]
        )
    model = data["parts"].get("model", {})
    if LLAMA in model:
        s, llama = model["summary"], model[LLAMA]
        lines += [
            "",
            "## ringserve with 8 adapters against llama.cpp with one",
            "",
            report.table(
                ["server", "output tok/s", "server CPU µs/token", "failed"],
                [
                    (
                        f"ringserve, {data['adapters']} adapters",
                        report.fmt(s[ADAPTERS]["output_tok_s"]),
                        report.fmt(s[ADAPTERS]["server_cpu_us_per_token"]),
                        s[ADAPTERS]["failed"],
                    ),
                    (
                        "llama.cpp, one adapter (`--lora`)",
                        report.fmt(s[LLAMA]["output_tok_s"]),
                        report.fmt(s[LLAMA]["server_cpu_us_per_token"]),
                        s[LLAMA]["failed"],
                    ),
                ],
            ),
            "",
            f"ringserve ÷ llama.cpp: **{model['vs_llama_ratio']:.2f}x** (the median of the rounds' ratios; target "
            f"at least {TARGET_VS_LLAMA}). The same {data['concurrency']} streams and requests; llama.cpp's rounds "
            "interleaved with ringserve's two workloads, the order rotating, both servers up throughout. "
            f"llama.cpp: `{' '.join(Path(a).name if i == 0 else a for i, a in enumerate(llama['argv']))}` "
            f"(the adapter: ringserve's a0 in llama.cpp's GGUF LoRA form, F32); {llama['version']}; "
            f"built with {llama['build']}.",
        ]
    elif "llama" in data:
        lines += ["", f"llama.cpp: {data['llama']}."]
    rss = [
        (part, server, p["role"], p["pid"], report.fmt(p["rss"]), report.fmt(p["peak"]))
        for part, res in data["parts"].items()
        for server, procs in res.get("rss_mb", {}).items()
        for p in procs
    ]
    if rss:
        lines += [
            "",
            "Resident memory after the rounds, every process (MB; shared pages counted in each):",
            "",
            report.table(["part", "server", "process", "pid", "RSS", "peak RSS"], rss),
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
    llama_bin = peer.find_llama_server(args.llama_server) if "model" in parts else None
    if "model" in parts and llama_bin is None:
        data["llama"] = "skipped: no llama-server (--llama-server, $LLAMA_SERVER, PATH)"
    with tempfile.TemporaryDirectory(prefix="lora_bench") as tmp:
        paths = [write_random_adapter(Path(tmp) / f"a{k}", cfg, args.rank, seed=k) for k in range(args.adapters)]
        adapter_flags = ["--lora-paths", *(f"a{k}={p}" for k, p in enumerate(paths))]
        llama = None
        if llama_bin is not None and cfg.gguf_path is not None:
            arch = GGUFFile(cfg.gguf_path).architecture
            llama = (llama_bin, write_gguf_adapter(paths[0], Path(tmp) / "a0.gguf", cfg, arch))
        for part in parts:
            if part == "step":
                data["parts"][part] = run_step(args, paths)
                continue
            data["parts"][part] = run_part(part, args, adapter_flags, prompts, loop, llama if part == "model" else None)
    loop.close()
    md = markdown(data)
    json_path, md_path = report.write_results("lora", data, md, started, out=args.out)
    print(md)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
