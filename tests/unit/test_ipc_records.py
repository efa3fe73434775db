"""Record layouts: every SamplingParams field crosses the request channel; payload helpers round-trip."""

import dataclasses

import numpy as np
import pytest

from ipc import Channel, ChannelSpec, Waker
from protocol.payloads import (
    decode_strings,
    encode_strings,
    pack_logprobs,
    pack_prompt_logprobs,
    pack_top_logprobs,
    unpack_logprobs,
    unpack_prompt_logprobs,
    unpack_top_logprobs,
)
from protocol.record_bytes import concat_records, record_struct, take_records
from protocol.records import REQUEST, TEXT_OUT, TOKEN_OUT, RecordLayout, RequestKind, live_mask
from protocol.request_records import pack_control, pack_request, unpack_request
from protocol.sampling_params import GrammarKind, Pooling, SamplingParams


@pytest.fixture()
def pair():
    wp, wc = Waker(), Waker()
    made = []

    def make(layout: RecordLayout, capacity: int = 64, arena: int = 1 << 16):
        prod = Channel.create(ChannelSpec(layout, capacity, arena), "producer", wp, wc.fd)
        desc, fds = prod.describe()
        cons = Channel.attach(desc, fds, wc)
        made.extend((prod, cons))
        return prod, cons

    yield make
    for ch in made:
        ch.close()
    wp.close()
    wc.close()


def test_every_sampling_param_crosses_the_request_channel(pair):
    params = SamplingParams(
        max_new_tokens=77,
        min_new_tokens=3,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=-(2**63),
        repetition_penalty=1.1,
        frequency_penalty=-0.5,
        presence_penalty=1.5,
        stop=("\n\n", "stop\x00with nul", "é🙂"),
        stop_token_ids=tuple(range(16)),
        no_stop_trim=True,
        ignore_eos=True,
        skip_special_tokens=False,
        return_ids=True,
        spaces_between_special_tokens=False,
        logprobs=True,
        top_logprobs=20,
        logprob_token_ids=(49151, *range(19)),
        grammar_kind=GrammarKind.JSON_SCHEMA,
        grammar='{"type": "object", "properties": {"é🙂": {"type": "string"}}}',
        logit_bias=((5, -100.0), (49151, 2.5), (0, 0.25)),  # biases that float32 holds exactly
        allowed_token_ids=(7, 0, 49151, 7),
        thinking_budget=5,
        think_start_ids=(1, 2),
        think_end_ids=(3, 49151, 4),
        prompt_logprobs=20,
        prompt_logprobs_start=7,
        pooling=Pooling.LABELS,
        lora_id=65535,
    ).validate()
    changed = {
        f.name for f in dataclasses.fields(SamplingParams) if f.name != "extra" and getattr(params, f.name) != f.default
    }
    assert changed == {f.name for f in dataclasses.fields(SamplingParams)} - {"extra"}, "test must set every field"
    prod, cons = pair(REQUEST)
    prompt = np.arange(5000, dtype=np.uint32) * 7
    rec, blob = pack_request(3, 12345, 9, params, prompt, arrival_ns=42)
    prod.push(rec, blob)
    prod.push(pack_control(RequestKind.ABORT, 3, 12345, 9))
    default = SamplingParams()
    rec2, blob2 = pack_request(1, 2, 3, default, [1, 2, 3], arrival_ns=43)
    prod.push(rec2, blob2)
    batch = cons.pop()
    assert batch.records["kind"].tolist() == [RequestKind.NEW, RequestKind.ABORT, RequestKind.NEW]
    got, got_prompt = unpack_request(batch.records[0], batch.payload)
    assert got == params and np.array_equal(got_prompt, prompt)
    assert batch.records[0]["arrival_ns"] == 42 and batch.records[0]["worker"] == 3
    got2, got_prompt2 = unpack_request(batch.records[2], batch.payload)
    assert got2 == default and got_prompt2.tolist() == [1, 2, 3]


