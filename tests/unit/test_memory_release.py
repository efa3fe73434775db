"""What bounds the scheduler's memory (issue 28), tested as mechanisms rather than as an RSS
after a burst (timed, and shared with the machine's other load): the KV pool holds exactly
the tokens --max-total-tokens asks (in float16: llama.cpp's bytes) and is resident only
where touched; the file pages a repack copied leave the resident set; the
heap is trimmed once a burst is over, not during it, and a burst's large buffers are reused."""

from __future__ import annotations

import mmap
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gpu.kvcache.kv_cache import KVCache
from gpu.quant.blocks import unmap_resident
from runtime.heap_trim import IdleTrim

SMOLLM2 = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}  # the embedded model's attention


def resident_kib(path_or_anon: int) -> int:
    """Rss of this process's mapping that starts at address `path_or_anon`."""
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            found = int(head.split("-")[0], 16) <= path_or_anon < int(head.split("-")[1], 16)
        elif found and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds that address")


def test_kv_pool_holds_the_tokens_asked_in_llama_cpps_bytes_and_is_resident_where_touched():
    tokens, page_size = 16384, 16
    kv = KVCache(
        num_pages=tokens // page_size,
        page_size=page_size,
        dtype=torch.float16,
        device=torch.device("cpu"),
        **SMOLLM2,
    )
    # llama.cpp -c 16384: n_ctx x n_layer x (K + V) x n_embd_k_gqa x 2 bytes (f16), whatever -np
    llama_cpp_bytes = tokens * 30 * 2 * (3 * 64) * 2
    assert kv.buffer.nbytes == llama_cpp_bytes == tokens * KVCache.bytes_per_token(dtype=torch.float16, **SMOLLM2)
    address = kv.buffer.data_ptr()
    assert resident_kib(address) == 0  # a pool sized for every slot costs nothing until used
    kv.k[0][:8].fill_(1.0)  # 8 pages of one layer's K: 8 x 16 x 3 x 64 x 2 bytes = 48 KiB
    assert 48 <= resident_kib(address) <= 48 + 8  # and then what is touched, to the (4 KiB) page


def test_unmap_resident_drops_a_file_mappings_pages_and_keeps_their_contents(tmp_path):
    path = tmp_path / "blocks.bin"
    want = np.random.default_rng(0).integers(0, 256, 64 * mmap.PAGESIZE, dtype=np.uint8)
    want.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    view = mapped[mmap.PAGESIZE // 2 :]  # starts mid-page: that page stays
    assert int(view.astype(np.int64).sum()) == int(want[mmap.PAGESIZE // 2 :].astype(np.int64).sum())  # read
    before = resident_kib(mapped.ctypes.data)
    assert before >= 60 * mmap.PAGESIZE // 1024
    unmap_resident(view)
    assert resident_kib(mapped.ctypes.data) <= mmap.PAGESIZE // 1024  # the first page, shared with the header
    np.testing.assert_array_equal(mapped, want)  # read again from the file


def test_unmap_resident_leaves_the_processs_own_memory_alone():
    own = np.arange(16 * mmap.PAGESIZE, dtype=np.uint8)
    unmap_resident(own)  # MADV_DONTNEED would zero it
    np.testing.assert_array_equal(own, np.arange(16 * mmap.PAGESIZE, dtype=np.uint8))


def test_heap_is_trimmed_once_after_a_burst_not_during_it():
    trim = IdleTrim(after_s=0.05)
    assert not trim.idle()  # no work yet: nothing to give back
    trim.worked()
    assert not trim.idle()  # idle for less than after_s: requests coming one after another
    time.sleep(0.06)
    assert trim.idle()
    assert not trim.idle()  # once per burst
    trim.worked()
    time.sleep(0.06)
    assert trim.idle()


REUSE_PROBE = """
import resource, sys
import torch
from runtime.heap_trim import hold_freed_memory, return_freed_memory
if sys.argv[1] == "hold":
    hold_freed_memory()
def step():  # a step's logits: 40 MB, past glibc's largest mmap threshold, written then freed
    torch.empty(10 << 20).fill_(1.0)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_held_large_buffers_are_reused_by_a_bursts_next_step():
    """Held (the scheduler's setting), a freed 40 MB block is reused by the next step: no page
    faults; glibc's defaults map and fault it in again (10240 pages)."""

    def faults(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", REUSE_PROBE, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert faults("hold") < 1000
    assert faults("default") > 9000
