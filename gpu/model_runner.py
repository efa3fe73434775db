"""The model executor the scheduler calls once per step: weights, paged KV cache, attention
backend and sampler behind one step() over a batch mixing prefill chunks and decodes."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpu import kernels
from gpu.attention import create_backend, default_backend
from gpu.forward_batch import (
    POOL_FIRST,
    POOL_LABELS,
    POOL_LAST,
    POOL_SUM,
    ForwardBatch,
    SeqInput,
    StepInput,
    build_forward_batch,
)
from gpu.kvcache.kv_cache import KVCache
from gpu.kvcache.page_pool import PagePool
from gpu.lora import LoraBatch, LoraPool
from gpu.models.cpu_decode import CpuDecoder
from gpu.models.gguf_file import GGUFFile
from gpu.models.llama import LlamaForCausalLM
from gpu.models.model_config import ModelConfig
from gpu.models.model_files import ModelLoadError, default_model_path, resolve_model_dir
from gpu.models.weights import Weight, load_gguf_weights, load_weights
from gpu.quant.blocks import repack_where_faster
from gpu.quant.gguf_types import BLOCK_TYPES
from gpu.quant.gguf_weight import GGUFWeight
from gpu.quant.loader import ACTIVATIONS, AUTO_QUANTIZATION
from gpu.row_buffer import RowBuffer
from gpu.sampling.sampler import Sampler
from protocol.lora import lora_target_set
from protocol.sampling_params import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {  # besides auto
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8_e5m2": torch.float8_e5m2,
}
# share of the device's memory that weights + KV cache may take when no size is given
DEFAULT_MEM_FRACTION = {"cuda": 0.85, "cpu": 0.3}

__all__ = ["ModelRunner", "ModelRunnerConfig", "PromptLogprobsOut", "SeqInput", "StepInput", "StepOutput"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelRunnerConfig:
    """Each field is the server setting of the same name, with its default: runtime/config.py's
    ServerArgs says what each does (the scheduler process builds this from it by field name).
    max_running_requests sizes the sampler's rows; resolve_quantization decides what auto means."""

    model_path: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str | None = None
    page_size: int = 16
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int = 256
    context_length: int | None = None
    random_seed: int = 0
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    enable_lora: bool = False
    lora_paths: tuple[str, ...] = ()
    max_lora_rank: int | None = None
    lora_target_modules: tuple[str, ...] = ()
    max_loras_per_batch: int = 8


@dataclass(frozen=True)
class PromptLogprobsOut:
    """The prompt logprobs of a step's PromptLogprobsAsk: one entry per asked token, run after run."""

    logprobs: np.ndarray  # float32 [N], of the token each one predicts, from the raw logits
    ranks: np.ndarray  # int64 [N], that token's rank in the vocabulary (1: the likeliest)
    top_ids: np.ndarray  # int32 [N, K], K = the ask's top_k, likeliest first
    top_logprobs: np.ndarray  # float32 [N, K]


@dataclass
class StepOutput:
    """One entry per SeqInput with sample=True, in order."""

    tokens: np.ndarray  # int32 [S]
    logprobs: np.ndarray  # float32 [S], the chosen token's; nan for rows that did not ask
    top_ids: np.ndarray | None  # int32 [S, K], K = the most top_logprobs asked this step
    top_logprobs: np.ndarray | None  # float32 [S, K]
    prompt_logprobs: PromptLogprobsOut | None = None  # when the step's input asked (StepInput.prompt_logprobs)
    pooled: list[np.ndarray] | None = None  # float32, one per StepInput.pool entry, in order


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"--dtype must be one of auto, {', '.join(DTYPES)}, not {dtype!r}")
    return DTYPES[dtype]