def test_requests_sharing_sampling_share_its_params_and_nothing_else(pair):
    """Each side converts a sampling setting once (memoized by object, and by record bytes plus
    stop strings): equal settings unpack to one object, settings that differ only in a stop
    string, a stop token or a per-request field do not mix."""
    base = SamplingParams(max_new_tokens=9, stop=("x",))
    variants = [
        base,
        SamplingParams(max_new_tokens=9, stop=("y",)),
        SamplingParams(max_new_tokens=9, stop=("x", "y")),
        SamplingParams(max_new_tokens=9, stop=("x",), stop_token_ids=(5,)),
        SamplingParams(max_new_tokens=9),
        SamplingParams(max_new_tokens=9, stop=("x",), grammar_kind=GrammarKind.REGEX, grammar="x+"),
        SamplingParams(max_new_tokens=9, stop=("x",), grammar_kind=GrammarKind.REGEX, grammar="y+"),
        SamplingParams(max_new_tokens=9, stop=("x",), logit_bias=((3, 1.0),)),
        SamplingParams(max_new_tokens=9, stop=("x",), logit_bias=((3, 2.0),)),
        SamplingParams(max_new_tokens=9, stop=("x",), logprobs=True, top_logprobs=1, logprob_token_ids=(3,)),
        SamplingParams(max_new_tokens=9, stop=("x",), logprobs=True, top_logprobs=1, logprob_token_ids=(4,)),
    ]
    prod, cons = pair(REQUEST)
    sent = [(base, 1), *((v, 2 + k) for k, v in enumerate(variants)), (base, 99)]
    for p, slot in sent:
        prod.push(*pack_request(0, slot, slot, p, [slot, slot + 1], arrival_ns=slot))
    batch = cons.pop()
    got = [unpack_request(r, batch.payload) for r in batch.records]
    assert [g for g, _ in got] == [p for p, _ in sent]
    assert [prompt.tolist() for _, prompt in got] == [[slot, slot + 1] for _, slot in sent]
    assert batch.records["slot"].tolist() == [slot for _, slot in sent]
    assert got[0][0] is got[1][0] is got[-1][0]  # one object for the three requests of `base`
    assert len({id(g) for g, _ in got}) == len(variants)


def test_hot_records_stay_small():
    assert TOKEN_OUT.dtype.itemsize <= 48
    assert TEXT_OUT.dtype.itemsize <= 64


def test_strings_round_trip():
    for strings in [(), ("a",), ("", "x" * 1000, "\x00", "日本語")]:
        assert decode_strings(encode_strings(strings)) == strings


def test_top_logprobs_travel_with_token_records(pair):
    prod, cons = pair(TOKEN_OUT)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 49152, (5, 20))
    vals = rng.standard_normal((5, 20)).astype(np.float32)
    blob, offsets = pack_top_logprobs(ids, vals)
    recs = np.zeros(5, TOKEN_OUT.dtype)
    recs["payload_off"], recs["payload_len"], recs["n_top"] = offsets, 8 * 20, 20
    prod.push(recs[:2], blob)  # two pushes: the second pop's offsets get rebased
    prod.push(recs[2:], blob)
    batch = cons.pop()
    for i, r in enumerate(batch.records):
        got_ids, got_vals = unpack_top_logprobs(batch.view(r["payload_off"], r["payload_len"]), 20)
        assert np.array_equal(got_ids, ids[i]) and np.array_equal(got_vals, vals[i])


def test_logprobs_payload_round_trip():
    ids, lps = np.array([5, 6, 7]), np.array([-0.1, -0.2, -0.3], np.float32)
    top_ids, top_lps = np.arange(6).reshape(3, 2), -np.arange(6, dtype=np.float32).reshape(3, 2)
    got = unpack_logprobs(np.frombuffer(pack_logprobs(ids, lps, top_ids, top_lps), np.uint8), 3, 2)
    for a, b in zip(got, (ids, lps, top_ids, top_lps)):
        assert np.array_equal(a, b)
    got = unpack_logprobs(np.frombuffer(pack_logprobs(ids, lps), np.uint8), 3, 0)
    assert np.array_equal(got[0], ids) and got[2].shape == (3, 0)


def test_prompt_logprobs_payload_round_trip(pair):
    """pack_prompt_logprobs -> a TOKEN_OUT push and pop (offsets rebased) -> unpack_prompt_logprobs:
    ids, logprobs (NaN at position 0), ranks, top-k; and with k = 0, ranks after the logprobs."""
    prod, cons = pair(TOKEN_OUT)
    ids, lps = np.array([1, 2, 3, 4]), np.array([np.nan, -0.5, -7.25, -0.0625], np.float32)
    ranks = np.array([0, 1, 4000, 2])
    top_ids = np.array([[0, 0], [2, 9], [8, 7], [6, 4]])
    top_lps = np.array([[np.nan, np.nan], [-0.5, -1.5], [-0.25, -2.0], [-0.01, -0.0625]], np.float32)
    parts = [
        pack_prompt_logprobs(ids, lps, ranks, top_ids, top_lps),
        pack_prompt_logprobs(ids, lps, ranks, ids[:, None][:, :0], lps[:, None][:, :0]),
    ]
    recs = np.zeros(2, TOKEN_OUT.dtype)
    recs["payload_off"] = [8, 8 + len(parts[0])]  # after an unrelated part
    recs["payload_len"], recs["n_top"] = [len(p) for p in parts], [2, 0]
    prod.push(recs[:1], b"\0" * 8 + parts[0] + parts[1])
    prod.push(recs[1:], b"\0" * 8 + parts[0] + parts[1])
    batch = cons.pop()  # both pushes: the second's offsets rebased past the first's blob
    got = [unpack_prompt_logprobs(batch.view(r["payload_off"], r["payload_len"]), 4, r["n_top"]) for r in batch.records]
    for (g_ids, g_lps, g_ranks, g_top_ids, g_top_lps), k in zip(got, (2, 0)):
        assert g_ids.tolist() == ids.tolist() and g_ranks.tolist() == ranks.tolist()
        np.testing.assert_array_equal(g_lps, lps)  # NaN where NaN
        assert g_top_ids.shape == g_top_lps.shape == (4, k)
    np.testing.assert_array_equal(got[0][3], top_ids)
    np.testing.assert_array_equal(got[0][4], top_lps)
    assert len(parts[0]) == 4 * (3 * 4 + 2 * 4 * 2) and len(parts[1]) == 4 * 3 * 4


