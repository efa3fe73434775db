"""The Detokenizer core: TOKEN_OUT batches in, TEXT_OUT records out (runtime/detokenizer/core.py), with the
real tokenizer and the real record layouts of protocol/records.py."""

import numpy as np
import pytest

from ipc.ring import Batch
from protocol.payloads import (
    PayloadBuilder,
    encode_strings,
    pack_prompt_logprobs,
    unpack_logprobs,
    unpack_prompt_logprobs,
)
from protocol.records import NO_TOKEN, OPEN_RECORD, TOKEN_OUT, ErrorCode, Finish, OpenFlags, TextKind, TokenKind
from runtime.detokenizer.core import Detokenizer
from runtime.detokenizer.text_out import split_by_worker

DEFAULT_FLAGS = OpenFlags.SKIP_SPECIAL_TOKENS


@pytest.fixture(scope="module")
def router(tokenizer):
    """Shared by the tests (building the byte table takes a second): each test uses its own workers."""
    return Detokenizer(tokenizer, max_open=64)


def opened(w, s, g, stop=(), flags=DEFAULT_FLAGS, n_top=0):
    return dict(
        kind=TokenKind.OPEN, worker=w, slot=s, gen=g, flags=flags, top_logprobs=n_top, payload=encode_strings(stop)
    )


def tok(w, s, g, token, finish=Finish.NONE, logprob=0.0, top=None, completion=0):
    rec = dict(
        kind=TokenKind.TOKEN,
        worker=w,
        slot=s,
        gen=g,
        token=token,
        finish=finish,
        logprob=logprob,
        prompt_tokens=5,
        completion_tokens=completion,
        cached_tokens=2,
    )
    if top is not None:
        ids, lps = top
        rec.update(n_top=len(ids), payload=np.array(ids, np.uint32).tobytes() + np.array(lps, np.float32).tobytes())
    return rec


def batch(*items) -> Batch:
    recs = np.zeros(len(items), TOKEN_OUT.dtype)
    payload = PayloadBuilder()
    for i, item in enumerate(items):
        is_open = item["kind"] == TokenKind.OPEN  # OPEN records in their own layout
        rec = recs[i : i + 1].view(OPEN_RECORD)[0] if is_open else recs[i]
        for k, v in item.items():
            if k == "payload":
                rec["stop_off" if is_open else "payload_off"], rec["stop_len" if is_open else "payload_len"] = (
                    payload.add(v)
                )
            else:
                rec[k] = v
    return Batch(recs, np.frombuffer(payload.blob(), np.uint8))


def rows(records, blob):
    """TEXT_OUT records -> dicts, with the text and logprobs read from the blob."""
    out = []
    for r in records:
        d = {
            k: r[k].item()
            for k in (
                "worker",
                "slot",
                "gen",
                "kind",
                "finish",
                "n_tokens",
                "stop_index",
                "stop_token",
                "completion_tokens",
                "error",
            )
        }
        d["text"] = blob[r["text_off"] : r["text_off"] + r["text_len"]].tobytes()
        if r["ids_len"]:
            assert r["ids_off"] % 4 == 0
            d["ids"] = blob[r["ids_off"] : r["ids_off"] + r["ids_len"]].view(np.uint32).tolist()
        if r["logprobs_len"]:
            part = blob[r["logprobs_off"] : r["logprobs_off"] + r["logprobs_len"]]
            assert r["logprobs_off"] % 4 == 0
            ids, lps, top_ids, top_lps = unpack_logprobs(part, int(r["n_tokens"]), int(r["n_top"]))
            d["logprobs"] = (ids.tolist(), lps.tolist(), top_ids.tolist(), top_lps.tolist())
        out.append(d)
    return out


