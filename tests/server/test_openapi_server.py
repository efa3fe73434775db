"""/openapi.json and /docs on a running server, and schemathesis fuzzing the server's routes
against the document it serves: every documented example, then generated bodies, path
parameters and the like for each operation (a bounded number, within a time bound), and bodies
the document says are invalid; no answer may be a 5xx, each must be a documented status with a
documented media type and, where the document gives one, a body matching its schema (errors in
OpenAI's format), and an invalid body must be refused (the document is not looser than the
parsers: a field it bounds or types, they check)."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from openapi_spec_validator import validate
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES_PER_OPERATION = 8
FUZZ_BUDGET_S = 40.0  # the generated cases of all operations together (the examples come first)
POOLING_BUDGET_S = 10.0
POOLING_PATHS = ("/v1/embeddings", "/encode", "/v1/score", "/v1/rerank", "/rerank")
# A paused engine holds every generation that follows until /continue_generation: fuzzing it
# would turn the other operations' answers into waits, not find their bugs.
NOT_FUZZED = {("POST", "/pause_generation")}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
INVALID_CHECKS = [*CHECKS, negative_data_rejection]


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.granian,
        workers=1,
        null_model=True,
        log_level="error",  # the fuzzer's unknown fields would fill the log with their warnings
        max_total_tokens=16384,
        max_running_requests=32,
        root_path="/api",
    )


def test_the_document_and_page_are_served_under_the_root_path(server):
    with httpx.Client(base_url=server.base, timeout=30) as client:
        for prefix in ("", "/api"):  # as a proxy that strips the prefix passes it, and as one that keeps it
            doc = client.get(prefix + "/openapi.json")
            assert doc.status_code == 200 and doc.headers["content-type"] == "application/json"
            validate(doc.json())
            assert doc.json()["servers"] == [{"url": "/api"}]
            page = client.get(prefix + "/docs")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "/api/openapi.json" in page.text and "<script" not in page.text
        assert "/v1/models/{model}" in doc.json()["paths"]
        # found by the fuzzing: a 405's Allow lists the methods of this path, not of its neighbours
        r = client.request("OPTIONS", "/v1/responses/resp_none/cancel")
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
        assert client.get("/v1/responses/resp_none/cancel").status_code == 405
        assert client.get("/v1/responses/resp_none/other").status_code == 404


def test_every_documented_operation_is_answered(server):
    """Each documented path and method reaches its route: no 404 Not Found of the App or 405."""
    doc = httpx.get(server.url("/openapi.json")).json()
    with httpx.Client(base_url=server.base, timeout=60) as client:
        for path, methods in doc["paths"].items():
            url = path.replace("{model}", "SmolLM2-135M-Instruct").replace("{response_id}", "resp_none")
            for method, op in methods.items():
                if (method.upper(), path) in NOT_FUZZED:
                    continue
                examples = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("examples")
                body = next(iter(examples.values()))["value"] if examples else None
                r = client.request(method.upper(), url, json=body)
                assert r.status_code != 405, (method, path)
                if r.status_code == 404:  # what the request names does not exist (a stored response, an adapter)
                    assert r.json()["error"]["param"] is not None, (method, path, r.text)  # not the App's 404


def test_fuzzing_finds_no_5xx_and_no_answer_off_the_document(server):
    _fuzz(server, lambda path: True, FUZZ_BUDGET_S)


def test_fuzzing_the_pooling_routes_of_an_embedding_server(start_server):
    """On a generation server the pooling routes answer vLLM's 400 before they read the body:
    an --is-embedding server's parse, tokenize and pool what the fuzzer sends."""
    embedding = start_server(
        start_server.Server.granian, workers=1, null_model=True, is_embedding=True, log_level="error"
    )
    _fuzz(embedding, lambda path: path in POOLING_PATHS, POOLING_BUDGET_S)


def _fuzz(server, fuzzed: Callable[[str], bool], budget_s: float) -> None:
    """Each documented example, then generated valid and invalid cases of each operation whose
    path is `fuzzed`, within `budget_s` for the generated ones."""
    schema = schemathesis.openapi.from_url(server.url("/openapi.json"))
    base_url = server.base  # the document's server is /api; the App takes its routes without it too
    failures: list[str] = []
    sent: list[int] = []  # one entry a case
    operations = [
        op
        for op in (result.ok() for result in schema.get_all_operations())
        if (op.method.upper(), op.path) not in NOT_FUZZED and fuzzed(op.path)
    ]
    for op in operations:
        for strategy in schema.get_strategies_from_examples(op):
            _run(strategy, 1, base_url, failures, sent, op, CHECKS)
    per_op = budget_s / len(operations) / 2  # each mode's share: a loaded machine sends fewer cases
    for op in operations:
        _run(op.as_strategy(), EXAMPLES_PER_OPERATION, base_url, failures, sent, op, CHECKS, per_op)
        invalid = op.as_strategy(generation_mode=GenerationMode.NEGATIVE)
        _run(invalid, EXAMPLES_PER_OPERATION, base_url, failures, sent, op, INVALID_CHECKS, per_op)
    assert httpx.get(server.url("/health")).status_code == 200
    assert not failures, "\n\n".join(failures)
    assert len(sent) >= 4 * len(operations), len(sent)  # the fuzzing ran, not only its set-up


def _run(
    strategy,
    examples: int,
    base_url: str,
    failures: list[str],
    sent: list[int],
    op,
    checks: list,
    budget_s: float | None = None,
) -> None:
    started = time.monotonic()

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases every run: a failure here is reproducible
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def check(case) -> None:
        if budget_s is not None and time.monotonic() - started > budget_s:
            return
        sent.append(case.call_and_validate(base_url=base_url, checks=checks, timeout=30).status_code)

    try:
        check()
    except Unsatisfiable:
        pass
    except Exception as e:  # schemathesis' failure groups: every check that failed, with the case
        failures.append(f"{op.method.upper()} {op.path}: {str(e)[:2000]}")


def test_the_document_is_public_and_says_which_routes_need_the_key(start_server):
    keyed = start_server(start_server.Server.granian, workers=1, null_model=True, api_key="sk-test")
    with httpx.Client(base_url=keyed.base, timeout=30) as client:
        doc = client.get("/openapi.json")  # no key: public, as vLLM's
        assert doc.status_code == 200 and client.get("/docs").status_code == 200
        paths = doc.json()["paths"]
        assert paths["/v1/chat/completions"]["post"]["security"] == [{"apiKey": []}]
        assert "401" in paths["/v1/chat/completions"]["post"]["responses"]
        assert "security" not in paths["/openapi.json"]["get"] and "security" not in paths["/health"]["get"]
        refused = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
