"""The issue's mixed batch on a real server: the base and three adapters (ranks 4, 8, 16) of a
tiny random-weight Llama interleaved, prompts split into chunks of 8 tokens, prompts sharing a
prefix across requests of the same and of different adapters (the prefix cache hands a request
only its own adapter's pages), n-gram speculation on. Every request's greedy tokens equal what
it gets alone (PEFT's merged model, one request at a time), and the counters show that each
of the three actually happened: chunks, cache hits within an adapter (none across), drafts
verified and accepted."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_lora_runtime import metric
from tiny_models import peft_greedy, save_tiny, save_tiny_adapter

pytestmark = pytest.mark.torch_threads(2)

KEY = "lora-mixed-key"
AUTH = {"authorization": f"Bearer {KEY}"}
RANKS = {"a4": 4, "a8": 8, "a16": 16}
PAGE = 16
# 41 tokens, 16 of them a run repeated: prompt lookup finds drafts in it; two full pages cacheable
SHARED = [1, *range(500, 508), *range(600, 616), *range(600, 616)]
NEW = 16
LORAS = [None, *RANKS]


def prompt(suffix: int) -> list[int]:
    return [*SHARED, *range(700 + 10 * suffix, 706 + 10 * suffix)]


@pytest.fixture(scope="module")
def mixed_server(start_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_mixed")
    base = save_tiny(root / "m", 11)
    adapters = {name: save_tiny_adapter(base, root / name, r, seed) for seed, (name, r) in enumerate(RANKS.items())}
    server = start_server(
        start_server.Server.granian,
        model_path=str(base),
        api_key=KEY,
        enable_lora=1,
        lora_paths=json.dumps([f"{name}={path}" for name, path in adapters.items()]),
        chunked_prefill_size=8,
        page_size=PAGE,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=4,
        max_total_tokens=4096,
        max_running_requests=4,
    )
    return server, base, adapters


def generate(server, lora: str | None, ids: list[int]) -> dict:
    body: dict = {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}
    if lora is not None:
        body["lora_path"] = lora
    r = httpx.post(server.url("/generate"), json=body, headers=AUTH, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def engine(server) -> dict[str, float]:
    text = httpx.get(server.url("/metrics"), timeout=30).text
    return {k: metric(text, f"ringserve_{k}_total") for k in ("spec_verifies", "spec_accepted_tokens")}


def test_mixed_batch_with_chunks_prefix_reuse_and_speculation(mixed_server):
    server, base, adapters = mixed_server
    # wave 1: the base alone caches SHARED's pages for the base only
    # wave 2: the base and each adapter once, at the same time: only the base's request finds
    #   SHARED cached (an adapter's KV of the same tokens differs from the base's)
    # wave 3: each twice more, interleaved, with other suffixes: every one finds its own adapter's pages
    waves = [[(None, 0)], [(lora, 1) for lora in LORAS], [(lora, s) for s in (2, 3) for lora in LORAS]]
    before = engine(server)
    got: dict[tuple[str | None, int], dict] = {}
    for wave in waves:
        with ThreadPoolExecutor(len(wave)) as pool:
            answers = list(pool.map(lambda req: generate(server, req[0], prompt(req[1])), wave))
        got.update(zip(wave, answers))
    after = engine(server)

    want = {(lora, s): peft_greedy(base, None if lora is None else adapters[lora], prompt(s), NEW) for lora, s in got}
    assert len({tuple(want[(lora, 1)]) for lora in LORAS}) == len(LORAS), "the adapters must change the tokens"
    assert {req: a["output_ids"] for req, a in got.items()} == want

    cached = {req: a["meta_info"]["cached_tokens"] for req, a in got.items()}
    full = len(SHARED) // PAGE * PAGE
    assert cached[(None, 1)] == full
    assert all(cached[(lora, 1)] == 0 for lora in RANKS), cached
    assert all(cached[(lora, s)] >= full for lora in LORAS for s in (2, 3)), cached
    assert after["spec_verifies"] > before["spec_verifies"], "no draft was verified"
    assert after["spec_accepted_tokens"] > before["spec_accepted_tokens"], "no drafted token was accepted"
