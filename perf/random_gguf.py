"""Random-weight Llama GGUFs shaped like real models, for measuring how cost grows with the
model (perf/scale_bench.py): F16 weights (normal, std 0.02; norms 1), written one tensor at a
time, then quantized by llama.cpp's own `llama-quantize` as a user's file would be.

The tokenizer is the embedded SmolLM2's (GPT-2-style BPE, 49,152 tokens) padded with plain
tokens `<|reserved_i|>` to the shape's vocabulary, so the embedding and the LM head have the
real model's size; this machine cannot download Llama 3's tokenizer. Llama 3.2's RoPE scaling
is left out (it changes no cost at these lengths).

    python -m perf.random_gguf --shape llama-3.2-1b --out /tmp/llama-1b-f16.gguf
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    rope_theta: float = 500000.0
    context: int = 131072

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_parameters(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.vocab * self.hidden + self.layers * (attn + 3 * self.hidden * self.ffn + 2 * self.hidden)


# transformers' configs of meta-llama/Llama-3.2-1B and -3B (tied embeddings)
SHAPES = {
    "llama-3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256),
    "llama-3.2-3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, vocab=128256),
}
_STD = 0.02
_ROWS_AT_ONCE = 8192  # rows drawn at a time: a vocabulary-sized matrix's float32 temporaries stay small


def _tensors(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [rows, cols]) of every tensor, in the file's order."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    names: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        names += [
            (f"blk.{i}.attn_norm.weight", (h,)),
            (f"blk.{i}.attn_q.weight", (q, h)),
            (f"blk.{i}.attn_k.weight", (kv, h)),
            (f"blk.{i}.attn_v.weight", (kv, h)),
            (f"blk.{i}.attn_output.weight", (h, q)),
            (f"blk.{i}.ffn_norm.weight", (h,)),
            (f"blk.{i}.ffn_gate.weight", (shape.ffn, h)),
            (f"blk.{i}.ffn_up.weight", (shape.ffn, h)),
            (f"blk.{i}.ffn_down.weight", (h, shape.ffn)),
        ]
    return names + [("output_norm.weight", (h,))]


def _values(dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if len(dims) == 1:
        return np.ones(dims, dtype=np.float32)  # norms: F32, as converters write them
    out = np.empty(dims, dtype=np.float16)
    for a in range(0, dims[0], _ROWS_AT_ONCE):
        rows = out[a : a + _ROWS_AT_ONCE]
        rows[...] = rng.standard_normal(rows.shape, dtype=np.float32) * _STD
    return out


def _tokenizer(writer: gguf.GGUFWriter, vocab: int, tokenizer_gguf: Path) -> None:
    """The tokenizer of `tokenizer_gguf` (a GPT-2-style BPE one), its tokens padded to `vocab`."""
    src = gguf.GGUFReader(str(tokenizer_gguf))

    def field(name: str):
        return src.fields[name].contents()

    tokens = list(field("tokenizer.ggml.tokens"))
    types = list(field("tokenizer.ggml.token_type"))
    if len(tokens) > vocab:
        raise ValueError(f"{tokenizer_gguf.name} has {len(tokens)} tokens, more than the vocabulary {vocab}")
    pad = vocab - len(tokens)
    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(tokens + [f"<|reserved_{i}|>" for i in range(pad)])
    writer.add_token_types(types + [int(gguf.TokenType.NORMAL)] * pad)
    writer.add_token_merges(list(field("tokenizer.ggml.merges")))
    writer.add_bos_token_id(int(field("tokenizer.ggml.bos_token_id")))
    writer.add_eos_token_id(int(field("tokenizer.ggml.eos_token_id")))
    writer.add_pad_token_id(int(field("tokenizer.ggml.padding_token_id")))
    writer.add_add_bos_token(bool(field("tokenizer.ggml.add_bos_token")))
    writer.add_chat_template(field("tokenizer.chat_template"))


def write_random_gguf(shape: Shape, out: Path, tokenizer_gguf: Path, seed: int = 0) -> Path:
    """Writes `out`: an F16 Llama GGUF of `shape` with random weights. Returns `out`."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(f"random llama {shape.num_parameters / 1e9:.2f}B")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _tokenizer(writer, shape.vocab, tokenizer_gguf)
    tensors = _tensors(shape)
    for name, dims in tensors:
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, dims in tensors:  # one tensor in memory at a time
        writer.write_tensor_data(_values(dims, rng))
    writer.close()
    return out


def main(argv: list[str] | None = None) -> None:
    from gpu.models.model_files import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    write_random_gguf(SHAPES[args.shape], args.out, default_model_path(), args.seed)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
