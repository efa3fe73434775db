"""REQUEST records (protocol/records.py REQUEST): a new request with its sampling settings and
payload, read back on the scheduler's side, and the control records (aborts, cache flush).
Both sides convert a sampling setting once and keep it in a memo bounded by bytes."""

from __future__ import annotations

import array
import hashlib
import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from protocol.memo import ByteLRU, string_bytes
from protocol.payloads import decode_strings, encode_strings
from protocol.record_bytes import record_struct
from protocol.records import REQUEST, RequestKind, fields_of
from protocol.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams

MEMO_BYTES = 4 << 20  # each memo of sampling settings (protocol/memo.py)
_REQUEST_FIELDS = fields_of(REQUEST.dtype)
SAMPLING_AT = _REQUEST_FIELDS["has_seed"][1]  # the record's sampling part: has_seed to the end


def rid_hash(rid: str) -> int:
    """A request id as the u64 the scheduler matches ABORT_RID against (never 0)."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little") or 1


def pack_request(
    worker: int,
    slot: int,
    gen: int,
    params: SamplingParams,
    prompt_ids: np.ndarray | Sequence[int],
    arrival_ns: int,
    rid: int = 0,
    base: int = 0,
) -> tuple[np.ndarray, bytes]:
    """One NEW request record and its payload blob (the prompt's uint32 ids, then the stop
    strings, the grammar, the logit bias, the allowed token ids, the reasoning's markers and
    the logprob token ids, each 4-aligned), ready for `channel.push(record, blob)`. rid:
    rid_hash() of the request's id, 0 for none. base: where the blob starts in the push's
    payload, when several requests go in one push. The record is packed by struct
    (record_struct), the sampling part once per SamplingParams object: set field by field, a
    numpy record costs a numpy call a field."""
    packed = _packed_sampling(params)
    prompt = (array.array("I", prompt_ids) if type(prompt_ids) is list else np.asarray(prompt_ids, np.uint32)).tobytes()
    at = base + len(prompt)  # the extras stay 4-aligned: the prompt is whole u32s
    head = _REQUEST_HEAD.pack(
        RequestKind.NEW,
        worker,
        slot,
        gen,
        arrival_ns,
        rid,
        base,
        len(prompt),
        at,
        packed.stop_len,
        at + packed.grammar_at,
        packed.grammar_len,
        at + packed.bias_at,
        packed.bias_len,
        at + packed.allowed_at,
        packed.allowed_len,
        at + packed.think_at,
        packed.think_len,
        at + packed.lp_ids_at,
        packed.lp_ids_len,
    )
    return np.frombuffer(bytearray(head + packed.sampling), REQUEST.dtype), prompt + packed.extras


def unpack_request(record: np.void, payload: np.ndarray) -> tuple[SamplingParams, np.ndarray]:
    """(params, prompt ids u32 view) of one NEW record of a popped batch. Requests with the
    same sampling bytes, stop strings, grammar, bias and allowed ids get the same (frozen)
    SamplingParams."""
    raw = record.tobytes()
    (
        prompt_off,
        prompt_len,
        stop_off,
        stop_len,
        grammar_off,
        grammar_len,
        bias_off,
        bias_len,
        allowed_off,
        allowed_len,
        think_off,
        think_len,
        lp_ids_off,
        lp_ids_len,
    ) = _REQUEST_HEAD.unpack_from(raw)[6:]
    key = raw[SAMPLING_AT:] + _EXTRA_LENS.pack(stop_len, grammar_len, bias_len, allowed_len, think_len, lp_ids_len)
    key += payload[stop_off : stop_off + stop_len].tobytes()
    if grammar_len:
        key += payload[grammar_off : grammar_off + grammar_len].tobytes()
    if bias_len:
        key += payload[bias_off : bias_off + bias_len].tobytes()
    if allowed_len:
        key += payload[allowed_off : allowed_off + allowed_len].tobytes()
    if think_len:
        key += payload[think_off : think_off + think_len].tobytes()
    if lp_ids_len:
        key += payload[lp_ids_off : lp_ids_off + lp_ids_len].tobytes()
    params = _PARAMS.get(key)
    if params is None:  # a server sees a few distinct sampling settings: each converted once
        params = _params_of(key)
        _PARAMS.put(key, params, len(key) + string_bytes(params.stop))
    return params, payload[prompt_off : prompt_off + prompt_len].view(np.uint32)


def _params_of(key: bytes) -> SamplingParams:
    """The SamplingParams of unpack_request's key: a REQUEST record's sampling bytes, the
    lengths of its extras, then the stop strings, the grammar, the logit bias and the allowed ids."""
    values = _REQUEST_SAMPLING.unpack_from(key)
    r = dict(zip(_SAMPLING_NAMES, values))  # the scalars; then stop_token_ids' items
    stop_len, grammar_len, bias_len, allowed_len, think_len, lp_ids_len = _EXTRA_LENS.unpack_from(
        key, _REQUEST_SAMPLING.size
    )
    at = _REQUEST_SAMPLING.size + _EXTRA_LENS.size
    grammar_at, bias_at = at + stop_len, at + stop_len + grammar_len
    allowed_at = bias_at + bias_len
    n_bias = bias_len // 8
    bias_ids = np.frombuffer(key, np.uint32, n_bias, bias_at).tolist()
    biases = np.frombuffer(key, np.float32, n_bias, bias_at + 4 * n_bias).tolist()
    allowed = tuple(np.frombuffer(key, np.uint32, allowed_len // 4, allowed_at).tolist())
    think = np.frombuffer(key, np.uint32, think_len // 4, allowed_at + allowed_len).tolist()
    lp_ids = tuple(np.frombuffer(key, np.uint32, lp_ids_len // 4, allowed_at + allowed_len + think_len).tolist())
    n_start = think[0] if think else 0
    return SamplingParams(
        max_new_tokens=r["max_new_tokens"],
        min_new_tokens=r["min_new_tokens"],
        temperature=r["temperature"],
        top_p=r["top_p"],
        top_k=r["top_k"],
        min_p=r["min_p"],
        seed=r["seed"] if r["has_seed"] else None,
        repetition_penalty=r["repetition_penalty"],
        frequency_penalty=r["frequency_penalty"],
        presence_penalty=r["presence_penalty"],
        stop=decode_strings(key[at:grammar_at]),
        stop_token_ids=values[len(_SAMPLING_NAMES) : len(_SAMPLING_NAMES) + r["n_stop_token_ids"]],
        ignore_eos=bool(r["ignore_eos"]),
        skip_special_tokens=bool(r["skip_special_tokens"]),
        spaces_between_special_tokens=bool(r["spaces_between_special_tokens"]),
        no_stop_trim=bool(r["no_stop_trim"]),
        logprobs=bool(r["logprobs"]),
        top_logprobs=r["top_logprobs"],
        return_ids=bool(r["return_ids"]),
        grammar_kind=r["grammar_kind"],
        pooling=r["pooling"],
        lora_id=r["lora_id"],
        grammar=key[grammar_at:bias_at].decode(),
        logit_bias=tuple(zip(bias_ids, biases)),
        allowed_token_ids=allowed,
        prompt_logprobs=r["prompt_logprobs"],
        prompt_logprobs_start=r["prompt_logprobs_start"],
        thinking_budget=r["thinking_budget"],
        think_start_ids=tuple(think[1 : 1 + n_start]),
        think_end_ids=tuple(think[1 + n_start :]),
        logprob_token_ids=lp_ids,
    )


class _PackedSampling(NamedTuple):
    params: SamplingParams  # held, so that its id stays its own while the memo keeps this
    sampling: bytes  # the record's bytes from SAMPLING_AT on
    extras: bytes  # the stop strings, the grammar, the logit bias and the allowed ids, each part 4-aligned
    stop_len: int
    grammar_at: int  # offsets in `extras`
    grammar_len: int
    bias_at: int
    bias_len: int
    allowed_at: int
    allowed_len: int
    think_at: int
    think_len: int
    lp_ids_at: int
    lp_ids_len: int


def _packed_sampling(params: SamplingParams) -> _PackedSampling:
    """`params` as a REQUEST record's sampling bytes and payload extras, made once per object."""
    hit = _PACKED.get(id(params))  # by object, not value (hashing one costs more than packing it)
    if hit is not None and hit.params is params:
        return hit
    stop_ids = tuple(params.stop_token_ids)
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} fit a request record")
    p = params
    sampling = _REQUEST_SAMPLING.pack(
        p.seed is not None,
        len(stop_ids),
        p.ignore_eos,
        p.logprobs,
        p.skip_special_tokens,
        p.spaces_between_special_tokens,
        p.no_stop_trim,
        p.return_ids,
        p.grammar_kind,
        p.pooling,
        p.lora_id,
        p.top_logprobs,
        p.prompt_logprobs,
        p.prompt_logprobs_start,
        p.max_new_tokens,
        p.min_new_tokens,
        p.top_k,
        p.temperature,
        p.top_p,
        p.min_p,
        p.repetition_penalty,
        p.frequency_penalty,
        p.presence_penalty,
        p.seed or 0,
        p.thinking_budget,
        *stop_ids,
        *(0,) * (MAX_STOP_TOKEN_IDS - len(stop_ids)),
    )
    stop = encode_strings(params.stop)
    grammar = params.grammar.encode()
    bias = b""
    if params.logit_bias:
        ids, values = zip(*params.logit_bias)
        bias = np.array(ids, np.uint32).tobytes() + np.array(values, np.float32).tobytes()
    allowed = np.array(params.allowed_token_ids, np.uint32).tobytes()
    grammar_at = _aligned(len(stop))
    bias_at = grammar_at + _aligned(len(grammar))
    think = b""
    if params.thinking_budget >= 0:
        markers = [len(params.think_start_ids), *params.think_start_ids, *params.think_end_ids]
        think = np.array(markers, np.uint32).tobytes()
    allowed_at = bias_at + len(bias)  # whole u32s and f32s: still aligned
    think_at = allowed_at + len(allowed)
    lp_ids = np.array(params.logprob_token_ids, np.uint32).tobytes()
    extras = (
        stop.ljust(grammar_at, b"\0") + grammar.ljust(bias_at - grammar_at, b"\0") + bias + allowed + think + lp_ids
    )
    packed = _PackedSampling(
        params,
        sampling,
        extras,
        len(stop),
        grammar_at,
        len(grammar),
        bias_at,
        len(bias),
        allowed_at,
        len(allowed),
        think_at,
        len(think),
        think_at + len(think),
        len(lp_ids),
    )
    _PACKED.put(id(params), packed, len(sampling) + 2 * len(extras) + string_bytes(params.stop))
    return packed


