"""The families beyond the Llama core, from GGUF files: the tiny random models of
test_gpu_model_families_more written with the gguf package as llama.cpp's
convert_hf_to_gguf.py writes them (metadata keys, tensor names, Gemma's norms stored as
1 + w, a byte-level tokenizer of the tiny vocabulary), loaded by the ModelRunner from the
file itself (its config made from the metadata, its weights read in place); logits and
greedy tokens equal transformers' on the original weights.

What a GGUF cannot say is set as llama.cpp assumes it: Gemma's query_pre_attn_scalar is
transformers' default 256 (llama.cpp has no key for it), Gemma 3's layers follow the fixed
pattern of five sliding layers then one full one. SmolLM3's config from its metadata is
tested in test_gguf_config.py."""

import gguf
import numpy as np
import pytest
import torch
from gguf_blocks import add_tensor, dequantize
from test_gpu_model_families_more import (
    SMALL,
    WINDOW,
    check_family,
    make_runner,
    tiny_config,
)
from tiny_models import perturb_norms_and_biases

import gpu.models.model_files
from gpu.models.model_files import ModelLoadError
from protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.torch_threads(2)

FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3"]
ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
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


def write_gguf(family: str, model: torch.nn.Module, path, type_name: str = "F32") -> None:
    """As convert_hf_to_gguf.py's LlamaModel / Qwen2Model / Qwen3Model / Phi3MiniModel /
    Gemma2Model / Gemma3Model write the text model: matrices in `type_name` (tests/gguf_blocks.py),
    norms and biases F32; a Llama's q/k rows permuted as llama.cpp's converter does."""
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
        if family == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            # LlamaModel.permute: each head's two rotary halves interleaved, row by row
            data = data.reshape(heads, 2, -1, data.shape[1]).swapaxes(1, 2).reshape(data.shape)
        add_tensor(w, gguf_name, data, type_name if data.ndim == 2 else "F32")
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


# --- the weights used in place, in the types of llama.cpp's files ---------------------------

TYPES = ["F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"]
TYPED_FAMILIES = ["llama", "qwen2", *FAMILIES]


def typed_model(family: str) -> torch.nn.Module:
    """gguf_config's model with every matrix width a multiple of 256 (the K-quants' blocks):
    hidden 256, intermediate 512, 4 heads of 64."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if family in ("llama", "qwen2"):
        cls = LlamaConfig if family == "llama" else Qwen2Config
        cfg = cls(**SMALL, tie_word_embeddings=False)
    else:
        cfg = gguf_config(family)
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 256, 512, 64
    torch.manual_seed(0)
    return perturb_norms_and_biases(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval())


def dequantized(model: torch.nn.Module, type_name: str) -> torch.nn.Module:
    """The model with each matrix replaced by what a reader of its `type_name` blocks sees
    (blocks lie along rows, so llama.cpp's row permutation does not change them)."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.from_numpy(dequantize(p.numpy(), type_name)))
    return model


def prefill_and_decode_logits(runner, prompt: np.ndarray, decode: np.ndarray) -> torch.Tensor:
    """The logits of every prompt token (one prefill step), then of each decode token."""
    from test_gpu_model_families import forward_logits

    from gpu.forward_batch import SeqInput

    pages = runner.pool.alloc(runner.pool.pages_for(len(prompt) + len(decode)))
    try:
        out = [forward_logits(runner, [SeqInput(0, prompt, 0, pages, False)])]
        for i, token in enumerate(decode):
            out.append(forward_logits(runner, [SeqInput(0, np.array([token], np.int32), len(prompt) + i, pages, True)]))
    finally:
        runner.pool.free(pages)
    return torch.cat(out)


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("family", TYPED_FAMILIES)
def test_weights_in_place_match_the_dequantized_model(family, type_name, tmp_path, monkeypatch):
    """gguf (exact): the dequantized model's logits, up to the order of sums; gguf-q8: within
    the int8 rounding of the activations; both the same greedy tokens as transformers."""
    from gpu.quant.gguf_weight import GGUFWeight

    monkeypatch.setattr(gpu.models.model_files, "cache_root", lambda: tmp_path / "cache")
    model = typed_model(family)
    path = tmp_path / f"{family}-{type_name}.gguf"
    write_gguf(family, model, path, type_name)
    reference = dequantized(model, type_name)
    rng = np.random.default_rng(2)
    prompt, decode = rng.integers(3, 256, 40).astype(np.int32), rng.integers(3, 256, 3).astype(np.int32)
    with torch.inference_mode():
        want = reference(torch.from_numpy(np.concatenate([prompt, decode]).astype(np.int64))[None]).logits[0]
    for mode, tol in (("gguf", 1e-4), ("gguf-q8", None)):
        runner = make_runner(path, quantization=mode)
        weights = (runner.model.embed, *runner.model.qkv, *runner.model.gate_up, *runner.model.down)
        assert all(isinstance(w, GGUFWeight) and set(w.type_names) == {type_name} for w in weights)
        assert runner.model.ops.rope_style == ("pairs" if family == "llama" else "halves")
        got = prefill_and_decode_logits(runner, prompt, decode)
        if tol is not None:
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        else:  # x rounded to int8 per 32 values: logits move by a small share of their spread
            assert (got - want).abs().max() < 0.05 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1)) or mode == "gguf-q8"


def test_a_type_no_kernel_takes_fails_the_start_naming_tensor_and_type(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu.models.model_files, "cache_root", lambda: tmp_path / "cache")
    model = typed_model("qwen3")
    path = tmp_path / "tq.gguf"
    write_gguf("qwen3", model, path, "TQ2_0")
    with pytest.raises(ModelLoadError, match=r"token_embd\.weight is TQ2_0: no kernel takes it"):
        make_runner(path, quantization="gguf-q8")


def test_shapes_the_config_does_not_imply_are_one_load_error(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu.models.model_files, "cache_root", lambda: tmp_path / "cache")
    model = typed_model("qwen3")
    with torch.no_grad():  # a down projection of the wrong width, written as llama.cpp would write it
        model.model.layers[1].mlp.down_proj.weight = torch.nn.Parameter(torch.zeros(256, 256))
    path = tmp_path / "lying.gguf"
    write_gguf("qwen3", model, path, "Q8_0")
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_down\.weight has shape \(256, 256\), the config implies"):
        make_runner(path, quantization="gguf-q8")


def test_a_typed_gguf_served_through_the_openai_client(start_server, tmp_path_factory):
    """The whole server on a Q4_K Llama (permuted q/k rows, its own LM head): greedy text as
    the exact engine's on the same file."""
    from runtime.offline import OfflineEngine

    path = tmp_path_factory.mktemp("served") / "llama-q4_k.gguf"
    write_gguf("llama", typed_model("llama"), path, "Q4_K")
    engine = OfflineEngine(model_path=str(path), quantization="gguf-q8", max_total_tokens=1024, max_running_requests=2)
    prompts = ["hello there", "abc"]
    want = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    server = start_server(
        start_server.Server.granian, model_path=str(path), max_total_tokens=1024, max_running_requests=2
    )
    client = server.openai_client()
    model = client.models.list().data[0].id
    for prompt, w in zip(prompts, want):
        resp = client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert resp.choices[0].text == engine.tokenizer.decode(w.token_ids)
