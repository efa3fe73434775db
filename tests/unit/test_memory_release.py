"""What bounds the scheduler's memory (issue 28), tested as mechanisms rather than as an RSS
after a burst (timed, and shared with the machine's other load): the KV pool holds exactly
the tokens --max-total-tokens asks (in float16: llama.cpp's bytes) and is resident only
where touched; the file pages a repack copied leave the resident set; a step's largest
products (logits, a prompt chunk's MLP input) are written into storage kept through a burst;
the heap is trimmed once a burst is over, not during it."""

from __future__ import annotations

import mmap
import resource
import time
from pathlib import Path

import numpy as np
import torch

from gpu.kvcache.kv_cache import KVCache
from gpu.quant.blocks import unmap_resident
from gpu.row_buffer import RowBuffer
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
    released = []
    trim = IdleTrim(after_s=0.05, release=lambda: released.append(time.monotonic()))
    assert not trim.idle()  # no work yet: nothing to give back
    trim.worked()
    assert not trim.idle()  # idle for less than after_s: requests coming one after another
    time.sleep(0.06)
    assert trim.idle() and len(released) == 1  # what the burst's steps kept, then the heap
    assert not trim.idle()  # once per burst
    trim.worked()
    time.sleep(0.06)
    assert trim.idle() and len(released) == 2


def test_a_steps_largest_products_are_written_into_storage_kept_from_step_to_step():
    """A step's logits past glibc's mmap threshold (33.5 MB: 32 rows of a 262k vocabulary),
    freshly allocated, are faulted in page by page every step; kept, once per burst."""
    buffer = RowBuffer(262144, torch.device("cpu"))
    buffer.rows(32).fill_(1.0)
    assert buffer.capacity == 32
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step = buffer.rows(31)
    step.fill_(2.0)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 100  # 8k pages, faulted in before
    assert step.shape == (31, 262144) and step.is_contiguous()
    assert buffer.rows(33).shape == (33, 262144) and buffer.capacity == 64  # in steps of 32 rows
    buffer.release()
    assert buffer.capacity == 0
    assert buffer.rows(0).shape == (0, 262144)  # a step that samples nothing (a prompt's chunk)
    assert buffer.rows(1).shape == (1, 262144) and buffer.capacity == 32
