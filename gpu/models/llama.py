"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) in plain torch over a
paged KV cache: one forward for a flat batch of tokens from many requests, attention
delegated to the backend, logits only for the tokens that are sampled. The same forward runs
the variations ModelConfig reads (Qwen3, Phi-3, Gemma 2/3, SmolLM3): q/k norms, Gemma's
norms around attention and MLP, GELU-tanh, scaled embeddings, soft-capped logits, per-layer
rope tables or none; per-layer sliding windows and soft-capped attention scores are the
attention backend's (the torch one: AttentionBackend.configure)."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from gpu import kernels
from gpu.attention.base import AttentionBackend
from gpu.models.model_config import ModelConfig, rope_inv_freq
from gpu.quant.gguf_weight import GGUFWeight
from gpu.row_buffer import RowBuffer

if TYPE_CHECKING:
    from gpu.lora import LoraBatch

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # one fused op; in fp32 it is bit-identical to transformers' LlamaRMSNorm (tested)
    return F.rms_norm(x, weight.shape, weight, eps)


# Below this many tokens MKL runs (W @ x^T)^T, streaming W's rows once with the tokens as the
# short side, faster than F.linear's x @ W^T: most at a few tokens, less as they grow, and
# F.linear wins beyond this limit (measured over SmolLM2's layers and lm_head:
# docs/perf-notes.md).
SHORT_GEMM_TOKENS = 128


