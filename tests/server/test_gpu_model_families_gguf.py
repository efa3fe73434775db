"""The families beyond the Llama core, from GGUF files: the tiny random models of
test_gpu_model_families_more written with the gguf package as llama.cpp's
convert_hf_to_gguf.py writes them (metadata keys, tensor names, Gemma's norms stored as
1 + w, a byte-level tokenizer of the tiny vocabulary), loaded by the ModelRunner through
the GGUF conversion; logits and greedy tokens equal transformers' on the original weights.

What a GGUF cannot say is set as llama.cpp assumes it: Gemma's query_pre_attn_scalar is
transformers' default 256 (llama.cpp has no key for it), Gemma 3's layers follow the fixed
pattern of five sliding layers then one full one. SmolLM3 is left out: transformers' GGUF
loader, which the conversion uses, has no smollm3 architecture."""

import gguf
import pytest
import torch
from test_gpu_model_families_more import (
    SMALL,
    WINDOW,
    check_family,
    make_runner,
    tiny_config,
)

import gpu.models.model_files

pytestmark = pytest.mark.torch_threads(2)

FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3"]
ARCH = {
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
}


def gguf_config(family: str):
    import transformers as tf

    if family == "gemma2":
        cfg = tiny_config(family)
        cfg.query_pre_attn_scalar = 256
        return cfg
    if family == "gemma3":  # 6 layers: the 6th full, rope scaled there only
        cfg = tf.Gemma3TextConfig(
            **dict(SMALL, num_hidden_layers=6),
            head_dim=16,
            query_pre_attn_scalar=256,
            sliding_window=WINDOW,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
        )
        assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
        return cfg
    return tiny_config(family)


def tiny_model(family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gguf_config(family), dtype=torch.float32).eval()
    with torch.no_grad():  # as test_gpu_model_families_more.save_tiny
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if family == "gemma2" and name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return model


def write_gguf(family: str, model: torch.nn.Module, path) -> None:
    """As convert_hf_to_gguf.py's Qwen3Model / Phi3MiniModel / Gemma2Model / Gemma3Model write
    the text model, in F32."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    cfg, arch = model.config, ARCH[family]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(f"tiny-{family}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if family == "phi3":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if family.startswith("gemma"):
        w.add_sliding_window(cfg.sliding_window)
    if family == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    # a byte-level BPE vocabulary of the 256 bytes, without merges
    spelling = bytes_to_unicode()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([spelling[b] for b in range(cfg.vocab_size)])
    w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)

    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # no output.weight: tied
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        data = tensor.numpy()
        if family.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp multiplies by the stored weight
        w.add_tensor(gguf_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_family_from_gguf_matches_transformers(family, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu.models.model_files, "cache_root", lambda: tmp_path / "cache")
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "hf")
    write_gguf(family, model, tmp_path / f"tiny-{family}.gguf")
    runner = make_runner(tmp_path / f"tiny-{family}.gguf")
    assert runner.model_config.vocab_size == model.config.vocab_size
    check_family(family, tmp_path / "hf", runner)
