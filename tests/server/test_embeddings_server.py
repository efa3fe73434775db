"""Embeddings, scores and reranking on real servers: tiny random-weight models of two families
(Qwen2: last-token pooling, a decoder's default; Llama: mean pooling from a sentence-transformers
modules.json) served with --is-embedding, and a generation Llama for scores. The reference is
transformers on the same checkpoint: the last layer's hidden states (after the final norm),
pooled and L2-normalised; the score's, the softmax over the label tokens' next-token logits."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from tiny_models import save_tiny

pytestmark = pytest.mark.torch_threads(2)

KEY = "pool-key"
AUTH = {"authorization": f"Bearer {KEY}"}
IDS = [[1, 504, 3458, 282], [1, 2830, 314, 253, 1050], [77, 78, 79, 80, 81, 82, 83]]
LONG = [int(t) for t in np.random.default_rng(0).integers(2, 40000, 300)]  # 5 chunks of 64
TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors."]


def save(path: Path, family: str, seed: int, pooling: str | None = None) -> Path:
    save_tiny(path, seed, family)
    if pooling == "mean":  # a sentence-transformers model: its pooling and Normalize modules
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
        ]
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return path


def reference(path: Path, ids: list[int], pooling: str) -> np.ndarray:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    v = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(v, dim=0).numpy()


FAMILIES = {"qwen2": "last", "llama": "mean"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def embed_server(request, start_server, tmp_path_factory):
    family = request.param
    path = save(tmp_path_factory.mktemp(family) / "m", family, 3, FAMILIES[family])
    server = start_server(
        start_server.Server.granian,
        model_path=str(path),
        api_key=KEY,
        is_embedding=1,
        chunked_prefill_size=64,
        max_total_tokens=8192,
        max_running_requests=16,
    )
    return server, path, FAMILIES[family]


def post(server, route: str, body: dict, key: bool = True) -> httpx.Response:
    return httpx.post(server.url(route), json=body, headers=AUTH if key else {}, timeout=300)


def vectors(answer: dict) -> list[np.ndarray]:
    return [np.asarray(d["embedding"], np.float32) for d in sorted(answer["data"], key=lambda d: d["index"])]


def test_embeddings_equal_transformers(embed_server):
    server, path, pooling = embed_server
    r = post(server, "/v1/embeddings", {"input": IDS + [LONG]})
    assert r.status_code == 200, r.text
    body = r.json()
    got = vectors(body)
    for ids, v in zip(IDS + [LONG], got):
        np.testing.assert_allclose(v, reference(path, ids, pooling), atol=1e-4)
    assert body["usage"] == {
        "prompt_tokens": sum(map(len, IDS)) + len(LONG),
        "total_tokens": sum(map(len, IDS)) + len(LONG),
    }
    singles = [vectors(post(server, "/v1/embeddings", {"input": ids}).json())[0] for ids in IDS]
    np.testing.assert_allclose(np.stack(singles), np.stack(got[: len(IDS)]), atol=1e-5)


def test_text_and_ids_and_base64_agree(embed_server):
    server, _, _ = embed_server
    texts = post(server, "/v1/embeddings", {"input": TEXTS, "user": "u1"}).json()
    ids = [httpx.post(server.url("/tokenize"), json={"prompt": t}, headers=AUTH).json()["tokens"] for t in TEXTS]
    by_ids = post(server, "/v1/embeddings", {"input": ids}).json()
    np.testing.assert_allclose(np.stack(vectors(texts)), np.stack(vectors(by_ids)), atol=1e-6)
    b64 = post(server, "/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"}).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in b64["data"]]
    np.testing.assert_array_equal(np.stack(decoded), np.stack(vectors(texts)))
    encoded = post(server, "/encode", {"text": TEXTS[0]}).json()
    np.testing.assert_allclose(encoded["embedding"], vectors(texts)[0], atol=1e-6)


def test_embedding_refusals(embed_server):
    server, _, _ = embed_server
    for body, param, status in (
        ({"input": "x", "dimensions": 8}, "dimensions", 400),  # not a Matryoshka model
        ({"input": [list(range(5))] * 2049}, "input", 400),
        ({"input": [1] * 1025}, "input", 400),
        ({"input": [49152]}, "input", 400),
        ({"input": "x", "embed_dtype": "float16"}, "embed_dtype", 400),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", 400),
    ):
        r = post(server, "/v1/embeddings", body)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert post(server, "/v1/embeddings", {"input": "x"}, key=False).status_code == 401
    # a server for embeddings generates nothing, as vLLM answers
    for route, body, api in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "Chat Completions"),
        ("/v1/completions", {"prompt": "x"}, "Completions"),
        ("/generate", {"text": "x"}, "Generate"),
        ("/v1/responses", {"input": "x"}, "Responses"),
    ):
        r = post(server, route, body)
        assert r.status_code == 400 and r.json()["error"]["message"] == f"The model does not support {api} API"
    assert httpx.get(server.url("/health_generate"), timeout=60).status_code == 200  # the engine's own probe


@pytest.fixture(scope="module")
def gen_server(start_server, tmp_path_factory):
    path = save(tmp_path_factory.mktemp("gen") / "m", "llama", 4)
    server = start_server(
        start_server.Server.granian, model_path=str(path), api_key=KEY, max_total_tokens=8192, max_running_requests=16
    )
    return server, path


def label_reference(path: Path, ids: list[int], labels: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return torch.softmax(logits[labels], 0).numpy()


def test_scores_equal_transformers_and_share_the_query(gen_server):
    server, path = gen_server
    query = [int(t) for t in np.random.default_rng(1).integers(2, 40000, 40)]  # over two pages
    items = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    labels = [100, 200, 300]
    r = post(server, "/v1/score", {"query": query, "items": items, "label_token_ids": labels, "apply_softmax": True})
    assert r.status_code == 200, r.text
    body = r.json()
    for item, got in zip(items, body["scores"]):
        np.testing.assert_allclose(got, label_reference(path, query + item, labels), atol=1e-4)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * 32  # items 2 and 3: the query's full pages
    raw = post(server, "/v1/score", {"query": query, "items": items[:1], "label_token_ids": labels}).json()
    assert sum(raw["scores"][0]) < 1.0  # full-vocabulary probabilities of three tokens
    assert post(server, "/v1/embeddings", {"input": "x"}).json()["error"]["message"] == (
        "The model does not support Embeddings API"
    )
    r = post(server, "/v1/score", {"query": query, "items": [[1]] * 1025, "label_token_ids": labels})
    assert r.status_code == 400 and r.json()["error"]["param"] == "items"


def test_rerank_orders_by_yes_probability(gen_server):
    server, _ = gen_server
    docs = ["Paris is in France.", "Bananas are yellow.", "The sky is blue."]
    scores = post(server, "/v1/score", {"text_1": "Where is Paris?", "text_2": docs}).json()["data"]
    ranked = post(server, "/rerank", {"query": "Where is Paris?", "documents": docs, "top_n": 2}).json()
    by_score = sorted(range(3), key=lambda i: -scores[i]["score"])[:2]
    assert [r["index"] for r in ranked["results"]] == by_score
    assert all(0 < s["score"] < 1 for s in scores)
