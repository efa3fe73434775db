"""Grammar bombs cannot starve the token path: a grammar that compiles for longer than
--grammar-compile-timeout fails its request with a 400, one whose matching cost grows with each
token is ended with a 400 before it stalls the steps, and meanwhile unconstrained requests and
requests whose grammar is cached are served."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from bad_requests import MODEL

# the bomb compiled in ~1.9 s of one core for the default model's vocabulary (xgrammar 0.2.9, this
# 2-core machine, quiet); a CI run saw it finish inside a 2 s timeout: the timeout keeps a 4x margin
COMPILE_TIMEOUT_S = 0.5
COMPILE_BOMB = ".{0,20000}"
MATCH_BOMB = "(a{0,700}){0,700}a{30}b"  # compiles at once; its 20th `a` costs seconds of mask fill unbounded
# what the server may take, on a loaded 2-core machine, to answer while the bombs go off: unbounded,
# the match bombs alone stall every step for minutes
SERVED_WITHIN_S = 60.0


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(
        start_server.Server.granian, workers=1, log_level="warning", grammar_compile_timeout=COMPILE_TIMEOUT_S
    )


def completion(server, timeout: float = 120, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Say something:", "max_tokens": 16, "temperature": 0, **fields}
    return httpx.post(server.url("/v1/completions"), json=body, timeout=timeout)


def compiled(server, regex: str) -> None:
    """`regex` compiled and cached: a new grammar waits behind a compile still running after
    its timeout (xgrammar's compile cannot be stopped), so it is sent again until it is served."""
    deadline = time.monotonic() + 120
    while (r := completion(server, guided_regex=regex)).status_code != 200 and time.monotonic() < deadline:
        assert "--grammar-compile-timeout" in r.json()["error"]["message"], r.text
    assert r.status_code == 200, r.text


def test_a_grammar_over_the_compile_timeout_is_a_400(server):
    assert completion(server, guided_regex="[0-9]{3}").status_code == 200  # the compiler is built
    start = time.monotonic()
    r = completion(server, guided_regex=COMPILE_BOMB)
    took = time.monotonic() - start
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "guided_regex" and "--grammar-compile-timeout" in error["message"], error
    assert took < COMPILE_TIMEOUT_S + 20, took


def test_match_bombs_end_and_others_are_served_meanwhile(server):
    cached = "(yes|no)"
    compiled(server, cached)
    with ThreadPoolExecutor(9) as pool:
        bombs = [pool.submit(completion, server, 300, guided_regex=MATCH_BOMB, prompt=f"A{i}:") for i in range(8)]
        time.sleep(1)
        start = time.monotonic()
        plain = completion(server, timeout=SERVED_WITHIN_S)
        plain_s = time.monotonic() - start
        hit = completion(server, timeout=SERVED_WITHIN_S, guided_regex=cached)
        hit_s = time.monotonic() - start - plain_s
        results = [b.result() for b in bombs]
    assert plain.status_code == 200 and hit.status_code == 200, (plain.text, hit.text)
    assert hit.json()["choices"][0]["text"] in ("yes", "no")
    print(f"unconstrained {plain_s:.2f} s, cached grammar {hit_s:.2f} s during 8 match bombs")
    for r in results:  # the a{30} cannot end early: each bomb ends with a 400 saying why
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "guided_regex" and "ms a token" in error["message"], error


def test_a_cached_grammar_is_served_while_another_compiles(server):
    cached = "(red|green|blue)"
    compiled(server, cached)
    with ThreadPoolExecutor(1) as pool:
        bomb = pool.submit(completion, server, 120, guided_regex=COMPILE_BOMB + "x")  # a new text: compiled anew
        time.sleep(0.5)
        start = time.monotonic()
        hit = completion(server, guided_regex=cached, timeout=SERVED_WITHIN_S)
        hit_s = time.monotonic() - start
        assert hit.status_code == 200 and hit.json()["choices"][0]["text"] in ("red", "green", "blue")
        assert bomb.result().status_code == 400
    assert hit_s < COMPILE_TIMEOUT_S + 10, hit_s  # not behind the compile, which ends at its timeout
    print(f"cached grammar served in {hit_s:.2f} s while another compiled")
