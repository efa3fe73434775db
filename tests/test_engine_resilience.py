"""Issue 19, the engine loops: a record the detokenizer cannot handle fails its own request and
nothing else, and the memo of stop strings is bounded by bytes (runtime/detokenizer/deltas.py,
with the real tokenizer). The processes themselves: tests/test_scheduler_process.py (OPEN
payloads past the TOKEN_OUT arena) and tests/test_detokenizer_process.py (a stalled worker)."""

import numpy as np
import pytest
from transformers import AutoTokenizer

from gpu.model_files import resolve_model_dir
from ipc.ring import Batch
from protocol.records import (
    OPEN_RECORD,
    TOKEN_OUT,
    ErrorCode,
    Finish,
    OpenFlags,
    PayloadBuilder,
    TextKind,
    TokenKind,
    encode_strings,
)
from runtime.detokenizer import deltas as deltas_module
from runtime.detokenizer.deltas import TextDeltas


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture
def deltas(tokenizer):
    return TextDeltas(tokenizer, max_open=64)


def batch(*items) -> Batch:
    """TOKEN_OUT records from dicts; an OPEN's `stop` is raw payload bytes."""
    recs = np.zeros(len(items), TOKEN_OUT.dtype)
    payload = PayloadBuilder()
    for i, item in enumerate(items):
        item = dict(item)
        if item["kind"] == TokenKind.OPEN:
            rec = recs[i : i + 1].view(OPEN_RECORD)[0]
            rec["stop_off"], rec["stop_len"] = payload.add(item.pop("stop", encode_strings(())))
        else:
            rec = recs[i]
        for k, v in item.items():
            rec[k] = v
    return Batch(recs, np.frombuffer(payload.blob(), np.uint8))


def opened(slot, stop=None):
    item = dict(kind=TokenKind.OPEN, worker=0, slot=slot, gen=1, flags=OpenFlags.SKIP_SPECIAL_TOKENS)
    return item if stop is None else item | {"stop": stop}


def token(slot, tok, finish=Finish.NONE):
    return dict(kind=TokenKind.TOKEN, worker=0, slot=slot, gen=1, token=tok, finish=finish, completion_tokens=1)


def by_slot(out):
    records, blob = out
    return {
        int(r["slot"]): (int(r["kind"]), int(r["error"]), blob[r["text_off"] : r["text_off"] + r["text_len"]].tobytes())
        for r in records
    }


def test_an_open_that_cannot_be_read_fails_its_request_only(tokenizer, deltas):
    """Stop strings that are not UTF-8, that claim more bytes than they have, or an empty one:
    each such OPEN raised out of handle() (the detokenizer process died). Now each fails its
    own request (ERROR, INTERNAL) and the batch's other requests stream."""
    word = tokenizer.encode(" hello", add_special_tokens=False)[0]
    bad_utf8 = np.array([1, 2], np.uint32).tobytes() + b"\xff\xfe"
    empty = np.array([1, 0], np.uint32).tobytes()
    out = by_slot(
        deltas.handle(
            batch(
                opened(1),
                opened(2, bad_utf8),
                opened(3, empty),
                opened(4),
                token(1, word),
                token(2, word),
                token(3, word),
                token(4, word, Finish.LENGTH),
            )
        )
    )
    assert out[1] == (TextKind.TEXT, 0, b" hello") and out[4] == (TextKind.TEXT, 0, b" hello")
    for slot in (2, 3):
        assert out[slot][:2] == (TextKind.ERROR, ErrorCode.INTERNAL)
    assert deltas.num_open == 1  # slot 1; the failed ones hold nothing


def test_a_batch_that_raises_is_handled_one_record_at_a_time(tokenizer, deltas, monkeypatch):
    """A bug that one request's tokens meet in the batched pass: handle() raises, and
    handle_isolated (what the process's loop calls then) fails that request alone."""
    word = tokenizer.encode(" hello", add_special_tokens=False)[0]
    deltas.handle(batch(opened(1), opened(2), opened(3)))
    poisoned = int(deltas._index[0, 2])
    real_step = deltas.core.step

    def step(req, tok, finished):
        if poisoned in np.asarray(req).tolist():
            raise RuntimeError("a bug")
        return real_step(req, tok, finished)

    monkeypatch.setattr(deltas.core, "step", step)
    records = batch(token(1, word), token(2, word), token(3, word, Finish.LENGTH))
    with pytest.raises(RuntimeError):
        deltas.handle(records)
    out = by_slot(deltas.handle_isolated(records))
    assert out[1] == (TextKind.TEXT, 0, b" hello") and out[3] == (TextKind.TEXT, 0, b" hello")
    assert out[2][:2] == (TextKind.ERROR, ErrorCode.INTERNAL)
    assert deltas.num_open == 1  # slot 1 runs on; 2 failed, 3 finished


def test_stop_string_options_are_bounded_by_bytes(deltas):
    """60 requests with distinct 300 kB stop strings: the options kept for them stay under
    the memo's byte bound (an lru_cache of 1024 entries kept all ~36 MB)."""
    memo = deltas_module._OPTIONS
    memo.clear()
    for k in range(60):
        stop = encode_strings([chr(ord("a") + k % 26) * 150_000 + str(k)])
        deltas.handle(batch(opened(10, stop), token(10, 0, Finish.LENGTH)))
    assert 0 < memo.bytes <= memo.max_bytes <= 16 << 20
    assert len(memo) < 60