def _aligned(n: int) -> int:
    return n + (-n % 4)


def sampling_payload_bytes(params: SamplingParams) -> int:
    """The bytes `params` adds to a NEW record's payload: its stop strings, grammar, logit bias and allowed ids."""
    return len(_packed_sampling(params).extras)


def stop_payload_bytes(params: SamplingParams) -> int:
    """The bytes of `params`' stop strings in a NEW or OPEN record's payload."""
    return _packed_sampling(params).stop_len


_REQUEST_HEAD = record_struct(REQUEST.dtype, 0, SAMPLING_AT)
_REQUEST_SAMPLING = record_struct(REQUEST.dtype, SAMPLING_AT)
_EXTRA_LENS = struct.Struct("=6I")  # stop, grammar, bias, allowed, think, lp_ids lengths in unpack_request's key
_SAMPLING_NAMES = [n for n, (_, at) in _REQUEST_FIELDS.items() if at >= SAMPLING_AT][:-1]  # scalars
_PARAMS = ByteLRU(MEMO_BYTES)  # unpack_request's: sampling bytes and stop strings -> SamplingParams
_PACKED = ByteLRU(MEMO_BYTES)  # pack_request's: id(params) -> _PackedSampling


def pack_control(
    kind: RequestKind, worker: int = 0, slot: int | Sequence[int] = 0, gen: int | Sequence[int] = 0, rid: int = 0
) -> np.ndarray:
    """An ABORT (of the addressed request), ABORT_RID (rid: a rid_hash()), ABORT_ALL or
    FLUSH_CACHE record; it carries no payload. Sequences of slots and gens give one ABORT
    record per (slot, gen) of `worker`."""
    rec = np.zeros(len(slot) if isinstance(slot, Sequence) else 1, REQUEST.dtype)
    rec["kind"], rec["worker"], rec["slot"], rec["gen"], rec["rid_hash"] = kind, worker, slot, gen, rid
    return rec


def pack_call(worker: int, slot: int, gen: int, args: bytes) -> tuple[np.ndarray, bytes]:
    """A CONTROL record addressed to the caller's (worker, slot, gen), where its REPLY comes
    back, and its payload: `args`, UTF-8 JSON, in the grammar field (a payload of bytes)."""
    rec = pack_control(RequestKind.CONTROL, worker, slot, gen)
    rec["grammar_off"], rec["grammar_len"] = 0, len(args)
    return rec, args


def call_args(record: np.void, payload: np.ndarray) -> bytes:
    """A CONTROL record's JSON arguments."""
    off, n = int(record["grammar_off"]), int(record["grammar_len"])
    return payload[off : off + n].tobytes()