def resolve_quantization(quantization: str, model_path: Path, device: torch.device, dtype: torch.dtype) -> str:
    """--quantization auto: AUTO_QUANTIZATION where its kernels can run the model (a .gguf file,
    of any family the forward runs, on a CPU that builds them, in float32), else none (for a
    .gguf: its weights dequantized); other values as they are. AUTO_QUANTIZATION is the fastest
    mode within the quality bound of perf/results/quality.md (mean KL from the exact mode <=
    0.01 nats/token, perplexity within 1%)."""
    if quantization != "auto":
        return quantization
    runs = (
        model_path.suffix == ".gguf"
        and device.type == "cpu"
        and dtype == torch.float32
        and kernels.cpu_kernels_available()
    )
    return AUTO_QUANTIZATION if runs else "none"


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, attention_backend: str, quantization: str
) -> torch.dtype:
    """--kv-cache-dtype auto: float16 where the weights run with int8 activations (the fast
    path, lossy already: half the cache's bytes within its quality bound), else the model's
    dtype (the exact modes stay exact)."""
    if kv_cache_dtype == "auto":
        if ACTIVATIONS.get(quantization) != "q8" or attention_backend not in ("cpu", "torch"):
            return model_dtype
        kv_cache_dtype = "float16"
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ModelLoadError(
            f"--kv-cache-dtype must be one of auto, {', '.join(KV_CACHE_DTYPES)}, not {kv_cache_dtype!r}"
        )
    dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    # the cpu and torch backends convert what they read; triton's and flashinfer's kernels are
    # not verified with a cache dtype other than the queries'
    if dtype != model_dtype and attention_backend not in ("cpu", "torch"):
        raise ModelLoadError(
            f"--kv-cache-dtype {kv_cache_dtype} with a {str(model_dtype).removeprefix('torch.')} "
            f"model runs with --attention-backend cpu or torch, not {attention_backend}"
        )
    return dtype


def kernel_libraries(cfg: ModelConfig, quantization: str, attention_backend: str) -> list[tuple[str, ...]]:
    """The C libraries (gpu.kernels.load's arguments) that loading `cfg` in float32 on a CPU
    loads: the layer glue, the attention backend's, and for a GGUF run through its blocks the
    block kernels of its tensors' types, the Q4_1 repack's and the C decode loop's."""
    if not kernels.cpu_kernels_available():
        return []
    libraries: list[tuple[str, ...]] = [("layer_cpu",)]
    if attention_backend == "cpu":
        libraries.append(("attention_cpu",))
    if cfg.gguf_path is None or quantization == "none":
        return libraries
    types = {t.type_name for t in GGUFFile(cfg.gguf_path).tensors.values()}
    libraries += sorted({(BLOCK_TYPES[t].library,) for t in types if t in BLOCK_TYPES})
    if ACTIVATIONS.get(quantization) == "q8" and "Q4_1" in types:
        libraries.append(("ggml_cpu",))
    if attention_backend == "cpu":
        libraries.append(("decode_cpu", "layer_cpu", "attention_cpu"))
    return libraries


def build_kernels_ahead(config: ModelRunnerConfig, cfg: ModelConfig) -> ThreadPoolExecutor:
    """Compiles the C libraries that loading the model `cfg` with `config` loads into the cache
    at once, each in a thread of the pool returned (the compilers run side by side: a first
    start's builds take the longest one's time, not their sum; found in the cache, each is a
    hash of its sources). Their users' loads wait for the build under way (cbuild's lock) and
    report a failure themselves: here it is dropped. Shut the pool down once loaded."""
    device, path = resolve_device(config.device), cfg.gguf_path or cfg.model_dir
    dtype = resolve_dtype(config.dtype, device)
    libraries = []
    if device.type == "cpu" and dtype == torch.float32:
        quantization = resolve_quantization(config.quantization, path, device, dtype)
        backend = config.attention_backend or default_backend(device, cfg.plain_attention)
        libraries = kernel_libraries(cfg, quantization, backend)
    pool = ThreadPoolExecutor(max(1, len(libraries)), thread_name_prefix="build-kernels")
    for library in libraries:
        pool.submit(kernels.build_library, *library)
    return pool