def test_stream_two_requests_with_stop_token_and_stale_records(tokenizer, router):
    a = tokenizer.encode("Hello 😀 world", add_special_tokens=False)
    b = tokenizer.encode("Bonjour", add_special_tokens=False)
    before = router.num_open
    out = rows(*router.handle(batch(opened(0, 3, 7), opened(0, 4, 1), tok(0, 3, 7, a[0]), tok(0, 4, 1, b[0]))))
    assert [(r["slot"], r["text"], r["n_tokens"]) for r in out] == [
        (3, b"Hello", 1),
        (4, tokenizer.decode(b[:1]).encode(), 1),
    ]

    text = b""
    for i, t in enumerate(a[1:], 1):
        got = rows(*router.handle(batch(tok(0, 3, 6, t), tok(0, 3, 7, t, completion=i + 1))))  # gen 6: stale
        assert all(r["gen"] == 7 for r in got)
        text += b"".join(r["text"] for r in got)
    assert (b"Hello" + text).decode() == tokenizer.decode(a)
    emoji_tokens = sum("\ufffd" in tokenizer.decode([t]) for t in a)
    assert emoji_tokens >= 2, "the emoji spans tokens: some steps send nothing"

    eos = tokenizer.eos_token_id
    out = rows(*router.handle(batch(tok(0, 3, 7, eos, Finish.STOP, completion=len(a) + 1))))
    assert out == [
        dict(
            worker=0,
            slot=3,
            gen=7,
            kind=TextKind.TEXT,
            finish=Finish.STOP,
            n_tokens=1,
            stop_index=-1,
            stop_token=eos,
            completion_tokens=len(a) + 1,
            error=0,
            text=b"",
        )
    ]
    assert rows(*router.handle(batch(tok(0, 3, 7, a[0])))) == [], "finished: later records are stale"
    assert router.num_open == before + 1


def test_no_stop_trim_keeps_the_stop_token_text(tokenizer, router):
    """OPEN flag NO_STOP_TRIM: a stop token's text stays in the output (stop_token_ids, SGLang's
    no_stop_trim); without it the text is dropped."""
    dot = tokenizer.encode(".", add_special_tokens=False)[0]
    for flags, want in ((DEFAULT_FLAGS, b""), (DEFAULT_FLAGS | OpenFlags.NO_STOP_TRIM, b".")):
        router.handle(batch(opened(2, 0, 1, flags=flags)))
        out = rows(*router.handle(batch(tok(2, 0, 1, dot, Finish.STOP, completion=1))))
        assert [(r["text"], r["finish"], r["stop_token"]) for r in out] == [(want, Finish.STOP, dot)]


def test_tokens_completing_no_character_are_counted_in_the_next_record(tokenizer, router):
    ids = tokenizer.encode("😀!", add_special_tokens=False)
    assert "\ufffd" in tokenizer.decode(ids[:1])
    router.handle(batch(opened(1, 0, 1)))
    assert rows(*router.handle(batch(tok(1, 0, 1, ids[0])))) == []
    out = rows(*router.handle(batch(*[tok(1, 0, 1, t) for t in ids[1:]])))
    assert [(r["text"].decode(), r["n_tokens"]) for r in out] == [("😀!", len(ids))]


def test_stop_string_finishes_and_trims(tokenizer, router):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    before = router.num_open
    router.handle(batch(opened(2, 1, 1, stop=("xyz", "three"))))
    out = rows(*router.handle(batch(*[tok(2, 1, 1, t) for t in ids])))
    assert [(r["text"], r["finish"], r["stop_index"], r["stop_token"]) for r in out] == [
        (b"one two ", Finish.STOP, 1, -1)
    ]
    assert router.num_open == before


