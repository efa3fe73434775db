"""Embeddings, scores and reranking: request bodies and answers (OpenAI's /v1/embeddings,
SGLang's /encode and score API, vLLM's /v1/score and /v1/rerank, Cohere/Jina's /rerank).

Every input list is bounded before any tokenizing; a field vLLM or SGLang reads on these routes
that ringserve does not serve is a 400 naming it (REFUSED_FIELDS), as on the other routes.
docs/embeddings.md says what each route computes."""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from httpapi.errors import bad_request
from httpapi.fields import Fields, is_token_ids, load_object
from httpapi.responses import new_request_id

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on `input`'s items
MAX_SCORE_ITEMS = 1024  # items (documents) of one score or rerank call
MAX_LABEL_TOKEN_IDS = 256  # label tokens of one score call

Prompt = str | list[int]  # a text, or token ids

# fields the other servers read on these routes that change what they compute, and why not here
REFUSED_FIELDS = {
    "embed_dtype": "only float32 embeddings are served",
    "endianness": "only the host's (little-endian) float32 is served",
    "mm_processor_kwargs": "multimodal inputs are not served",
    "image_data": "multimodal inputs are not served",
    "audio_data": "multimodal inputs are not served",
    "video_data": "multimodal inputs are not served",
    "lora_path": "LoRA adapters are not served",
    "activation": "the score's activation is its softmax over the label tokens",
    "use_activation": "the score's activation is its softmax over the label tokens",
    "softmax": "use apply_softmax",
    "messages": "chat inputs to embeddings are not served: send the text",
    "cache_salt": "the prefix cache is not salted",
    "priority": "requests have no priorities",
}


def _refuse_known(f: Fields) -> None:
    for key, why in REFUSED_FIELDS.items():
        if f.obj.get(key) is not None:
            raise bad_request(f"{key} is not supported: {why}", key)


def _prompts(value: object, param: str, bound: int) -> tuple[list[Prompt], bool]:
    """OpenAI's `input` shapes: a string, token ids, or a list of either: (prompts, whether a list of them)."""
    if type(value) is str:
        return [value], False
    if is_token_ids(value) and value:
        return [list(value)], False  # type: ignore[call-overload]
    if type(value) is list and value and all(type(v) is str or (is_token_ids(v) and v) for v in value):
        if len(value) > bound:
            raise bad_request(f"{param} has {len(value)} items; at most {bound} are taken in one request", param)
        return list(value), True
    raise bad_request(
        f"{param} must be a string, a list of token ids, or a non-empty list of strings or of token id lists", param
    )


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str | None
    inputs: list[Prompt]
    batch: bool  # the input was a list of inputs (/encode answers a list then)
    encoding_format: str  # float, base64
    dimensions: int | None  # Matryoshka truncation
    normalize: bool | None  # vLLM's: None is the model's own
    add_special_tokens: bool
    truncate_prompt_tokens: int | None  # vLLM's: the input's last k tokens
    request_id: str | None


def parse_embedding(body: bytes) -> EmbeddingRequest:
    """OpenAI's (and vLLM's) /v1/embeddings body."""
    f = Fields(load_object(body))
    _refuse_known(f)
    model = f.get_str("model")
    raw = f.raw("input")
    if raw is None:
        raise bad_request("input is required", "input")
    inputs, batch = _prompts(raw, "input", MAX_EMBEDDING_INPUTS)
    return _embedding(f, model, inputs, batch, "/v1/embeddings")


def parse_encode(body: bytes) -> EmbeddingRequest:
    """SGLang's /encode body: `text` (one or a list) or `input_ids` (one list or a list of them)."""
    f = Fields(load_object(body))
    _refuse_known(f)
    text, ids = f.raw("text"), f.raw("input_ids")
    if (text is None) == (ids is None):
        raise bad_request("give exactly one of text and input_ids", "text")
    param = "text" if text is not None else "input_ids"
    if text is not None and not (type(text) is str or (type(text) is list and all(type(t) is str for t in text))):
        raise bad_request("text must be a string or a list of strings", "text")
    if ids is not None and not (is_token_ids(ids) or (type(ids) is list and all(is_token_ids(i) for i in ids))):
        raise bad_request("input_ids must be a list of token ids or a list of such lists", "input_ids")
    inputs, batch = _prompts(text if text is not None else ids, param, MAX_EMBEDDING_INPUTS)
    f.get_str("rid")
    f.get_object("sampling_params")  # an embedding samples nothing: SGLang ignores it too
    return _embedding(f, None, inputs, batch, "/encode")


def _embedding(f: Fields, model: str | None, inputs: list[Prompt], batch: bool, endpoint: str) -> EmbeddingRequest:
    encoding = f.get_str("encoding_format", "float", choices=("float", "base64"))
    dimensions = f.get_int("dimensions", minimum=1)
    truncate = f.get_int("truncate_prompt_tokens")
    if truncate is not None and truncate < 1 and truncate != -1:
        raise bad_request(
            "truncate_prompt_tokens must be -1 (the context) or a positive integer", "truncate_prompt_tokens"
        )
    request = EmbeddingRequest(
        model,
        inputs,
        batch,
        encoding,
        dimensions,
        f.get_bool("normalize"),
        f.get_bool("add_special_tokens", True),
        truncate,
        f.get_str("request_id"),
    )
    f.get_str("user")  # OpenAI's end-user id: read, changes nothing
    f.warn_unknown(endpoint)
    return request


@dataclass(frozen=True)
class ScoreRequest:
    """SGLang's score API: the probabilities of label_token_ids after each query + item prompt."""

    model: str | None
    query: Prompt
    items: list[Prompt]
    label_token_ids: tuple[int, ...]
    apply_softmax: bool
    item_first: bool