def test_live_mask_drops_stale_and_out_of_range():
    recs = np.zeros(5, TOKEN_OUT.dtype)
    recs["worker"] = [0, 0, 1, 1, 7]
    recs["slot"] = [0, 1, 2, 99, 0]
    recs["gen"] = [5, 4, 9, 1, 1]
    table = np.zeros((2, 4), np.uint32)
    table[0, 0], table[0, 1], table[1, 2] = 5, 5, 9
    assert live_mask(recs, table).tolist() == [True, False, True, False, False]
    assert live_mask(recs, table[0]).tolist() == [True, False, False, False, False]


def test_bad_input_names_the_parameter(pair):
    prod, cons = pair(TOKEN_OUT, capacity=4, arena=64)
    with pytest.raises(ValueError, match="pop: this process is the producer"):
        prod.pop()
    with pytest.raises(ValueError, match="push: this process is the consumer"):
        cons.push(np.zeros(1, TOKEN_OUT.dtype))
    with pytest.raises(ValueError, match="max_records"):
        cons.pop(0)
    with pytest.raises(TypeError, match="records"):
        prod.push(np.zeros(2, REQUEST.dtype))
    with pytest.raises(TypeError, match="1-D array"):  # the layout's own dtype, but 2-D
        prod.push(np.zeros((2, 2), TOKEN_OUT.dtype))
    with pytest.raises(ValueError, match="payload of 100 bytes"):
        prod.push(np.zeros(1, TOKEN_OUT.dtype), b"x" * 100)
    with pytest.raises(ValueError, match="capacity"):
        ChannelSpec(TOKEN_OUT, 0)
    with pytest.raises(ValueError, match="role"):
        Channel.create(ChannelSpec(TOKEN_OUT, 4), "reader", prod.waker, 0)


@pytest.mark.parametrize("layout", [REQUEST, TOKEN_OUT, TEXT_OUT], ids=lambda l: l.name)
def test_record_copies_equal_numpys(layout):
    rng = np.random.default_rng(0)
    recs = np.frombuffer(rng.integers(0, 256, 50 * layout.dtype.itemsize, dtype=np.uint8).tobytes(), layout.dtype)
    mask, index = rng.random(50) < 0.5, rng.integers(0, 50, 30)
    for got, want in (
        (take_records(recs, mask), recs[mask]),
        (take_records(recs, index), recs[index]),
        (take_records(recs[::3], [2, 0]), recs[::3][[2, 0]]),
        (concat_records([recs[:7], recs[::2], recs[:0]]), np.concatenate([recs[:7], recs[::2]])),
    ):
        assert got.dtype == layout.dtype and len(got) == len(want)
        assert all(got[f].tobytes() == want[f].tobytes() for f in layout.dtype.names)  # padding aside


@pytest.mark.parametrize("layout", [REQUEST, TOKEN_OUT, TEXT_OUT], ids=lambda layout: layout.name)
def test_record_struct_packs_as_numpy(layout):
    rng = np.random.default_rng(0)
    for _ in range(20):
        values = []
        for name in layout.dtype.names:
            field = layout.dtype.fields[name][0]
            base, count = field.base, max(1, int(np.prod(field.shape)))
            if base.kind == "f":
                items = rng.standard_normal(count).astype(base).tolist()
            elif base.kind == "b":
                items = rng.integers(0, 2, count).astype(bool).tolist()
            else:
                info = np.iinfo(base)
                items = rng.integers(info.min, info.max, count, dtype=base, endpoint=True).tolist()
            values.append(tuple(items) if field.shape else items[0])
        flat = [item for v in values for item in (v if isinstance(v, tuple) else (v,))]
        packed = record_struct(layout.dtype).pack(*flat)
        assert len(packed) == layout.dtype.itemsize  # padding included (numpy leaves it unset: not compared)
        got, want = np.frombuffer(packed, layout.dtype), np.array([tuple(values)], layout.dtype)
        for name in layout.dtype.names:
            np.testing.assert_array_equal(got[name], want[name])
