"""--is-embedding's vLLM spellings (`--task embed`, `--runner pooling`) and the embedding routes' bounds."""

from __future__ import annotations

import pytest

from httpapi.errors import APIError
from httpapi.pooling_requests import MAX_EMBEDDING_INPUTS, parse_embedding, parse_rerank, parse_score
from runtime import settings
from runtime.config import ServerArgs


def cli(*argv: str) -> dict:
    return settings.parse_cli(ServerArgs, list(argv), "p", "d")


def test_vllm_spellings_of_is_embedding():
    assert cli("--task", "embed") == {"is_embedding": True}
    assert cli("--runner", "pooling", "--is-embedding") == {"is_embedding": True}
    assert cli("--task", "generate") == {"is_embedding": False}
    with pytest.raises(ValueError, match="conflict"):
        cli("--task", "generate", "--is-embedding")


@pytest.mark.parametrize(
    "parse, body, param",
    [
        (parse_embedding, b'{"input": []}', "input"),
        (parse_embedding, b'{"input": "x", "dimensions": 0}', "dimensions"),
        (parse_embedding, b'{"input": "x", "endianness": "big"}', "endianness"),
        (parse_embedding, b'{"input": [[1], "x", 3]}', "input"),
        (parse_score, b'{"query": "q", "items": ["a"]}', "label_token_ids"),
        (parse_score, b'{"query": "q", "items": [[1]], "label_token_ids": [1]}', "items"),
        (parse_rerank, b'{"query": "q", "documents": ["a"], "top_n": 0}', "top_n"),
    ],
)
def test_refusals_name_their_parameter(parse, body, param):
    with pytest.raises(APIError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.param == param


def test_inputs_are_bounded_before_any_work():
    body = b'{"input": [' + b",".join([b'"x"'] * (MAX_EMBEDDING_INPUTS + 1)) + b"]}"
    with pytest.raises(APIError) as e:
        parse_embedding(body)
    assert e.value.param == "input"
