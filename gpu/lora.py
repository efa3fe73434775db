"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors) or llama.cpp's
GGUF one (gpu/lora_gguf.py, for a GGUF base), loaded once and applied to the Llama-family
forward, many adapters in one batch.

The forward fuses q/k/v into one `qkv` projection and gate/up into `gate_up`; an adapter's
modules of one fused projection are stacked into one pair (A: [sum r, K], B: [N, sum r], block
diagonal, the scaling folded in; kept as B^T [sum r, N], contiguous), so each fused projection
costs one pair of small products per adapter present in the step. A step's tokens are grouped
by adapter (LoraBatch) and each token gets (x @ A^T) @ B^T of its own adapter added to its
row of the base projection: on an AVX2 CPU in C (decode_cpu.c's lora_apply, one call a
projection for the whole step whatever the adapters, from each adapter's table of pairs),
else as two small GEMMs per adapter group, the segmented-gather idea of S-LoRA / Punica. Rows
of the base model are not touched, and a step with no adapter row never builds a LoraBatch.

LoraPool holds the adapters registered with the engine and keeps at most
--max-loras-per-batch of them in memory, evicting the least recently used one no running
request holds when another is needed (its directory is read again when a request needs it)."""

from __future__ import annotations

import ctypes
import json
import math
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from gpu.lora_gguf import read_gguf_adapter
from gpu.models.model_config import ModelConfig
from gpu.models.model_files import ModelLoadError
from protocol.lora import ADAPTER_FILES, is_gguf_adapter

CONFIG_FILE, WEIGHTS_FILE = ADAPTER_FILES
# PEFT's module name -> (the fused projection of the forward, its part in it)
MODULES = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


LORA_PROJECTIONS = ("qkv", "o", "gate_up", "down")  # decode_cpu.c's order of an adapter's pairs in a layer


class LoraLoadError(ModelLoadError):
    """An adapter that cannot be served: the message names the adapter and what is wrong."""


class _LoraPair(ctypes.Structure):  # decode_cpu.c's LoraPair
    _fields_ = [("a", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("r", ctypes.c_int64)]


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    rank: int  # the largest of its modules'
    n_layers: int  # the model's
    # (layer, fused projection) -> (A [sum r, K], B^T [sum r, N] scaled): the modules it adapts
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @cached_property
    def table(self) -> ctypes.Array:
        """Its pairs as decode_cpu.c reads them, [n_layers][LORA_PROJECTIONS] (rank 0 where it
        adapts nothing), pointing into its fp32 tensors: made once, when a step first needs it."""
        pairs = []
        for layer in range(self.n_layers):
            for fused in LORA_PROJECTIONS:
                pair = self.pairs.get((layer, fused))
                pairs.append(
                    _LoraPair() if pair is None else _LoraPair(pair[0].data_ptr(), pair[1].data_ptr(), len(pair[0]))
                )
        return (_LoraPair * len(pairs))(*pairs)

    @cached_property
    def stacked_rank(self) -> int:
        """The largest stacked rank of a fused projection: the C products' scratch a token."""
        return max((len(a) for a, _ in self.pairs.values()), default=0)


def _parts(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Each fused projection's input size and its parts' output sizes, in the order it stacks them."""
    q, kv = cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [i, i]), "down": (i, [h])}


def _pairs_rows(b: torch.Tensor, heads: int) -> torch.Tensor:
    """A PEFT B's rows of a q or k projection in the order the served weights hold them: a Llama
    GGUF's q/k rows were permuted by its converter so that each rotary pair is adjacent
    (llama.cpp's permute); the adapter's output rows must follow the same permutation."""
    n = b.shape[0]
    return b.reshape(heads, 2, n // heads // 2, -1).swapaxes(1, 2).reshape(b.shape)


def _read_peft(where: str, d: Path) -> tuple[dict[tuple[int, str], dict[str, torch.Tensor]], Callable[[int], float]]:
    """A PEFT adapter directory's ({(layer, module): {"A", "B"}}, the scaling of a rank)."""
    from safetensors.torch import load_file

    for f in (CONFIG_FILE, WEIGHTS_FILE):
        if not (d / f).is_file():
            raise LoraLoadError(
                f"{where}: no {f} there (a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})"
            )
    try:
        conf = json.loads((d / CONFIG_FILE).read_text())
        tensors = load_file(str(d / WEIGHTS_FILE))
    except (OSError, ValueError) as e:
        raise LoraLoadError(f"{where}: cannot read it: {e}") from None
    if not isinstance(conf, dict) or conf.get("peft_type", "LORA") != "LORA":
        raise LoraLoadError(f"{where}: peft_type {conf.get('peft_type')!r} is not LORA")
    for key, bad, why in (
        ("use_dora", True, "DoRA is not supported"),
        ("fan_in_fan_out", True, "fan_in_fan_out weights are not supported"),
    ):
        if conf.get(key) == bad:
            raise LoraLoadError(f"{where}: {why}")
    if conf.get("bias", "none") != "none":
        raise LoraLoadError(f"{where}: bias {conf['bias']!r}: only adapters without biases are supported")
    if conf.get("alpha_pattern"):
        raise LoraLoadError(f"{where}: alpha_pattern is not supported")
    if conf.get("modules_to_save"):
        raise LoraLoadError(f"{where}: modules_to_save {conf['modules_to_save']} are not supported")
    targets = conf.get("target_modules")
    if isinstance(targets, list):
        lacking = sorted(set(targets) - set(MODULES))
        if lacking:
            raise LoraLoadError(
                f"{where}: target modules {lacking} are not projections this model has ({', '.join(MODULES)})"
            )
    alpha, rslora = float(conf.get("lora_alpha", 8)), bool(conf.get("use_rslora", False))

    ab: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in MODULES:
            raise LoraLoadError(f"{where}: tensor {key!r} is not a LoRA A or B of {', '.join(MODULES)}")
        ab.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t.float()

    def scaling(r: int) -> float:
        return alpha / (math.sqrt(r) if rslora else r)

    return ab, scaling


def load_adapter(
    name: str,
    path: str,
    cfg: ModelConfig,
    max_rank: int | None,
    target_modules: frozenset[str],
    dtype: torch.dtype,
    device: torch.device,
    rope_style: str = "halves",
) -> Adapter:
    """The adapter at `path` (a PEFT directory, or llama.cpp's GGUF LoRA file: gpu/lora_gguf.py)
    for the model of `cfg`, targeting only `target_modules` (--lora-target-modules) at ranks up
    to `max_rank`; LoraLoadError naming what does not fit."""
    where = f"LoRA adapter {name!r} ({path})"
    scaling: Callable[[int], float]
    if is_gguf_adapter(path):
        try:
            ab, alpha = read_gguf_adapter(where, path, cfg.gguf_path)
        except ModelLoadError as e:
            raise LoraLoadError(str(e)) from None
        scaling = (lambda r: alpha / r) if alpha else (lambda r: 1.0)  # llama.cpp's: no alpha, no scaling
        permute_qk = False  # its converter already permuted B's rows as the base's
    else:
        ab, scaling = _read_peft(where, Path(path))
        permute_qk = rope_style == "pairs"
    if not ab:
        raise LoraLoadError(f"{where}: it holds no LoRA weights")
    for layer, module in ab:
        if module not in target_modules:
            raise LoraLoadError(
                f"{where}: it targets {module}, not among --lora-target-modules ({', '.join(sorted(target_modules))})"
            )
        if layer >= cfg.num_layers:
            raise LoraLoadError(f"{where}: its {module} of layer {layer} is past the model's {cfg.num_layers} layers")

    parts, top = _parts(cfg), 0
    stacked: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), pair in sorted(ab.items()):
        if set(pair) != {"A", "B"}:
            raise LoraLoadError(f"{where}: layer {layer} {module} has lora_{next(iter(pair))} without its pair")
        a, b = pair["A"], pair["B"]
        fused, part = MODULES[module]
        k, outs = parts[fused]
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != k or b.shape != (outs[part], r):
            raise LoraLoadError(
                f"{where}: layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the model "
                f"(A [r, {k}], B [{outs[part]}, r])"
            )
        if max_rank is not None and r > max_rank:
            raise LoraLoadError(f"{where}: rank {r} ({module}) is above --max-lora-rank {max_rank}")
        top = max(top, r)
        if fused == "qkv" and part < 2 and permute_qk:
            b = _pairs_rows(b, cfg.num_q_heads if part == 0 else cfg.num_kv_heads)
        stacked.setdefault((layer, fused), []).append((part, a, b * scaling(r)))

    pairs = {}
    for (layer, fused), items in stacked.items():
        k, outs = parts[fused]
        starts = np.concatenate([[0], np.cumsum(outs)])
        a_cat = torch.cat([a for _, a, _ in items])
        b_cat = torch.zeros(int(starts[-1]), a_cat.shape[0])
        col = 0
        for part, a, b in items:  # block diagonal: each part's rows read only its own A's ranks
            b_cat[int(starts[part]) : int(starts[part + 1]), col : col + a.shape[0]] = b
            col += a.shape[0]
        pairs[(layer, fused)] = (a_cat.to(device, dtype).contiguous(), b_cat.t().to(device, dtype).contiguous())
    return Adapter(name, path, top, cfg.num_layers, pairs)


class LoraPool:
    """The adapters registered with the engine, by id, and the at most `max_resident` of them
    whose weights are in memory (`resident`, least recently used first). A registered adapter
    not resident is read again from its directory when a request needs it, evicting the least
    recently used resident adapter that no request holds and that is not pinned; one that every
    slot's adapter is held (or pinned) against waits (`make_resident` says False). Weights are
    loaded once per residency and shared by every request of the adapter, never copied per
    request."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_rank: int | None,
        target_modules: frozenset[str],
        dtype: torch.dtype,
        device: torch.device,
        rope_style: str,
        max_resident: int,
    ) -> None:
        self._load_args = (cfg, max_rank, target_modules, dtype, device, rope_style)
        self.max_resident = max_resident
        self.paths: dict[int, tuple[str, str]] = {}  # id -> (name, path): every registered adapter
        self.resident: OrderedDict[int, Adapter] = OrderedDict()
        self.holds: Counter[int] = Counter()  # id -> the running requests (rows) using it
        self.pinned: set[int] = set()  # never evicted once resident (SGLang's `pinned`)
        self.loads = 0  # adapters read into memory (registrations included)
        self.evictions = 0

    def load(self, name: str, path: str) -> Adapter:
        """The adapter at `path`, read and checked against the model; LoraLoadError if it does not fit."""
        return load_adapter(name, path, *self._load_args)

    def register(self, lid: int, adapter: Adapter, pinned: bool = False) -> None:
        """Serves `adapter` (just loaded) as `lid`: kept resident if a slot is free, else its
        weights are dropped until a request needs them. A pinned adapter takes the slot of the
        least recently used idle unpinned one if none is free (else it waits for its first
        request, as any adapter) and, once resident, stays."""
        self.paths[lid] = (adapter.name, adapter.path)
        self.loads += 1
        if pinned:
            self.pinned.add(lid)
            victim = self._victim() if len(self.resident) >= self.max_resident else None
            if victim is not None:
                del self.resident[victim]
                self.evictions += 1
        if len(self.resident) < self.max_resident:
            self.resident[lid] = adapter

    def unregister(self, lid: int) -> None:
        """Forgets `lid`; no request may hold it."""
        del self.paths[lid]
        self.resident.pop(lid, None)
        self.pinned.discard(lid)

    def _victim(self) -> int | None:
        """The least recently used resident adapter neither held nor pinned."""
        return next((v for v in self.resident if not self.holds[v] and v not in self.pinned), None)

    def make_resident(self, lid: int) -> bool:
        """Makes `lid` resident (the most recently used), evicting the least recently used
        adapter no request holds if every slot is taken; False when all are held. Raises
        LoraLoadError when its directory can no longer be read as it was at registration."""
        if lid in self.resident:
            self.resident.move_to_end(lid)
            return True
        if len(self.resident) >= self.max_resident:
            victim = self._victim()
            if victim is None:
                return False
            del self.resident[victim]
            self.evictions += 1
        self.resident[lid] = self.load(*self.paths[lid])
        self.loads += 1
        return True

    def hold(self, lid: int) -> None:
        self.holds[lid] += 1

    def release(self, lid: int) -> None:
        self.holds[lid] -= 1
        if not self.holds[lid]:
            del self.holds[lid]


_apply: Callable[..., int] | None = None
_apply_tried = False
_apply_lock = threading.Lock()


def _c_apply() -> Callable[..., int] | None:
    """decode_cpu.c's lora_apply, or None where the C kernels cannot be built (then torch's GEMMs)."""
    global _apply, _apply_tried
    if _apply_tried:
        return _apply
    with _apply_lock:
        if not _apply_tried:
            _apply_tried = True
            from gpu import kernels

            try:
                lib = kernels.load("decode_cpu", "layer_cpu", "attention_cpu")
            except kernels.KernelBuildError:
                return None
            ptr, i64 = ctypes.c_void_p, ctypes.c_int64
            # loras, layer, which, x, T, k, y, n, max_r, threads
            lib.lora_apply.argtypes = [ptr, i64, ctypes.c_int, ptr, i64, i64, ptr, i64, i64, ctypes.c_int]
            lib.lora_apply.restype = ctypes.c_int
            _apply = lib.lora_apply
    return _apply


class LoraBatch:
    """One step's tokens grouped by adapter: what the forward adds to each projection."""

    def __init__(self, adapters: Mapping[int, Adapter], token_lora: np.ndarray, device: torch.device) -> None:
        """adapters: id -> the resident adapter; token_lora: int [T], each flat token's adapter id
        (0: the base, left as it is)."""
        self.adapters, self.token_lora = adapters, token_lora
        self.groups: list[tuple[int, Adapter, torch.Tensor | slice]] = []  # (id, adapter, its tokens)
        for lid in np.unique(token_lora).tolist():
            if lid == 0:
                continue
            where = np.flatnonzero(token_lora == lid)
            # a sequence's tokens are contiguous: a group of one run is a view, not a gather
            rows: torch.Tensor | slice = (
                slice(int(where[0]), int(where[-1]) + 1)
                if where[-1] - where[0] + 1 == len(where)
                else torch.from_numpy(where).to(device)
            )
            self.groups.append((lid, adapters[lid], rows))

    @cached_property
    def tables(self) -> tuple[np.ndarray, int]:
        """Each token's adapter's table address (0: the base model's) and the step's largest
        stacked rank: what decode_cpu.c reads (its decode loop, lora_apply)."""
        addresses = np.zeros(len(self.token_lora), np.uint64)
        for lid, adapter, _ in self.groups:
            addresses[self.token_lora == lid] = ctypes.addressof(adapter.table)
        return addresses, max((a.stacked_rank for _, a, _ in self.groups), default=0)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, fused: str) -> torch.Tensor:
        """out [T, N] (the base projection of x [T, K], a fresh tensor) plus each group's delta, in place."""
        apply = _c_apply() if out.device.type == "cpu" and out.dtype == x.dtype == torch.float32 else None
        if apply is not None and out.is_contiguous():
            x = x.contiguous()
            addresses, max_r = self.tables
            which = LORA_PROJECTIONS.index(fused)
            T, K = x.shape
            if apply(
                addresses.ctypes.data,
                layer,
                which,
                x.data_ptr(),
                T,
                K,
                out.data_ptr(),
                out.shape[1],
                max_r,
                torch.get_num_threads(),
            ):
                raise MemoryError("lora_apply: no memory for a step's scratch")
            return out
        for _, adapter, rows in self.groups:
            pair = adapter.pairs.get((layer, fused))
            if pair is None:
                continue
            a, bt = pair
            if isinstance(rows, slice):
                out[rows] += (x[rows] @ a.t()) @ bt
            else:
                out.index_add_(0, rows, (x[rows] @ a.t()) @ bt)
        return out