class ModelRunner:
    def __init__(self, config: ModelRunnerConfig, progress: Callable[[], None] | None = None) -> None:
        """`progress`: called after each layer of a forward run layer by layer in Python (every
        prefill; decode steps of the C loop are one short call), so that the caller's heartbeat
        advances through a forward of minutes; it must be cheap."""
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config = ModelConfig.from_dir(resolve_model_dir(config.model_path), config.context_length)
        cfg = self.model_config
        path = default_model_path() if config.model_path is None else Path(config.model_path)
        self.quantization = resolve_quantization(config.quantization, path, self.device, self.dtype)
        self.attention_backend = config.attention_backend or default_backend(self.device, cfg.plain_attention)
        self.kv_dtype = resolve_kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, self.attention_backend, self.quantization
        )
        builds = build_kernels_ahead(config, cfg)
        try:
            self._load(config, cfg, path, progress)
        finally:
            builds.shutdown(cancel_futures=True)

    def _load(
        self, config: ModelRunnerConfig, cfg: ModelConfig, path: Path, progress: Callable[[], None] | None
    ) -> None:
        weights, rope_style = self._weights(path)
        self.model = LlamaForCausalLM(cfg, weights, progress, rope_style)
        # LoRA adapters (the scheduler registers them: runtime/scheduler/lora.py), and each row's adapter
        self.loras: LoraPool | None = (
            LoraPool(
                cfg,
                config.max_lora_rank,
                lora_target_set(config.lora_target_modules),
                self.dtype,
                self.device,
                rope_style,
                config.max_loras_per_batch,
            )
            if config.enable_lora
            else None
        )
        self.row_lora = np.zeros(config.max_running_requests, np.int64)
        num_pages = self._num_kv_pages()
        try:
            self.kv_cache = KVCache(
                cfg.num_layers, num_pages, config.page_size, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype, self.device
            )
        except (OSError, torch.OutOfMemoryError):
            size = (
                num_pages
                * config.page_size
                * KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype)
            )
            raise ModelLoadError(
                f"cannot allocate {size >> 20} MiB for a KV cache of {num_pages} pages; "
                f"lower --max-total-tokens or --mem-fraction-static"
            ) from None
        self.pool = PagePool(num_pages, config.page_size)
        try:
            self.attn = self._attention(self.attention_backend)
        except ValueError as e:  # a backend this machine (or this model) cannot run
            if config.attention_backend is not None or self.attention_backend != "cpu":
                raise ModelLoadError(str(e)) from None
            # the CPU default could not be built here (say, a compiler without OpenMP): the reference
            logger.warning("%s; using the torch attention backend", e)
            self.attention_backend = "torch"
            self.attn = self._attention("torch")
        self.decoder = self._cpu_decoder()
        self.sampler = Sampler(
            config.max_running_requests, cfg.vocab_size, cfg.eos_token_ids, self.device, config.random_seed
        )
        self.logits_buffer = RowBuffer(cfg.vocab_size, self.device)

    def _attention(self, name: str):
        """The attention backend `name`, set for this model's scale, windows and soft-capping;
        ValueError when it cannot run here or cannot run them."""
        cfg = self.model_config
        attn = create_backend(name, self.kv_cache, cfg.num_q_heads)
        attn.configure(cfg.attn_scale, cfg.sliding_windows, cfg.attn_logit_softcapping)
        return attn

    def _cpu_decoder(self) -> CpuDecoder | None:
        """Decode steps with the layer loop in C, where it reproduces this model's forward."""
        if not CpuDecoder.applies(self.model, self.attention_backend):
            return None
        try:
            return CpuDecoder(self.model, self.kv_cache)
        except kernels.KernelBuildError as e:
            logger.warning("%s; decode steps run the Python forward", e)
            return None

    def _weights(self, path: Path, cfg: ModelConfig | None = None) -> tuple[dict[str, Weight], str]:
        """The weights and rope style (LlamaForCausalLM's) of the model at `path` (whose config
        is `cfg`, the served model's by default). A GGUF's are used in place
        (--quantization gguf | gguf-q8: its blocks through the kernels; gguf-q8's Q4_1
        projections repacked, gpu/quant/blocks.py) or dequantized (none: float copies, an
        explicit choice); an HF directory's are read (none only)."""
        mode, cfg = self.quantization, cfg or self.model_config
        if mode != "none" and mode not in ACTIVATIONS:
            raise ModelLoadError(f"--quantization must be one of auto, none, {', '.join(ACTIVATIONS)}, not {mode!r}")
        if cfg.gguf_path is None:
            if mode != "none":
                raise ModelLoadError(f"--quantization {mode} needs a .gguf model, not {path}")
            weights: dict[str, Weight] = dict(load_weights(cfg, self.dtype, self.device))
            return weights, "halves"
        if mode == "none":
            weights, rope_style = load_gguf_weights(cfg, "f32")
            dense: dict[str, Weight] = {
                name: (w.dequantize() if isinstance(w, GGUFWeight) else w).to(self.device, self.dtype)
                for name, w in weights.items()
            }
            return dense, rope_style
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise ModelLoadError(f"--quantization {mode} runs on the CPU in float32 (its kernels are AVX2 C)")
        weights, rope_style = load_gguf_weights(cfg, ACTIVATIONS[mode])
        repack_where_faster(weights)
        return weights, rope_style

    def _num_kv_pages(self) -> int:
        cfg, c = self.model_config, self.config
        if c.max_total_tokens is not None:
            return max(1, -(-c.max_total_tokens // c.page_size))
        per_token = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype)
        fraction = c.mem_fraction_static or DEFAULT_MEM_FRACTION[self.device.type]
        if self.device.type == "cuda":
            total = torch.cuda.mem_get_info(self.device)[1]
            used = torch.cuda.memory_allocated(self.device)
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            used = self.model.weight_bytes
        budget_tokens = int(total * fraction - used) // per_token
        if budget_tokens < c.page_size:
            raise ModelLoadError(
                f"no memory left for the KV cache: weights take {used >> 20} MiB of "
                f"{fraction:.2f} x {total >> 20} MiB; raise --mem-fraction-static "
                f"or set --max-total-tokens"
            )
        # more than every row at full context is never used
        tokens = min(budget_tokens, c.max_running_requests * cfg.context_length)
        return max(1, tokens // c.page_size)

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> None:
        """The checkpoint at `model_path` served from now on, in the served weights' buffers
        (gpu/models/weight_update.py); WeightUpdateError, the served weights untouched, when it
        is not of the same architecture and shapes."""
        from gpu.models.weight_update import load_matching

        weights = load_matching(self.model, self._weights, model_path, load_format)
        self.model.set_weights(weights, in_place=self.model_config.gguf_path is None)
        if self.decoder is not None:  # it holds the weights' addresses: a GGUF's are new
            self.decoder = self._cpu_decoder()

    def weights_by_name(self, name: str, truncate_size: int, max_values: int) -> torch.Tensor:
        """SGLang's get_weights_by_name: the first `truncate_size` rows (values of a vector) of
        the weight an HF checkpoint names `name`, float32, as served (gpu/models/weight_update.py)."""
        from gpu.models.weight_update import hf_weight_rows

        return hf_weight_rows(self.model, name, truncate_size, max_values)

    def set_request(self, row: int, params: SamplingParams, prompt_ids: np.ndarray, output_ids: np.ndarray) -> None:
        """(Re)initialises row's sampler state; on resume, output_ids is what it generated so far."""
        self.sampler.set_request(row, params, prompt_ids, output_ids)
        if params.lora_id and self.loras is not None:  # resident since the scheduler admitted it
            self.loras.hold(params.lora_id)
        self.row_lora[row] = params.lora_id

    def clear_request(self, row: int) -> None:
        self.sampler.clear_request(row)
        if self.row_lora[row] and self.loras is not None:
            self.loras.release(int(self.row_lora[row]))
        self.row_lora[row] = 0

    def _lora_batch(self, step: StepInput) -> LoraBatch | None:
        """The step's tokens by adapter, or None when every row runs the base model (the
        common case costs one gather of the rows' ids)."""
        if self.loras is None:
            return None
        seq_lora = self.row_lora[step.rows]
        if not seq_lora.any():
            return None
        return LoraBatch(self.loras.resident, np.repeat(seq_lora, step.q_lens), self.device)

    def idle(self) -> None:
        """The scheduler is idle after a burst: gives back what its steps kept."""
        self.logits_buffer.release()
        self.model.mlp_input.release()

    @torch.inference_mode()
    def step(self, seqs: StepInput | Sequence[SeqInput]) -> StepOutput:
        """One forward over the mixed batch, then one sampled token per sequence with sample set."""
        step = StepInput.of(seqs)
        batch = build_forward_batch(step, self.config.page_size, self.model_config.context_length, self.device)
        lora = self._lora_batch(step)
        out = self.logits_buffer.rows(len(batch.logits_index)) if isinstance(self.model.lm_head, GGUFWeight) else None
        prompt = pooled = None
        ask, index, targets = step.prompt_logprobs, batch.prompt_index, batch.prompt_targets  # set together
        if (ask is not None and index is not None and targets is not None) or step.pool is not None:
            # the Python forward: it keeps every position's hidden state
            self.attn.plan(batch.meta)
            x, residual = self.model.hidden(batch.input_ids, batch.meta.positions, self.attn, lora)
            logits = self.model.logits(x, residual, batch.logits_index, out)
            if ask is not None and index is not None and targets is not None:
                lps, ranks, top_ids, top_lps = self.model.prompt_logprobs(x, residual, index, targets, ask.top_k)
                prompt = PromptLogprobsOut(
                    lps.cpu().numpy(),
                    ranks.cpu().numpy(),
                    top_ids.to(torch.int32).cpu().numpy(),
                    top_lps.cpu().numpy(),
                )
            if step.pool is not None:
                pooled = self._pool(step, batch, x, residual)
        elif self.decoder is not None and self.decoder.takes(batch.meta):
            logits = self.decoder.forward(batch.input_ids, batch.meta, batch.logits_index, lora, out)
        else:
            self.attn.plan(batch.meta)
            logits = self.model.forward(batch.input_ids, batch.meta.positions, batch.logits_index, self.attn, lora, out)
        S = len(batch.sample_rows)
        if S == 0:
            return StepOutput(np.zeros(0, np.int32), np.zeros(0, np.float32), None, None, prompt, pooled)
        res = self.sampler.sample(logits, batch.sample_rows, step.token_mask)
        logprobs = res.logprobs.cpu().numpy() if res.logprobs is not None else np.full(S, np.nan, np.float32)
        return StepOutput(
            tokens=res.tokens.to(torch.int32).cpu().numpy(),
            logprobs=logprobs,
            top_ids=None if res.top_ids is None else res.top_ids.to(torch.int32).cpu().numpy(),
            top_logprobs=None if res.top_logprobs is None else res.top_logprobs.cpu().numpy(),
            prompt_logprobs=prompt,
            pooled=pooled,
        )

    def _pool(self, step: StepInput, batch: ForwardBatch, x: torch.Tensor, residual: torch.Tensor) -> list[np.ndarray]:
        """StepInput.pool's vectors from the forward's last-layer states (PoolAsk says what each is)."""
        ask, qo = step.pool, batch.qo_indptr
        assert ask is not None and qo is not None  # set together
        out = []
        for seq, kind, labels in zip(ask.seqs.tolist(), ask.kinds.tolist(), ask.labels):
            a, b = int(qo[seq]), int(qo[seq + 1])
            if kind == POOL_SUM:
                index = torch.arange(a, b, device=x.device)
                out.append(self.model.final_hidden(x, residual, index).sum(0).cpu().numpy())
                continue
            at = torch.tensor([a if kind == POOL_FIRST else b - 1], device=x.device)
            if kind in (POOL_FIRST, POOL_LAST):
                out.append(self.model.final_hidden(x, residual, at)[0].cpu().numpy())
            elif kind == POOL_LABELS:
                logprobs = torch.log_softmax(self.model.logits(x, residual, at)[0], dim=-1)
                out.append(logprobs[torch.from_numpy(labels).to(x.device)].cpu().numpy())
            else:
                raise ValueError(f"pooling kind {kind}")
        return out
