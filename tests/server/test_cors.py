"""CORS (vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials)
and x-request-id, on a real server (the default model) that lists its origins and allows
credentials: preflights of allowed and disallowed origins, methods and headers; the headers
of plain, error and streamed responses; x-request-id echoed, taken as the request's id (the
response's id base and the rid /abort_request takes), and refused (400) when malformed."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from httpapi.request_fields import MAX_REQUEST_ID_CHARS

GOOD = "http://good.example"
BAD = "http://evil.example"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.granian,
        allowed_origins=json.dumps([GOOD, "http://other.example"]),
        allowed_methods="GET,POST",
        allowed_headers="authorization,content-type,x-request-id",
        allow_credentials=1,
        max_total_tokens=16384,
        max_running_requests=8,
    )


def preflight(server, origin, method="POST", headers="content-type"):
    return httpx.options(
        server.url("/v1/chat/completions"),
        headers={"origin": origin, "access-control-request-method": method, "access-control-request-headers": headers},
        timeout=30,
    )


def cors_headers(resp) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.startswith("access-control-") or k == "vary"}


def test_preflight_of_an_allowed_origin(server):
    resp = preflight(server, GOOD, headers="Content-Type, X-Request-Id")
    assert resp.status_code == 200, resp.text
    h = resp.headers
    assert h["access-control-allow-origin"] == GOOD and h["vary"] == "origin"
    assert h["access-control-allow-credentials"] == "true"
    assert h["access-control-allow-methods"] == "GET, POST"
    assert "x-request-id" in h["access-control-allow-headers"] and "authorization" in h["access-control-allow-headers"]
    assert h["access-control-max-age"] == "600"


@pytest.mark.parametrize(
    "origin,method,headers",
    [(BAD, "POST", "content-type"), (GOOD, "DELETE", "content-type"), (GOOD, "POST", "x-secret")],
    ids=["origin", "method", "header"],
)
def test_preflight_refused(server, origin, method, headers):
    resp = preflight(server, origin, method, headers)
    assert resp.status_code == 400
    if origin == BAD:
        assert cors_headers(resp) == {}


def test_plain_and_error_responses(server):
    ok = httpx.get(server.url("/v1/models"), headers={"origin": GOOD}, timeout=30)
    assert ok.headers["access-control-allow-origin"] == GOOD and ok.headers["vary"] == "origin"
    assert "x-request-id" in ok.headers["access-control-expose-headers"]
    missing = httpx.get(server.url("/nope"), headers={"origin": GOOD}, timeout=30)
    assert missing.status_code == 404 and missing.headers["access-control-allow-origin"] == GOOD
    # a disallowed origin is answered (the browser withholds it), without CORS headers
    bad = httpx.get(server.url("/v1/models"), headers={"origin": BAD}, timeout=30)
    assert bad.status_code == 200 and cors_headers(bad) == {}
    assert cors_headers(httpx.get(server.url("/v1/models"), timeout=30)) == {}


def test_streamed_response(server):
    body = {"model": None, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    body.pop("model")
    for origin, want in ((GOOD, GOOD), (BAD, None)):
        with httpx.stream(
            "POST", server.url("/v1/chat/completions"), json=body, headers={"origin": origin}, timeout=120
        ) as resp:
            assert resp.status_code == 200
            assert resp.headers.get("access-control-allow-origin") == want
            assert resp.read().endswith(b"data: [DONE]\n\n")


def test_x_request_id_names_the_request(server):
    rid = "trace-0123456789abcdef"
    resp = httpx.post(
        server.url("/v1/chat/completions"),
        headers={"x-request-id": rid},
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "request_id": "from-body"},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-request-id"] == rid and resp.json()["id"] == f"chatcmpl-{rid}"  # the header wins
    cmpl = httpx.post(
        server.url("/v1/completions"),
        headers={"x-request-id": rid},
        json={"prompt": "Hi", "max_tokens": 2},
        timeout=120,
    )
    assert cmpl.json()["id"] == f"cmpl-{rid}" and cmpl.headers["x-request-id"] == rid
    # echoed on every route, errors included
    assert httpx.get(server.url("/v1/models"), headers={"x-request-id": rid}, timeout=30).headers["x-request-id"] == rid
    assert "x-request-id" not in httpx.get(server.url("/v1/models"), timeout=30).headers


def test_abort_by_x_request_id(server):
    rid = "abort-me-7"
    first: dict = {}
    opened = threading.Event()

    def stream():
        with httpx.stream(
            "POST",
            server.url("/v1/completions"),
            headers={"x-request-id": rid},
            json={"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True},
            timeout=300,
        ) as resp:
            first["id"] = resp.headers.get("x-request-id")
            events = []
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    opened.set()
            first["events"] = events

    thread = threading.Thread(target=stream)
    thread.start()
    assert opened.wait(120)
    aborted = httpx.post(server.url("/abort_request"), json={"rid": f"cmpl-{rid}"}, timeout=30).json()
    thread.join(120)
    assert not thread.is_alive()
    assert aborted == {"aborted": 1}
    assert first["id"] == rid and first["events"][0]["id"] == f"cmpl-{rid}"
    finishes = [c["finish_reason"] for e in first["events"] for c in e["choices"] if c.get("finish_reason")]
    assert finishes == ["abort"] and len(first["events"]) < 4000


@pytest.mark.parametrize("value", ["has space", "x" * (MAX_REQUEST_ID_CHARS + 1), "caf\u00e9"])
def test_bad_x_request_id(server, value):
    resp = httpx.post(
        server.url("/v1/completions"),
        headers={"x-request-id": value.encode("latin-1")},
        json={"prompt": "Hi", "max_tokens": 2},
        timeout=30,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "x-request-id", resp.text
    assert "x-request-id" not in resp.headers
    body = httpx.post(
        server.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 2, "request_id": value}, timeout=30
    )
    assert body.status_code == 400 and body.json()["error"]["param"] == "request_id"


# ---------------------------------------------------------------- Cors alone


class Answer:
    def __init__(self) -> None:
        from starlette.datastructures import MutableHeaders

        self.headers = MutableHeaders()


def test_any_origin_with_credentials_echoes_the_origin():
    """`*` with credentials is not allowed by browsers: the origin itself, and vary (starlette's rule)."""
    from runtime.config import ServerArgs
    from runtime.http_worker.asgi import Cors

    cors = Cors(ServerArgs(allowed_origins=("*",), allow_credentials=True))
    answer = Answer()
    cors.add_headers(answer, b"http://x.example")
    assert answer.headers["access-control-allow-origin"] == "http://x.example"
    assert answer.headers["vary"] == "origin" and answer.headers["access-control-allow-credentials"] == "true"
    pre = Cors(ServerArgs(allowed_origins=("*",))).preflight(b"http://x.example", b"PATCH", b"X-Custom")
    assert pre.status_code == 200 and pre.headers["access-control-allow-headers"] == "X-Custom"
    assert pre.headers["access-control-allow-methods"] == "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
