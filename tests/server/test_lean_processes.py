"""Only the scheduler holds the model: a real server (granian, two workers, the default
model) whose HTTP workers and detokenizer map no libtorch and stay under a resident-memory
bound a torch import alone would exceed; /metrics reports every process's resident memory
(process_resident_memory_bytes, labelled role and pid), whichever worker answers."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

# what an HTTP worker or the detokenizer may hold for a 135M model's tokenizer; importing
# torch alone adds ~200 MB (before this bound, each held 390-430 MB)
LEAN_RSS_BYTES = 250 << 20


def maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def rss(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def resident_samples(server) -> dict[tuple[str, int], float]:
    text = httpx.get(server.url("/metrics"), timeout=30).text
    families = [f for f in text_string_to_metric_families(text) if f.name == "process_resident_memory_bytes"]
    assert len(families) == 1 and families[0].type == "gauge"
    return {(s.labels["role"], int(s.labels["pid"])): s.value for s in families[0].samples}


def test_workers_and_detokenizer_hold_no_torch(start_server):
    server = start_server(start_server.Server.granian, workers=2)
    lean = [*server.workers, server.engine["detokenizer"]]
    assert len(lean) == 3
    assert [pid for pid in lean if maps_torch(pid)] == []
    assert maps_torch(server.engine["scheduler"])  # the model's process: the check sees torch where it is
    sizes = {pid: rss(pid) for pid in lean}
    assert all(size < LEAN_RSS_BYTES for size in sizes.values()), sizes

    expected = {
        ("server", server.pid),
        *(("http_worker", pid) for pid in server.workers),
        *((role, pid) for role, pid in server.engine.items()),
    }
    for _ in range(6):  # whichever worker answers lists every process
        samples = resident_samples(server)
        assert set(samples) == expected
        for (_, pid), value in samples.items():
            assert 0.5 * rss(pid) < value < 2 * rss(pid)
