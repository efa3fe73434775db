"""Embeddings, scores and reranking (docs/embeddings.md). Each input is one pooled request
(SamplingParams.pooling) through the same scheduler as generation: prefill only, its answer one
POOLED record of float32 values (an embedding, or the label tokens' log-probabilities). The
pooling a model asks for is read from its files here (sentence-transformers' modules.json) and
travels in each request; normalising and Matryoshka truncation are done here, on the vector."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from httpapi.errors import APIError, bad_request
from httpapi.info import check_model
from httpapi.pooling_requests import (
    PairRequest,
    Prompt,
    ScoreRequest,
    embedding_body,
    encode_body,
    pair_score_body,
    parse_embedding,
    parse_encode,
    parse_rerank,
    parse_score,
    rerank_body,
    score_body,
)
from httpapi.sampling import check_prompt_chars, check_request_size, check_token_ids
from protocol.sampling_params import Pooling, SamplingParams
from runtime.http_worker.asgi import Handler, api_route, client_request_id, json_response, read_body
from runtime.http_worker.req_state import ReqState
from runtime.http_worker.routes import check_api, finished

POOLINGS = {"last": Pooling.LAST, "mean": Pooling.MEAN, "cls": Pooling.CLS}
# sentence-transformers' 1_Pooling/config.json keys, in the order they are taken
_ST_POOLING = (
    ("pooling_mode_lasttoken", Pooling.LAST),
    ("pooling_mode_mean_tokens", Pooling.MEAN),
    ("pooling_mode_cls_token", Pooling.CLS),
)
RERANK_LABELS = ("yes", "no")  # a decoder reranker's (Qwen3-Reranker's) answer tokens: P(yes) is the score


@dataclass(frozen=True)
class EmbeddingConfig:
    """How the served model's embeddings are made."""

    pooling: Pooling
    normalize: bool  # L2-normalised, as its sentence-transformers Normalize module (or vLLM's default) says
    matryoshka: bool  # `dimensions` may truncate it


@functools.lru_cache(maxsize=4)
def embedding_config(model_dir: str, flag: str | None) -> EmbeddingConfig:
    """The model's pooling (--pooling, else its 1_Pooling config, else last-token: a decoder's),
    whether it normalises (its modules.json's Normalize module; without modules.json, yes, as
    vLLM's default), and whether it is Matryoshka-trained (config.json, as vLLM reads it)."""
    root = Path(model_dir)
    pooling, normalize = Pooling.LAST, True
    modules = _json(root / "modules.json")
    if isinstance(modules, list):
        normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules if isinstance(m, dict))
        for m in modules:
            if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
                st = _json(root / str(m.get("path", "")) / "config.json")
                if isinstance(st, dict):
                    pooling = next((p for key, p in _ST_POOLING if st.get(key)), pooling)
    if flag is not None:
        pooling = POOLINGS[flag]
    cfg = _json(root / "config.json")
    matryoshka = isinstance(cfg, dict) and bool(cfg.get("is_matryoshka") or cfg.get("matryoshka_dimensions"))
    return EmbeddingConfig(pooling, normalize, matryoshka)


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


async def prompt_ids(worker, prompt: Prompt, param: str, add_special_tokens: bool = True) -> list[int]:
    """A pooled input's ids: it must fit the context (all of it: nothing is generated)."""
    m = worker.model
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), worker.tm.max_prompt_chars, param)
        ids = await worker.tm.encode(prompt, add_special_tokens)
    else:
        ids = prompt
    if not ids:
        raise bad_request(f"{param} has an empty input: each needs at least one token", param)
    if len(ids) > m.context_length:
        raise bad_request(
            f"This model's maximum context length is {m.context_length} tokens, and an input of {param} has "
            f"{len(ids)} tokens. Shorten it.",
            param,
            code="context_length_exceeded",
        )
    check_token_ids(ids, m.vocab_size, param)
    return list(ids)


