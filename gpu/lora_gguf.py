"""LoRA adapters in llama.cpp's GGUF format, as its convert_lora_to_gguf.py writes them from a
PEFT adapter and its llama-adapter.cpp reads them: general.type "adapter", adapter.type "lora",
adapter.lora.alpha, general.architecture the base GGUF's, and a pair of tensors per adapted
projection, `blk.N.<projection>.weight.lora_a` [r, K] and `.lora_b` [N, r] (torch order), in
F32, F16, BF16 or Q8_0 (the converter's --outtype).

The converter ran the base model's own tensor changes on each B, so a Llama's q/k B rows are
already in the order of the base GGUF's weights (llama.cpp's rotary permutation): they are
used as they are. The scaling is llama.cpp's: alpha / r, or 1 where alpha is 0."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch

from gpu.models.gguf_file import GGUFFile
from gpu.models.load_error import ModelLoadError

# llama.cpp's tensor name of a projection -> PEFT's module name (gpu/lora.py's MODULES)
GGUF_MODULES = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
TYPES = ("F32", "F16", "BF16", "Q8_0")  # what convert_lora_to_gguf.py's --outtype writes
_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")


def _values(type_name: str, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's values as float32, copied out of the file's mapping."""
    values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(values.astype(np.float32).reshape(shape))


def read_gguf_adapter(
    where: str, path: str, base_gguf: Path | None
) -> tuple[dict[tuple[int, str], dict[str, torch.Tensor]], float]:
    """The adapter file at `path` for the base model whose GGUF file is `base_gguf` (None: the
    base is not a GGUF): ({(layer, PEFT module): {"A": [r, K], "B": [N, r]}}, alpha), float32.
    ModelLoadError (its message starting with `where`) for a file llama.cpp would not load as a
    LoRA of this base, or one ringserve does not serve: a norm tensor, an aLoRA, another type."""
    if base_gguf is None:
        raise ModelLoadError(
            f"{where}: a GGUF LoRA adapter needs a GGUF base model (its rows follow the GGUF's); "
            "this model is a Hugging Face directory: give the adapter in PEFT's format"
        )
    try:
        f = GGUFFile(Path(path))
    except ModelLoadError as e:
        raise ModelLoadError(f"{where}: {e}") from None
    kind, adapter_kind = f.metadata.get("general.type"), f.metadata.get("adapter.type")
    if kind != "adapter":
        raise ModelLoadError(f"{where}: general.type is {kind!r}, not 'adapter': not a LoRA adapter file")
    if adapter_kind != "lora":
        raise ModelLoadError(f"{where}: adapter.type is {adapter_kind!r}, not 'lora'")
    base_arch = GGUFFile(base_gguf).architecture
    if f.architecture != base_arch:
        raise ModelLoadError(f"{where}: it is for the architecture {f.architecture!r}; the model is {base_arch!r}")
    if "adapter.alora.invocation_tokens" in f.metadata:
        raise ModelLoadError(f"{where}: activated LoRA (adapter.alora.invocation_tokens) is not supported")
    alpha = f.metadata.get("adapter.lora.alpha", 0.0)
    if not isinstance(alpha, float) or not np.isfinite(alpha):
        raise ModelLoadError(f"{where}: adapter.lora.alpha {alpha!r} is not a finite float")

    ab: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in f.tensors.items():
        m = _KEY.fullmatch(name)
        if m is None or m.group(2) not in GGUF_MODULES:
            raise ModelLoadError(
                f"{where}: tensor {name!r} is not a LoRA pair's of {', '.join(GGUF_MODULES)} "
                "(blk.N.<projection>.weight.lora_a / .lora_b)"
            )
        if t.type_name not in TYPES:
            raise ModelLoadError(f"{where}: tensor {name!r} is {t.type_name}; supported: {', '.join(TYPES)}")
        if len(t.shape) != 2:
            raise ModelLoadError(f"{where}: tensor {name!r} has shape {list(t.shape)}, not a matrix")
        part = m.group(3).upper()
        ab.setdefault((int(m.group(1)), GGUF_MODULES[m.group(2)]), {})[part] = _values(t.type_name, t.data, t.shape)
    return ab, alpha