def test_tokens_after_a_stop_string_are_not_the_request_s(tokenizer, router):
    """Several steps of tokens in one batch, a stop string completed by the third: the record
    counts three tokens, with their logprobs and ids only (it counted all, and the usage said
    40 tokens for a 6-token text)."""
    ids = tokenizer.encode("one two three four five six", add_special_tokens=False)
    k = next(k for k in range(len(ids)) if "three" in tokenizer.decode(ids[: k + 1])) + 1  # tokens through "three"
    assert k < len(ids)
    flags = DEFAULT_FLAGS | OpenFlags.LOGPROBS | OpenFlags.RETURN_IDS
    router.handle(batch(opened(2, 2, 1, stop=("three",), flags=flags)))
    out = rows(*router.handle(batch(*[tok(2, 2, 1, t, logprob=-0.5, completion=c) for c, t in enumerate(ids, 1)])))
    assert [(r["text"], r["finish"], r["completion_tokens"], r["n_tokens"]) for r in out] == [
        (b"one two ", Finish.STOP, k, k)
    ]
    assert out[0]["ids"] == ids[:k] and out[0]["logprobs"][0] == ids[:k]


def test_slot_reuse_within_one_batch(tokenizer, router):
    x, y = tokenizer.encode(" x", add_special_tokens=False)[0], tokenizer.encode(" y", add_special_tokens=False)[0]
    out = rows(
        *router.handle(
            batch(
                opened(3, 0, 1),
                tok(3, 0, 1, x),
                tok(3, 0, 1, x, Finish.LENGTH),
                opened(3, 0, 2),
                tok(3, 0, 2, y),
                tok(3, 0, 1, y),
            )
        )
    )
    assert [(r["gen"], r["text"], r["finish"], r["n_tokens"]) for r in out] == [
        (1, b" x x", Finish.LENGTH, 2),
        (2, b" y", Finish.NONE, 1),
    ]


def test_steps_in_one_batch_equal_steps_one_by_one(tokenizer):
    """Three steps in one popped batch, each OPENing a request in a fresh slot and finishing one:
    the OPENs are handled first and every TOKEN record in one pass, with the texts, finishes
    and token counts of handling the steps one at a time (fewer records: one per request)."""
    ids = tokenizer.encode(" one two 😀 three", add_special_tokens=False)
    steps = [
        [opened(9, 0, 1, stop=("three",)), opened(9, 1, 1)] + [tok(9, 0, 1, t) for t in ids[:2]],
        [opened(9, 2, 1)] + [tok(9, 1, 1, t) for t in ids] + [tok(9, 0, 1, t) for t in ids[2:]],
        [tok(9, 2, 1, ids[0], Finish.LENGTH, completion=1), tok(9, 1, 1, 2, Finish.STOP, completion=len(ids) + 1)],
    ]

    def per_request(outs):
        got = {}
        for r in outs:
            text, n, finish = got.get(r["slot"], (b"", 0, None))
            got[r["slot"]] = (text + r["text"], n + r["n_tokens"], r["finish"] or finish)
        return got

    one_by_one = Detokenizer(tokenizer, max_open=8)
    want = per_request([r for step in steps for r in rows(*one_by_one.handle(batch(*step)))])
    together = Detokenizer(tokenizer, max_open=8)
    got = rows(*together.handle(batch(*[item for step in steps for item in step])))
    assert per_request(got) == want and len(got) == 3
    assert want[0] == (b" one two \xf0\x9f\x98\x80 ", 5, Finish.STOP) and want[2][2] == Finish.LENGTH
    assert together.num_open == one_by_one.num_open == 0


def test_abort_without_token_and_error_record(router):
    router.handle(batch(opened(4, 2, 1)))
    out = rows(*router.handle(batch(tok(4, 2, 1, NO_TOKEN, Finish.ABORT))))
    assert [(r["text"], r["finish"], r["n_tokens"]) for r in out] == [(b"", Finish.ABORT, 0)]
    err = dict(
        kind=TokenKind.ERROR, worker=4, slot=5, gen=3, error=ErrorCode.PROMPT_TOO_LONG, payload=b"prompt is too long"
    )
    out = rows(*router.handle(batch(err)))
    assert [(r["kind"], r["finish"], r["error"], r["text"]) for r in out] == [
        (TextKind.ERROR, Finish.ERROR, ErrorCode.PROMPT_TOO_LONG, b"prompt is too long")
    ]