def linear(
    x: torch.Tensor,
    w: torch.Tensor | GGUFWeight,
    bias: torch.Tensor | None = None,
    w_t: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, K], w: [N, K] (or a GGUF file's tensors), w_t: the same weight as a [K, N] copy
    or None -> [T, N]; on the CPU in the product order MKL runs fastest for T. `out`: float32
    [T, N] storage a GGUF weight's product is written into (gpu/row_buffer.py), or None."""
    if isinstance(w, GGUFWeight):
        y = w.matmul(x, out)
        return y if bias is None else y + bias
    if out is not None:
        raise ValueError("out: only a GGUF weight's product is written into given storage")
    if not x.is_cpu:
        return F.linear(x, w, bias)
    T = x.shape[0]
    if T == 1 and w_t is not None:
        out = x @ w_t  # a one-token GEMV streams [K, N] faster when K is the short side
        return out if bias is None else out + bias
    if T <= SHORT_GEMM_TOKENS:
        out = torch.mm(w, x.t()) if bias is None else torch.addmm(bias[:, None], w, x.t())  # [N, T]
        return out.t().contiguous()
    return F.linear(x, w, bias)


# Bytes of float32 logits ([rows, V]) one lm_head pass over prompt-logprob positions makes:
# the positions per pass follow the vocabulary (682 for a 49k one, 128 for Gemma 3's 262k),
# so a large vocabulary's passes do not hold gigabytes at once.
PROMPT_LOGITS_BYTES = 128 << 20


# How a head's rotary pairs lie: "halves", dims (j, j + D/2) (transformers' rotate-half,
# llama.cpp's NEOX), or "pairs", dims (2j, 2j + 1) (llama.cpp's NORM: the q/k rows of a Llama-
# architecture GGUF, which its converter permuted so; q.k is the same under the same
# permutation of both, so the rows are used as they are)
ROPE_STYLES = ("halves", "pairs")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "halves") -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, D/2]
    if style == "pairs":
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class TorchLayerOps:
    """The per-layer glue in torch ops: CUDA, other dtypes, CPUs without the C kernels."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, rope_style: str = "halves") -> None:
        self.cos, self.sin = cos, sin  # [P, D/2]
        self.rope_style = rope_style

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, H] -> (x + residual, rms_norm(x + residual)); residual None: x as it is."""
        x = x if residual is None else x + residual
        return x, rms_norm(x, weight, eps)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [..., H] -> rms_norm(x) over its last dimension (Gemma's extra norms)"""
        return rms_norm(x, weight, eps)

    def norm_heads(self, heads: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """heads: [T, n, D], each head's rms_norm in place (q or k heads, before the rope)"""
        heads.copy_(rms_norm(heads, weight, eps))

    def rope_at(self, positions: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """positions: int64 [T] -> a function of one layer's q and k heads [T, Hq + Hkv, D] that
        returns them rotated."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2], gathered once for all layers
        sin = self.sin[positions].unsqueeze(1)
        return lambda qk: apply_rope(qk, cos, sin, self.rope_style)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2I] -> silu(gate) * up [T, I]"""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2I] -> gelu_tanh(gate) * up [T, I] (Gemma's gelu_pytorch_tanh)"""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class CpuLayerOps:
    """The same glue by gpu/kernels/layer_cpu.c, one call per op: fp32 on an AVX2 CPU. x is
    updated in place by add_rms_norm and q, k by the rope (both fresh tensors of this step)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, rope_style: str = "halves") -> None:
        lib = kernels.load("layer_cpu")  # KernelBuildError when it cannot be built here
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.rms_norm.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ptr, i32]  # x, residual, w, T, H, eps, out
        lib.norm_heads.argtypes = [ptr, i64, i64, i64, i64, ptr, ctypes.c_float, i32]  # x, row stride, T, n, D, w, eps
        # x, row stride, T, heads, D, pos, cos, sin, pairs
        lib.rope.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, i32, i32]
        lib.silu_mul.argtypes = lib.gelu_tanh_mul.argtypes = [ptr, i64, i64, ptr, i32]  # gate_up, T, I, out
        for fn in (lib.rms_norm, lib.norm_heads, lib.rope, lib.silu_mul, lib.gelu_tanh_mul):
            fn.restype = None
        self.lib, self.cos, self.sin = lib, cos.contiguous(), sin.contiguous()
        self.rope_style = rope_style

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        T, H = x.shape
        x = x.contiguous()
        residual = None if residual is None else residual.contiguous()
        out = torch.empty_like(x)
        self.lib.rms_norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            T,
            H,
            eps,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return x, out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return self.add_rms_norm(rows, None, weight, eps)[1].view(x.shape)

    def norm_heads(self, heads: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        T, n, D = heads.shape  # heads contiguous within a row; rows at any stride (the fused qkv's)
        if heads.stride(2) != 1 or heads.stride(1) != D:
            raise ValueError(f"norm_heads: heads must be contiguous within a row, strides {heads.stride()}")
        self.lib.norm_heads(heads.data_ptr(), heads.stride(0), T, n, D, weight.data_ptr(), eps, torch.get_num_threads())

    def rope_at(self, positions: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        positions = positions.to(torch.int64).contiguous()  # read as int64_t by the kernel

        def rope(qk: torch.Tensor) -> torch.Tensor:
            T, H, D = qk.shape  # heads contiguous within a row; rows at any stride (the fused qkv's)
            if qk.stride(2) != 1 or qk.stride(1) != D:
                raise ValueError(f"rope: q and k heads must be contiguous within a row, strides {qk.stride()}")
            self.lib.rope(
                qk.data_ptr(),
                qk.stride(0),
                T,
                H,
                D,
                positions.data_ptr(),
                self.cos.data_ptr(),
                self.sin.data_ptr(),
                int(self.rope_style == "pairs"),
                torch.get_num_threads(),
            )
            return qk

        return rope

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act_mul(self.lib.silu_mul, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act_mul(self.lib.gelu_tanh_mul, gate_up)

    @staticmethod
    def _act_mul(kernel: Callable[..., None], gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        T, I = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(T, I, dtype=gate_up.dtype)
        kernel(gate_up.data_ptr(), T, I, out.data_ptr(), torch.get_num_threads())
        return out


def layer_ops(cos: torch.Tensor, sin: torch.Tensor, rope_style: str = "halves") -> TorchLayerOps | CpuLayerOps:
    """The C kernels for an fp32 model on a CPU that can build them, else the torch ops (a failed
    build warns, as the attention backend's does)."""
    if rope_style not in ROPE_STYLES:
        raise ValueError(f"rope_style must be one of {ROPE_STYLES}, not {rope_style!r}")
    if not (cos.is_cpu and cos.dtype == torch.float32 and kernels.cpu_kernels_available()):
        return TorchLayerOps(cos, sin, rope_style)
    try:
        return CpuLayerOps(cos, sin, rope_style)
    except kernels.KernelBuildError as e:
        logger.warning("%s; the per-layer norms, rope and silu run as torch ops", e)
        return TorchLayerOps(cos, sin, rope_style)


class LlamaForCausalLM:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor | GGUFWeight],
        progress: Callable[[], None] | None = None,
        rope_style: str = "halves",
    ) -> None:
        """rope_style: how the q/k rows of `weights` hold each rotary pair (ROPE_STYLES)."""
        self.cfg = cfg
        # called after each layer of a forward (and each block of prompt logits): a watcher of the
        # caller's heartbeat then sees a long prefill make progress, a stopped or stuck one not
        self.progress = progress

        def tensor(name: str) -> torch.Tensor | None:
            """A norm or bias: a tensor (None when the model has none)."""
            w = weights.get(name)
            if w is not None and not isinstance(w, torch.Tensor):
                raise TypeError(f"{name}: a tensor was expected, not {type(w).__name__}")
            return w

        def needed(name: str) -> torch.Tensor:
            w = tensor(name)
            if w is None:
                raise KeyError(name)
            return w

        self.embed = weights["embed"]
        self.norm = needed("norm")
        self.device, self.dtype = self.norm.device, self.norm.dtype
        self.lm_head = weights.get("lm_head", self.embed)
        n = cfg.num_layers
        self.input_norm = [needed(f"layers.{i}.input_norm") for i in range(n)]
        self.post_norm = [needed(f"layers.{i}.post_norm") for i in range(n)]
        self.qkv = [weights[f"layers.{i}.qkv"] for i in range(n)]
        self.qkv_bias = [tensor(f"layers.{i}.qkv_bias") for i in range(n)]
        self.o = [weights[f"layers.{i}.o"] for i in range(n)]
        self.gate_up = [weights[f"layers.{i}.gate_up"] for i in range(n)]
        self.down = [weights[f"layers.{i}.down"] for i in range(n)]
        self.q_norm = [tensor(f"layers.{i}.q_norm") for i in range(n)]
        self.k_norm = [tensor(f"layers.{i}.k_norm") for i in range(n)]
        self.attn_out_norm = [tensor(f"layers.{i}.attn_out_norm") for i in range(n)]
        self.mlp_out_norm = [tensor(f"layers.{i}.mlp_out_norm") for i in range(n)]

        # On the CPU a one-token product x @ W^T streams W much faster from a [K, N] copy than from
        # the [N, K] weight when K is the short hidden size (MKL; measured for gate_up and lm_head,
        # not for qkv, o or down). Single-token steps, i.e. batch-1 decode, the latency case, use
        # the copies (see linear()).
        def copy_t(w: torch.Tensor | GGUFWeight) -> torch.Tensor | None:
            return w.t().contiguous() if self.device.type == "cpu" and isinstance(w, torch.Tensor) else None

        self.gate_up_t = [copy_t(w) for w in self.gate_up]
        # gate_up's products, or their act(gate) * up (GGUFWeight.gated), layer after layer
        self.mlp_input = RowBuffer(2 * cfg.intermediate_size, self.device)
        self.lm_head_t = copy_t(self.lm_head)
        self.cos, self.sin = self._rope_tables(cfg.rope)
        self.ops = layer_ops(self.cos, self.sin, rope_style)
        # each layer's rope: None (SmolLM3's NoPE layers), the model's, or the sliding layers' own (Gemma 3)
        local = None if cfg.local_rope is None else layer_ops(*self._rope_tables(cfg.local_rope), rope_style)
        self.layer_rope = [
            None
            if cfg.rope_layers and not cfg.rope_layers[i]
            else local
            if local is not None and cfg.local_rope_layers[i]
            else self.ops
            for i in range(n)
        ]
        self.embed_scale = (
            None if cfg.embed_scale is None else torch.tensor(cfg.embed_scale).to(self.dtype).to(self.device)
        )

    def _layer_weights(self) -> dict[str, list]:
        """The per-layer weight lists by load_weights' names (layers.{i}.<name>)."""
        return {
            "input_norm": self.input_norm,
            "post_norm": self.post_norm,
            "qkv": self.qkv,
            "qkv_bias": self.qkv_bias,
            "o": self.o,
            "gate_up": self.gate_up,
            "down": self.down,
            "q_norm": self.q_norm,
            "k_norm": self.k_norm,
            "attn_out_norm": self.attn_out_norm,
            "mlp_out_norm": self.mlp_out_norm,
        }

    def named_weights(self) -> dict[str, torch.Tensor | GGUFWeight]:
        """The weights served, by load_weights' names: what a new checkpoint must match (a
        tied lm_head is the embedding itself, so it is not listed)."""
        out: dict[str, torch.Tensor | GGUFWeight] = {"embed": self.embed, "norm": self.norm}
        if self.lm_head is not self.embed:
            out["lm_head"] = self.lm_head
        for name, per_layer in self._layer_weights().items():
            out.update({f"layers.{i}.{name}": w for i, w in enumerate(per_layer) if w is not None})
        return out

    def set_weights(self, new: dict[str, torch.Tensor | GGUFWeight], in_place: bool) -> None:
        """`new`, of named_weights' names and shapes (the caller checked them), served from now
        on. `in_place`: each tensor's values are copied into the tensor served, its buffer kept
        (an HF checkpoint's); else each weight is replaced (a GGUF's are views of its file's
        read-only mapping, the new file's mapped as the old one was). The transposed copies are
        refilled in their own buffers."""
        layers, current = self._layer_weights(), self.named_weights()
        for name, w in new.items():
            if in_place:
                served = current[name]
                assert isinstance(served, torch.Tensor) and isinstance(w, torch.Tensor)
                served.copy_(w)
            elif name in ("embed", "norm", "lm_head"):
                setattr(self, name, w)
            else:
                _, layer, key = name.split(".")
                layers[key][int(layer)] = w
        if "lm_head" not in new:
            self.lm_head = self.embed
        for t, w in [*zip(self.gate_up_t, self.gate_up), (self.lm_head_t, self.lm_head)]:
            if t is not None and isinstance(w, torch.Tensor):
                t.copy_(w.t())

    def _rope_tables(self, rope) -> tuple[torch.Tensor, torch.Tensor]:
        # cos/sin of every position, computed once in fp32 as transformers does, kept in the model dtype
        positions = torch.arange(self.cfg.context_length, dtype=torch.float32)
        freqs = positions[:, None] * rope_inv_freq(rope, self.cfg.head_dim)[None, :]  # [P, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if rope.attention_factor != 1.0:  # yarn
            cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
        return (
            cos.to(device=self.device, dtype=self.dtype),
            sin.to(device=self.device, dtype=self.dtype),
        )

    @property
    def weight_bytes(self) -> int:
        tensors = [
            self.embed,
            self.lm_head,
            self.norm,
            *self.input_norm,
            *self.post_norm,
            *self.qkv,
            *self.o,
            *self.gate_up,
            *self.down,
            *[
                t
                for t in (*self.qkv_bias, *self.q_norm, *self.k_norm, *self.attn_out_norm, *self.mlp_out_norm)
                if t is not None
            ],
            *[t for t in (*self.gate_up_t, self.lm_head_t) if t is not None],
        ]
        # by identity: a tied lm_head is the embedding itself; a GGUF's tensors count the bytes
        # of the file they read (mapped pages, resident once read)
        unique = {id(t): t for t in tensors}
        return sum(t.nbytes if isinstance(t, GGUFWeight) else t.numel() * t.element_size() for t in unique.values())

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_index: torch.Tensor,
        attn: AttentionBackend,
        lora: LoraBatch | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: int64 [T]; logits_index: int64 [S] -> float32 logits [S, V]
        (in `out`, as logits() says)."""
        x, residual = self.hidden(input_ids, positions, attn, lora)
        return self.logits(x, residual, logits_index, out)

    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend, lora: LoraBatch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions: int64 [T] -> the last layer's residual stream and MLP output
        [T, H], whose sum logits() normalises: what both the sampled and the prompt-logprob
        positions' logits are taken from. `lora`: the step's tokens of LoRA adapters, whose
        deltas are added to each projection's output (None: the base model for every token)."""
        cfg = self.cfg
        T, D, Hq, Hkv = len(input_ids), cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
        qk_width, eps = (Hq + Hkv) * D, cfg.rms_norm_eps
        ops = self.ops
        ropes = {id(o): o.rope_at(positions) for o in self.layer_rope if o is not None}  # one gather per table
        x, residual = self.scaled_embedding(input_ids), None  # [T, H]; residual: the last layer's MLP output
        for i in range(cfg.num_layers):
            x, h = ops.add_rms_norm(x, residual, self.input_norm[i], eps)
            qkv = linear(h, self.qkv[i], self.qkv_bias[i])  # [T, (Hq + 2Hkv) D]
            if lora is not None:
                qkv = lora.add(qkv, h, i, "qkv")
            qk = qkv[:, :qk_width].view(T, Hq + Hkv, D)
            q_norm, k_norm = self.q_norm[i], self.k_norm[i]
            if q_norm is not None and k_norm is not None:  # per head, before rope
                ops.norm_heads(qk[:, :Hq], q_norm, eps)
                ops.norm_heads(qk[:, Hq:], k_norm, eps)
            if self.layer_rope[i] is not None:
                qk = ropes[id(self.layer_rope[i])](qk)
            v = qkv[:, qk_width:].view(T, Hkv, D)
            o = attn.forward(qk[:, :Hq], qk[:, Hq:], v, i)  # [T, Hq, D]
            o_in = o.reshape(T, Hq * D)
            o = linear(o_in, self.o[i])
            if lora is not None:
                o = lora.add(o, o_in, i, "o")
            attn_out_norm = self.attn_out_norm[i]
            if attn_out_norm is not None:
                o = ops.rms_norm(o, attn_out_norm, eps)
            x, h = ops.add_rms_norm(x, o, self.post_norm[i], eps)
            act = self._mlp_act(i, h, lora)  # [T, I]
            residual = linear(act, self.down[i])  # [T, H]
            if lora is not None:
                residual = lora.add(residual, act, i, "down")
            mlp_out_norm = self.mlp_out_norm[i]
            if mlp_out_norm is not None:
                residual = ops.rms_norm(residual, mlp_out_norm, eps)
            if self.progress is not None:
                self.progress()
        if residual is None:
            raise ValueError("a model of no layers")
        return x, residual

    def embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: int64 [T] -> their rows of the embedding [T, H] (not yet scaled)."""
        if isinstance(self.embed, GGUFWeight):
            return self.embed.rows(input_ids)
        return F.embedding(input_ids, self.embed)

    def scaled_embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: int64 [T] -> the first layer's input [T, H] (Gemma's scaled by sqrt(H))."""
        x = self.embedding(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

    def _mlp_act(self, i: int, h: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        """Layer i's act(gate) * up [T, I] of h [T, H]: in one product where its gate_up has one
        (GGUFWeight.gated, the C glue's arithmetic: with CpuLayerOps only) and no adapter adds to
        gate_up this step; else gate_up's product [T, 2I], the adapters' deltas, then the glue."""
        w, T = self.gate_up[i], h.shape[0]
        if not isinstance(w, GGUFWeight):
            gate_up = linear(h, w, w_t=self.gate_up_t[i])
        else:
            kept = self.mlp_input.rows(T)
            if lora is None and isinstance(self.ops, CpuLayerOps):
                act = w.gated(h, self.cfg.hidden_act != "silu", out=kept.view(-1)[: T * (w.shape[0] // 2)].view(T, -1))
                if act is not None:
                    return act
            gate_up = linear(h, w, out=kept)
        if lora is not None:
            gate_up = lora.add(gate_up, h, i, "gate_up")
        return self._act_mul(gate_up)

    def _act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [T, 2I] -> act(gate) * up [T, I]"""
        if self.cfg.hidden_act == "silu":
            return self.ops.silu_mul(gate_up)
        return self.ops.gelu_tanh_mul(gate_up)

    def prompt_logprobs(
        self, x: torch.Tensor, residual: torch.Tensor, index: torch.Tensor, targets: torch.Tensor, top_k: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The log-softmax of the raw logits (no temperature or penalty) at the flat tokens
        `index` [N], gathered at `targets` [N] (the token each predicts): (logprobs [N] float32,
        ranks [N] int64: 1 + the tokens likelier than the target, top ids [N, top_k] int64,
        top logprobs [N, top_k] float32). A long prompt's positions go through lm_head
        PROMPT_LOGITS_BYTES of logits at a time, so its [N, V] logits are never held at once."""
        parts = []
        rows = max(1, PROMPT_LOGITS_BYTES // (4 * self.cfg.vocab_size))
        for a in range(0, len(index), rows):
            logprobs = torch.log_softmax(self.logits(x, residual, index[a : a + rows]), dim=-1)
            target = targets[a : a + rows, None]
            chosen = logprobs.gather(1, target)
            ranks = (logprobs > chosen).sum(dim=1) + 1
            top_lps, top_ids = logprobs.topk(top_k, dim=1) if top_k else (logprobs[:, :0], target[:, :0])
            parts.append((chosen[:, 0], ranks, top_ids, top_lps))
            if self.progress is not None:
                self.progress()
        logprobs, ranks, top_ids, top_lps = (torch.cat(p) for p in zip(*parts))
        return logprobs, ranks, top_ids, top_lps

    def final_hidden(self, x: torch.Tensor, residual: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The flat tokens `index` [N]' hidden states after the last norm, float32 [N, H]:
        transformers' last_hidden_state, what embeddings pool."""
        _, h = self.ops.add_rms_norm(x[index], residual[index], self.norm, self.cfg.rms_norm_eps)
        return h.float()

    def logits(
        self, x: torch.Tensor, residual: torch.Tensor, logits_index: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The last layer's residual stream x and MLP output residual: [T, H]; logits_index:
        int64 [S] -> float32 logits [S, V]; `out`: float32 [S, V] storage a head in GGUF blocks
        writes them into (gpu/row_buffer.py), or None."""
        _, h = self.ops.add_rms_norm(x[logits_index], residual[logits_index], self.norm, self.cfg.rms_norm_eps)
        logits = linear(h, self.lm_head, w_t=self.lm_head_t, out=out)  # [S, V]
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits.float()