async def _run(
    worker, request: Request, endpoint: str, prompts: list[list[int]], params: list[SamplingParams], param: str
) -> list[ReqState]:
    """The pooled requests, one per prompt and its params, all finished."""
    check_request_size([len(p) for p in prompts], params, 1, param, max_tokens=worker.kv_tokens)
    worker.metrics.count_request(endpoint)
    group = await worker.tm.submit(prompts, params)
    return await finished(worker, request, group)


def _values(state: ReqState) -> np.ndarray:
    return np.frombuffer(b"".join(state.parts), np.float32)


async def _embed(
    worker,
    request: Request,
    endpoint: str,
    inputs: list[Prompt],
    add_special: bool,
    truncate: int | None,
    dimensions: int | None,
    normalize: bool | None,
    param: str,
) -> tuple[list[np.ndarray], list[ReqState]]:
    cfg = embedding_config(worker.model.model_dir, worker.args.pooling)
    if dimensions is not None and not cfg.matryoshka:
        raise bad_request(
            "Model does not support matryoshka representation, changing output dimensions will lead to poor results.",
            "dimensions",
        )
    ids = []
    for p in inputs:
        got = await prompt_ids(worker, p, param, add_special)
        if truncate is not None:
            got = got[-(worker.model.context_length if truncate == -1 else truncate) :]
        ids.append(got)
    pooled = SamplingParams(max_new_tokens=1, temperature=0.0, pooling=cfg.pooling)
    states = await _run(worker, request, endpoint, ids, [pooled] * len(ids), param)
    vectors = []
    for state in states:
        v = _values(state)
        if dimensions is not None:
            if dimensions > len(v):
                raise bad_request(f"dimensions must be at most the model's {len(v)}", "dimensions")
            v = v[:dimensions]
        if cfg.normalize if normalize is None else normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        vectors.append(v.astype(np.float32))
    return vectors, states


@api_route
async def embeddings(worker, request: Request) -> Response:
    """OpenAI's /v1/embeddings."""
    req = parse_embedding(await read_body(request))
    check_model(req.model, worker.served_names)
    check_api(worker, "Embeddings", pooling=True)
    vectors, states = await _embed(
        worker,
        request,
        "embeddings",
        req.inputs,
        req.add_special_tokens,
        req.truncate_prompt_tokens,
        req.dimensions,
        req.normalize,
        "input",
    )
    tokens = sum(s.prompt_tokens for s in states)
    rid = client_request_id(request, req.request_id)
    return json_response(
        embedding_body(
            None if rid is None else f"embd-{rid}", worker.model.served_name, vectors, req.encoding_format, tokens
        )
    )


@api_route
async def encode(worker, request: Request) -> Response:
    """SGLang's /encode."""
    req = parse_encode(await read_body(request))
    check_api(worker, "Embeddings", pooling=True)
    param = "text" if isinstance(req.inputs[0], str) else "input_ids"
    vectors, states = await _embed(
        worker,
        request,
        "encode",
        req.inputs,
        req.add_special_tokens,
        req.truncate_prompt_tokens,
        req.dimensions,
        req.normalize,
        param,
    )
    return json_response(
        encode_body(vectors, [s.prompt_tokens for s in states], [s.cached_tokens for s in states], req.batch)
    )


async def label_logprobs(
    worker, request: Request, endpoint: str, prompts: list[list[int]], labels: list[tuple[int, ...]], param: str
) -> tuple[list[np.ndarray], list[ReqState]]:
    """Each prompt's next-token log-probabilities (over the whole vocabulary) at its labels'
    token ids, in their order. The first prompt runs alone first, so that the others find the
    prefix they share with it (a score's query, a decision's input) in the radix cache: N
    prompts compute it once."""
    params = [
        SamplingParams(max_new_tokens=1, temperature=0.0, pooling=Pooling.LABELS, allowed_token_ids=ids)
        for ids in labels
    ]
    states = await _run(worker, request, endpoint, prompts[:1], params[:1], param)
    if len(prompts) > 1:
        states += await _run(worker, request, endpoint, prompts[1:], params[1:], param)
    return [_values(s).astype(np.float64) for s in states], states


