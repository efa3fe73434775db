"""Property test: a channel (ring + arena) behaves like a bounded FIFO of (record, payload) pairs."""

from collections import deque

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ipc import Channel, ChannelSpec, Waker
from ipc.arena import align_up
from protocol.records import PayloadRef, RecordLayout

LAYOUT = RecordLayout(
    "model_test",
    np.dtype([("seq", np.uint64), ("off", np.uint32), ("len", np.uint32)]),
    payloads=(PayloadRef("off", "len", np.dtype(np.uint8)),),
)

push_op = st.tuples(st.just("push"), st.lists(st.integers(0, 24), min_size=1, max_size=12))
pop_op = st.tuples(st.just("pop"), st.one_of(st.none(), st.integers(1, 10)))
room_op = st.tuples(st.just("room"), st.integers(0, 40))


def payload_of(seq: int, n: int) -> bytes:
    return bytes((seq * 31 + j) & 0xFF for j in range(n))


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 9),
    arena=st.sampled_from([64, 128, 256, 1024]),
    ops=st.lists(st.one_of(push_op, pop_op, room_op), max_size=60),
)
# a pop that splits a push must keep that push's blob: the producer may not wrap over it
@example(capacity=4, arena=64, ops=[("push", [16, 16]), ("pop", 1), ("push", [16, 16]), ("push", [24]), ("pop", None)])
@pytest.mark.parametrize(
    "native", [(True, True), (False, True), (True, False)], ids=["c", "python-producer", "python-consumer"]
)
def test_channel_matches_fifo_model(native, capacity, arena, ops):
    """The C data path, and the Python one on either side of it (same segment, same protocol)."""
    wp, wc = Waker(), Waker()
    prod = Channel.create(ChannelSpec(LAYOUT, capacity, arena), "producer", wp, wc.fd, native=native[0])
    desc, fds = prod.describe()
    cons = Channel.attach(desc, fds, wc, LAYOUT, native=native[1])
    model: deque[tuple[int, bytes, int]] = deque()  # (seq, payload, push id)
    blobs: dict[int, int] = {}  # push id -> blob size, while any of its records is queued
    seq, max_blob = 0, 0
    try:
        for op, arg in ops:
            if op == "room":
                if prod.room_for(arg):
                    arg = [arg]  # room_for promised a one-record push with this payload fits
                else:
                    continue
            if op in ("push", "room"):
                lens = arg
                recs = np.zeros(len(lens), LAYOUT.dtype)
                parts, pos = [], 0
                for i, n in enumerate(lens):
                    recs[i] = (seq + i, pos, n)
                    parts.append(payload_of(seq + i, n))
                    pos += n
                blob = b"".join(parts)
                if len(blob) > arena:
                    with pytest.raises(ValueError, match="can never fit"):
                        prod.push(recs, blob)
                    continue
                free = capacity - len(model)
                live = sum(align_up(size) for size in blobs.values())
                pushed = prod.push(recs, blob)
                if pushed:
                    assert pushed == min(len(lens), free)
                else:
                    # back-pressure only when the ring is full or the arena really is
                    assert free == 0 or live + 2 * max_blob + 2 * align_up(len(blob)) + 8 > arena
                    assert op != "room"
                for i in range(pushed):
                    model.append((seq + i, parts[i], seq))
                if pushed:
                    blobs[seq] = len(blob)
                    max_blob = max(max_blob, len(blob))
                seq += len(lens)
            else:
                batch = cons.pop(arg)
                if not model:
                    assert batch is None
                    continue
                expect = [model.popleft() for _ in range(min(len(model), arg or len(model)))]
                assert batch.records["seq"].tolist() == [e[0] for e in expect]
                for rec, (_, payload, _) in zip(batch.records, expect):
                    assert batch.payload[rec["off"] : rec["off"] + rec["len"]].tobytes() == payload
                queued_pushes = {e[2] for e in model}
                blobs = {k: v for k, v in blobs.items() if k in queued_pushes}
            assert len(cons) == len(model)
            assert prod.free_records() == capacity - len(model)
            assert cons.readable() == bool(model)
    finally:
        for ch in (prod, cons, wp, wc):
            ch.close()