@dataclass(frozen=True)
class PairRequest:
    """vLLM's /v1/score (text_1 against each of text_2) and /v1/rerank, Cohere/Jina's /rerank
    (query against each document): one relevance score per pair."""

    model: str | None
    query: str
    documents: list[str]
    top_n: int | None  # rerank: the best n, best first (None: all)
    return_documents: bool
    rerank: bool


def parse_score(body: bytes) -> ScoreRequest | PairRequest:
    """/v1/score: SGLang's body (query, items, label_token_ids) or vLLM's (text_1, text_2)."""
    f = Fields(load_object(body))
    _refuse_known(f)
    model = f.get_str("model")
    if f.raw("text_1") is not None or f.raw("text_2") is not None:
        query, docs = f.raw("text_1"), f.raw("text_2")
        if type(query) is not str:
            raise bad_request("text_1 must be a string", "text_1")
        documents = _texts(docs, "text_2")
        f.warn_unknown("/v1/score")
        return PairRequest(model, query, documents, None, False, False)
    query = f.raw("query")
    if not (type(query) is str or (is_token_ids(query) and query)):
        raise bad_request("query must be a string or a list of token ids", "query")
    items = f.raw("items")
    if items is None:
        raise bad_request("items is required", "items")
    item_list, _ = _prompts(items, "items", MAX_SCORE_ITEMS)
    if (type(query) is str) != all(type(i) is str for i in item_list):
        raise bad_request("query and items must both be text or both be token ids", "items")
    labels = f.get_token_ids("label_token_ids")
    if not labels:
        raise bad_request("label_token_ids must name at least one token id", "label_token_ids")
    if len(labels) > MAX_LABEL_TOKEN_IDS:
        raise bad_request(f"label_token_ids may name at most {MAX_LABEL_TOKEN_IDS} tokens", "label_token_ids")
    apply_softmax = f.get_bool("apply_softmax", False)
    item_first = f.get_bool("item_first", False)
    f.warn_unknown("/v1/score")
    return ScoreRequest(model, query, item_list, labels, apply_softmax, item_first)  # type: ignore[arg-type]


def parse_rerank(body: bytes) -> PairRequest:
    """vLLM's /v1/rerank and Cohere/Jina's /rerank: query, documents, top_n, return_documents."""
    f = Fields(load_object(body))
    _refuse_known(f)
    model = f.get_str("model")
    query = f.raw("query")
    if type(query) is not str:
        raise bad_request("query must be a string", "query")
    documents = _texts(f.raw("documents"), "documents")
    top_n = f.get_int("top_n", minimum=1)
    return_documents = f.get_bool("return_documents", True)
    f.ignore("max_chunks_per_doc", "rank_fields")  # Cohere's, for long and structured documents: plain text here
    f.warn_unknown("/rerank")
    return PairRequest(model, query, documents, top_n, return_documents, True)


def _texts(value: object, param: str) -> list[str]:
    """A string, or a list of strings or of Cohere's {"text": ...} documents."""
    if type(value) is str:
        return [value]
    if type(value) is list and len(value) > MAX_SCORE_ITEMS:
        raise bad_request(f"{param} has {len(value)} items; at most {MAX_SCORE_ITEMS} are scored in one call", param)
    if type(value) is list and value:
        texts = [v if type(v) is str else v.get("text") if type(v) is dict else None for v in value]
        if all(type(t) is str for t in texts):
            return texts  # type: ignore[return-value]
    raise bad_request(f"{param} must be a string or a non-empty list of strings", param)


# ---------------------------------------------------------------- answers


def embedding_body(
    request_id: str | None, model: str, vectors: Sequence[np.ndarray], encoding: str, prompt_tokens: int
) -> bytes:
    """OpenAI's embeddings list (vLLM's id and created beside it)."""
    data = [
        {
            "object": "embedding",
            "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if encoding == "base64" else v,
            "index": i,
        }
        for i, v in enumerate(vectors)
    ]
    body = {
        "id": request_id or new_request_id("embd"),
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_body(
    vectors: Sequence[np.ndarray], prompt_tokens: Sequence[int], cached: Sequence[int], batch: bool
) -> bytes:
    """SGLang's /encode answer: {embedding, meta_info} per input, a list for a batch."""
    out = [
        {
            "embedding": v,
            "meta_info": {
                "id": new_request_id("encode"),
                "prompt_tokens": p,
                "cached_tokens": c,
                "finish_reason": None,
            },
        }
        for v, p, c in zip(vectors, prompt_tokens, cached)
    ]
    return orjson.dumps(out if batch else out[0], option=orjson.OPT_SERIALIZE_NUMPY)


def score_body(model: str, scores: list[list[float]], prompt_tokens: int, cached_tokens: int) -> bytes:
    """SGLang's ScoringResponse; usage carries the cached prompt tokens too."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 0,
        "total_tokens": prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    return orjson.dumps({"scores": scores, "model": model, "usage": usage, "object": "scoring"})


def pair_score_body(model: str, scores: list[float], prompt_tokens: int) -> bytes:
    """vLLM's /v1/score answer."""
    body = {
        "id": new_request_id("score"),
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return orjson.dumps(body)


def rerank_body(model: str, req: PairRequest, scores: list[float], prompt_tokens: int) -> bytes:
    """vLLM's (and Cohere/Jina's) rerank answer: the best top_n, best first."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or len(scores)]
    results = [
        {
            "index": i,
            "relevance_score": scores[i],
            **({"document": {"text": req.documents[i]}} if req.return_documents else {}),
        }
        for i in order
    ]
    body = {
        "id": new_request_id("rerank"),
        "model": model,
        "usage": {"total_tokens": prompt_tokens},
        "results": results,
    }
    return orjson.dumps(body)