@api_route
async def score(worker, request: Request) -> Response:
    """/v1/score: SGLang's score API (query, items, label_token_ids) or vLLM's (text_1, text_2)."""
    req = parse_score(await read_body(request))
    check_model(req.model, worker.served_names)
    if isinstance(req, PairRequest):
        scores, tokens = await _pair_scores(worker, request, req)
        return json_response(pair_score_body(worker.model.served_name, scores, tokens))
    if worker.args.is_embedding:
        raise APIError(
            400,
            "The model does not support Score API with label_token_ids: it is served for embeddings",
            "label_token_ids",
            "BadRequestError",
        )
    check_token_ids(req.label_token_ids, worker.model.vocab_size, "label_token_ids")
    prompts = await _score_prompts(worker, req)
    read, states = await label_logprobs(
        worker, request, "score", prompts, [req.label_token_ids] * len(prompts), "items"
    )
    lps = np.stack(read)
    if req.apply_softmax:
        probs = np.exp(lps - lps.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
    else:
        probs = np.exp(lps)
    tokens = sum(s.prompt_tokens for s in states)
    cached = sum(s.cached_tokens for s in states)
    return json_response(score_body(worker.model.served_name, probs.tolist(), tokens, cached))


async def _score_prompts(worker, req: ScoreRequest) -> list[list[int]]:
    """SGLang's: query and item joined as texts (item first if asked), then tokenized; token ids joined as lists."""
    if isinstance(req.query, str):
        texts = [f"{item}{req.query}" if req.item_first else f"{req.query}{item}" for item in req.items]
        return [await prompt_ids(worker, t, "items") for t in texts]
    query = list(req.query)
    joined: list[list[int]] = [
        [*item, *query] if req.item_first else [*query, *item] for item in req.items if isinstance(item, list)
    ]
    return [await prompt_ids(worker, ids, "items") for ids in joined]


async def _pair_scores(worker, request: Request, req: PairRequest) -> tuple[list[float], int]:
    """One relevance score per (query, document): an embedding model's cosine similarity, a
    generation model's (a decoder reranker's) P(yes) against P(no) after query + document."""
    if worker.args.is_embedding:
        vectors, states = await _embed(
            worker, request, "score", [req.query, *req.documents], True, None, None, True, "query"
        )
        q = vectors[0]
        return [
            float(np.dot(q, d) / max(float(np.linalg.norm(q) * np.linalg.norm(d)), 1e-12)) for d in vectors[1:]
        ], sum(s.prompt_tokens for s in states)
    labels = []
    for word in RERANK_LABELS:
        ids = worker.tm.tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise APIError(
                400,
                f"The model does not support Score API: {word!r} is not one token of its vocabulary",
                None,
                "BadRequestError",
            )
        labels.append(ids[0])
    prompts = [await prompt_ids(worker, req.query + doc, "documents") for doc in req.documents]
    read, states = await label_logprobs(
        worker, request, "rerank" if req.rerank else "score", prompts, [tuple(labels)] * len(prompts), "documents"
    )
    lps = np.stack(read)
    yes_no = np.exp(lps - lps.max(axis=1, keepdims=True))
    return (yes_no[:, 0] / yes_no.sum(axis=1)).tolist(), sum(s.prompt_tokens for s in states)


@api_route
async def rerank(worker, request: Request) -> Response:
    """vLLM's /v1/rerank and Cohere/Jina's /rerank."""
    req = parse_rerank(await read_body(request))
    check_model(req.model, worker.served_names)
    scores, tokens = await _pair_scores(worker, request, req)
    return json_response(rerank_body(worker.model.served_name, req, scores, tokens))


POOLING_ROUTES: dict[str, dict[str, Handler]] = {
    "/v1/embeddings": {"POST": embeddings},
    "/encode": {"POST": encode},
    "/v1/score": {"POST": score},
    "/v1/rerank": {"POST": rerank},
    "/rerank": {"POST": rerank},
}