def test_logprobs_every_step_with_top_n(tokenizer, router):
    ids = tokenizer.encode("😀 ok", add_special_tokens=False)
    router.handle(batch(opened(5, 0, 1, n_top=2, flags=DEFAULT_FLAGS | OpenFlags.LOGPROBS), opened(5, 1, 1)))
    got = []
    for k, t in enumerate(ids):
        top = ([t, 7, 9], [-0.5, -1.5, -2.5])  # the scheduler sent 3 alternatives, 2 were asked
        got += rows(*router.handle(batch(tok(5, 0, 1, t, logprob=-0.25 * k, top=top), tok(5, 1, 1, t))))
    mine = [r for r in got if r["slot"] == 0]
    assert len(mine) == len(ids), "a record for every step, text or not"
    assert b"".join(r["text"] for r in mine).decode() == "😀 ok"
    for k, (r, t) in enumerate(zip(mine, ids)):
        assert r["logprobs"] == ([t], [-0.25 * k], [[t, 7]], [[-0.5, -1.5]])
    assert all("logprobs" not in r for r in got if r["slot"] == 1)


def test_out_of_capacity_open_is_an_error(tokenizer):
    small = Detokenizer(tokenizer, max_open=4, use_byte_table=False)
    out = rows(*small.handle(batch(*[opened(0, s, 1) for s in range(5)])))
    assert [(r["slot"], r["kind"], r["error"]) for r in out] == [(4, TextKind.ERROR, ErrorCode.OVERLOADED)]


def test_split_by_worker(tokenizer, router):
    a = tokenizer.encode("alpha beta", add_special_tokens=False)
    workers = (6, 7, 8)
    flags = {
        6: DEFAULT_FLAGS,
        7: DEFAULT_FLAGS | OpenFlags.LOGPROBS | OpenFlags.RETURN_IDS,
        8: DEFAULT_FLAGS | OpenFlags.RETURN_IDS,
    }
    items = [opened(w, 0, 1, flags=flags[w]) for w in workers]
    items += [tok(w, 0, 1, t, logprob=-1.0) for t in a for w in workers]
    records, blob = router.handle(batch(*items))
    parts = split_by_worker(records, blob)
    assert sorted(parts) == list(workers)
    for w, (recs, sub) in parts.items():
        got = rows(recs, sub)
        assert [r["worker"] for r in got] == [w] and got[0]["text"] == b"alpha beta"
        assert ("logprobs" in got[0]) == (w == 7)
        assert got[0].get("ids", []) == (a if w != 6 else [])
    assert split_by_worker(*parts[7]) == {7: parts[7]}


def test_return_ids_come_with_every_step_that_has_tokens(tokenizer, router):
    """RETURN_IDS: a record for every step with tokens, text or not (a split character), with
    their ids in order, several steps of one popped batch included; the stop token's id too."""
    ids = tokenizer.encode("a😀b", add_special_tokens=False)
    assert "\ufffd" in tokenizer.decode(ids[:2])
    router.handle(batch(opened(3, 0, 1, flags=DEFAULT_FLAGS | OpenFlags.RETURN_IDS)))
    first = rows(*router.handle(batch(tok(3, 0, 1, ids[0], completion=1))))
    partial = rows(*router.handle(batch(tok(3, 0, 1, ids[1], completion=2))))
    assert [(r["text"], r["ids"]) for r in first + partial] == [(b"a", ids[:1]), (b"", ids[1:2])]
    eos = tokenizer.eos_token_id
    rest = [tok(3, 0, 1, t, completion=k) for k, t in enumerate(ids[2:], 3)]
    last = rows(*router.handle(batch(*rest, opened(3, 1, 1), tok(3, 0, 1, eos, Finish.STOP, completion=len(ids) + 1))))
    assert [(r["text"], r["ids"], r["finish"]) for r in last] == [("😀b".encode(), ids[2:] + [eos], Finish.STOP)]


def prompt_lp(w, s, g, first, count, n_top=1, prompt_tokens=9):
    """A PROMPT_LOGPROBS record of positions [first, first + count) and its payload."""
    ids = np.arange(100 + first, 100 + first + count)
    lps = -np.arange(first, first + count, dtype=np.float32) / 4
    part = pack_prompt_logprobs(ids, lps, ids % 7 + 1, np.tile(ids[:, None], n_top), np.tile(lps[:, None], n_top))
    rec = dict(kind=TokenKind.PROMPT_LOGPROBS, worker=w, slot=s, gen=g, token=first, completion_tokens=count)
    rec.update(prompt_tokens=prompt_tokens, cached_tokens=0, n_top=n_top, logprob=np.nan, payload=part)
    return rec, part


def prompt_rows(records, blob):
    """The TEXT_OUT PROMPT_LOGPROBS records' (slot, gen, first, count, n_top, payload bytes)."""
    return [
        (
            r["slot"].item(),
            r["gen"].item(),
            r["stop_token"].item(),
            r["n_tokens"].item(),
            r["n_top"].item(),
            blob[r["logprobs_off"] : r["logprobs_off"] + r["logprobs_len"]].tobytes(),
        )
        for r in records
        if r["kind"] == TextKind.PROMPT_LOGPROBS
    ]


def test_prompt_logprobs_go_to_their_worker_ahead_of_the_request_s_text(tokenizer, router):
    """A PROMPT_LOGPROBS record becomes its TEXT_OUT twin (first position in stop_token, the
    count in n_tokens, the payload as it came) ahead of its request's first TEXT record, in a
    batch whose control records commute with its tokens and in one whose do not (a slot reused);
    one of a request not open (stale generation) is dropped."""
    x = tokenizer.encode(" x", add_special_tokens=False)[0]
    router.handle(batch(opened(7, 0, 1)))  # a running request, whose token comes first
    (a, a_part), (b, b_part) = prompt_lp(7, 1, 1, 0, 5, n_top=2), prompt_lp(7, 1, 1, 5, 4, n_top=2)
    stale, _ = prompt_lp(7, 1, 9, 0, 5)
    records, blob = router.handle(batch(tok(7, 0, 1, x), opened(7, 1, 1), a, stale, b, tok(7, 1, 1, x)))
    kinds = [(r["slot"].item(), r["kind"].item()) for r in records]
    assert kinds.index((1, TextKind.PROMPT_LOGPROBS)) < kinds.index((1, TextKind.TEXT))
    assert prompt_rows(records, blob) == [(1, 1, 0, 5, 2, a_part), (1, 1, 5, 4, 2, b_part)]
    assert all(r["finish"] == Finish.NONE and r["stop_index"] == -1 for r in records)
    assert [r["text"] for r in rows(records, blob) if r["kind"] == TextKind.TEXT] == [b" x", b" x"]

    # slot 0 ends and is reused in the same batch: the records are handled in order
    c, c_part = prompt_lp(7, 0, 2, 0, 3)
    records, blob = router.handle(batch(tok(7, 0, 1, x, Finish.LENGTH), opened(7, 0, 2), c, tok(7, 0, 2, x)))
    assert [(r["gen"].item(), r["kind"].item()) for r in records] == [
        (1, TextKind.TEXT),
        (2, TextKind.PROMPT_LOGPROBS),
        (2, TextKind.TEXT),
    ]
    assert prompt_rows(records, blob) == [(0, 2, 0, 3, 1, c_part)]
    got = unpack_prompt_logprobs(blob[records[1]["logprobs_off"] :], 3, 1)
    assert got[0].tolist() == [100, 101, 102] and got[2].tolist() == [3, 4, 5]
    # records of requests not open: dropped, whichever batch they come in
    assert len(router.handle(batch(prompt_lp(7, 3, 1, 0, 2)[0]))[0]) == 0
