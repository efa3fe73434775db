"""Record layouts of every ring of the server, the protocol they carry, and helpers to fill
and read them. This module is the one contract between the processes.

Channels (one SPSC ring each):
  REQUEST    HTTP worker k -> scheduler      one record per new request / abort / control
  TOKEN_OUT  scheduler -> detokenizer        one record per running request per step (hot)
  TEXT_OUT   detokenizer -> HTTP worker k    one record per text delta

A request is named on the token path by its address (worker: u16, slot: u32,
gen: u32): `slot` indexes the owning worker's request table and `gen` is bumped
each time the slot is reused, so a record whose gen no longer matches the
consumer's table belongs to an aborted or finished request and is dropped
(`live_mask`). Timestamps are CLOCK_MONOTONIC ns (`time.monotonic_ns()`), which
all processes of one machine share.

Variable-length data lives in the channel's arena: a record holds `<name>_off` and
`<name>_len`, both in BYTES, where the offset indexes the popped `Batch.payload`.
A producer builds one payload blob per push (`PayloadBuilder` or vectorised code)
with offsets relative to the blob; the channel translates them on pop.

TOKEN_OUT protocol (scheduler -> detokenizer). A step's push holds, in order:
  OPEN   one per request admitted since the previous step, before any of its tokens; its own
         layout (OPEN_RECORD, same size and header as TOKEN_OUT): the detokenizer's options in
         `flags` (OpenFlags), `top_logprobs` asked for, `min_new_tokens` (no stop string may end
         in their text), the prompt's length, its stop strings in the payload (encode_strings)
  TOKEN  one per request with news: its sampled `token` and `logprob` (top-N alternatives in the
         payload, pack_top_logprobs, `n_top` of them), usage counts, and `finish` when the
         scheduler ended it (EOS or a stop token: STOP; max tokens or no KV room: LENGTH; ABORT).
         token == NO_TOKEN ends a request without a new token (abort, or the KV pool ran out)
  ERROR  a request that could never run: `error` holds an ErrorCode, the payload a UTF-8 message
  PROMPT_LOGPROBS  a request that asked for prompt logprobs (SamplingParams.prompt_logprobs >= 0):
         the prompt positions [first, first + count) one prefill step computed, before the
         request's first TOKEN (all of them come from its prefill, which ends before its first
         token is sampled). `token` holds `first`, `completion_tokens` the count, `prompt_tokens`
         the prompt's length, `n_top` the alternatives per position (k); the payload is
         pack_prompt_logprobs of the positions: the prompt token at each position, its logprob
         (NaN at position 0: no token predicts it), its rank in the vocabulary, and the top-k.
         A request's records cover [prompt_logprobs_start, prompt length) once each, in order
         (a retracted and resumed request does not repeat them)
Stop strings are the detokenizer's: it finishes such a request itself (finish STOP with
`stop_index` in TEXT_OUT) and the HTTP worker sends the scheduler an ABORT to free its pages.

TEXT_OUT protocol (detokenizer -> HTTP worker k): a TEXT record when a request's new tokens
complete some text, when it finishes, or, when it asked for logprobs or token ids, whenever it
got tokens; `n_tokens` counts the tokens since its previous record. An ERROR record ends a
request with an ErrorCode and a message. A PROMPT_LOGPROBS record forwards one TOKEN_OUT
PROMPT_LOGPROBS record, in order, before the request's TEXT records: `n_tokens` is the count of
positions, `stop_token` the first position (such a record has no stop token), `n_top` k,
`prompt_tokens` the prompt's length, and the logprobs payload the same pack_prompt_logprobs bytes.
"""

from __future__ import annotations

import array
import enum
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from protocol.memo import ByteLRU, string_bytes
from protocol.sampling_params import MAX_STOP_TOKEN_IDS, MAX_TOP_LOGPROBS, SamplingParams

# The arenas of the rings that carry a request's variable-length data (runtime/scheduler/process.py
# REQUEST_SPEC, runtime/detokenizer/process.py TOKEN_OUT_SPEC), and what one request may take of
# them: the HTTP worker pushes a request's choices (prompt ids and stop strings, n times) in one
# push, and the scheduler pushes their OPEN records (the stop strings, n times) in one step's push;
# a payload larger than its arena can never be pushed. A quarter leaves room for the others.
REQUEST_ARENA_BYTES = 16 << 20
TOKEN_OUT_ARENA_BYTES = 8 << 20
MAX_REQUEST_PAYLOAD_BYTES = REQUEST_ARENA_BYTES // 4  # one request's NEW records' payload, all choices
MAX_OPEN_PAYLOAD_BYTES = TOKEN_OUT_ARENA_BYTES // 4  # one request's OPEN records' payload, all choices
MEMO_BYTES = 4 << 20  # each memo of sampling settings (protocol/memo.py)


@dataclass(frozen=True)
class PayloadRef:
    off: str  # field holding the byte offset into the batch payload
    len: str  # field holding the byte length
    elem: np.dtype  # what the bytes hold (uint32 token ids, uint8 bytes); the zmq baseline turns
    #                 uint32 payloads into Python int lists, as SGLang and vLLM send them


@dataclass(frozen=True)
class RecordLayout:
    name: str
    dtype: np.dtype
    payloads: tuple[PayloadRef, ...] = ()

    def __post_init__(self) -> None:
        for ref in self.payloads:
            for field in (ref.off, ref.len):
                if self.dtype.fields is None or field not in self.dtype.fields:
                    raise ValueError(f"layout {self.name}: payload field {field!r} is not in the dtype")
                if self.dtype.fields[field][0] != np.uint32:
                    raise ValueError(f"layout {self.name}: payload field {field!r} must be uint32")

    @property
    def offset_fields(self) -> tuple[str, ...]:
        return tuple(ref.off for ref in self.payloads)


class RequestKind(enum.IntEnum):
    NEW = 1
    ABORT = 2  # the request at (worker, slot, gen)
    FLUSH_CACHE = 3
    ABORT_RID = 4  # every request whose rid hashes to rid_hash, whichever worker holds it
    ABORT_ALL = 5  # every request of every worker


class TokenKind(enum.IntEnum):
    TOKEN = 0  # one generated token of a running request
    OPEN = 1  # a newly admitted request, in the OPEN_RECORD layout
    ERROR = 2  # the request failed: `error` holds an ErrorCode, the payload a UTF-8 message
    PROMPT_LOGPROBS = 3  # prompt positions [token, token + completion_tokens): pack_prompt_logprobs


class TextKind(enum.IntEnum):
    TEXT = 0
    ERROR = 1  # `error` holds an ErrorCode, the text payload a UTF-8 message
    PROMPT_LOGPROBS = 2  # prompt positions [stop_token, stop_token + n_tokens): pack_prompt_logprobs


class Finish(enum.IntEnum):
    """How a request ended, as every process records it."""

    NONE = 0  # still running
    STOP = 1  # EOS, a stop token or a stop string
    LENGTH = 2  # max_tokens, or the context / KV pool ran out
    ABORT = 3
    ERROR = 4  # never ran (see ErrorCode)

    @property
    def api_name(self) -> str | None:
        """The OpenAI `finish_reason` string."""
        return None if self is Finish.NONE else self.name.lower()


class ErrorCode(enum.IntEnum):
    """Why a request failed, from whichever process failed it."""

    NONE = 0
    INTERNAL = 1
    PROMPT_TOO_LONG = 2
    INVALID_REQUEST = 3
    OVERLOADED = 4


class OpenFlags(enum.IntFlag):
    SKIP_SPECIAL_TOKENS = 1
    NO_STOP_TRIM = 2
    LOGPROBS = 4
    RETURN_IDS = 8


REQUEST = RecordLayout(
    "request",
    np.dtype(
        [
            # this request's own
            ("kind", np.uint8),  # RequestKind
            ("worker", np.uint16),
            ("slot", np.uint32),
            ("gen", np.uint32),
            ("arrival_ns", np.int64),  # CLOCK_MONOTONIC
            ("rid_hash", np.uint64),  # rid_hash() of the request's id (0: none), what ABORT_RID matches
            ("prompt_off", np.uint32),  # prompt token ids, uint32
            ("prompt_len", np.uint32),
            ("stop_off", np.uint32),  # stop strings, encode_strings()
            ("stop_len", np.uint32),
            ("grammar_off", np.uint32),  # the grammar's UTF-8 text (grammar_kind says what it is)
            ("grammar_len", np.uint32),
            ("bias_off", np.uint32),  # logit_bias: n u32 token ids, then their n f32 biases
            ("bias_len", np.uint32),
            # its sampling parameters, from SAMPLING_AT to the end: requests that share them share these
            # bytes, so each side converts them once (pack_request, unpack_request)
            ("has_seed", np.uint8),
            ("n_stop_token_ids", np.uint8),
            ("ignore_eos", np.uint8),
            ("logprobs", np.uint8),
            ("top_logprobs", np.uint8),
            ("skip_special_tokens", np.uint8),
            ("spaces_between_special_tokens", np.uint8),
            ("no_stop_trim", np.uint8),
            ("return_ids", np.uint8),
            ("grammar_kind", np.uint8),  # GrammarKind
            ("prompt_logprobs", np.int8),  # -1: none, else top alternatives per prompt position
            ("prompt_logprobs_start", np.uint32),
            ("max_new_tokens", np.uint32),
            ("min_new_tokens", np.uint32),
            ("top_k", np.int32),
            ("temperature", np.float64),
            ("top_p", np.float64),
            ("min_p", np.float64),
            ("repetition_penalty", np.float64),
            ("frequency_penalty", np.float64),
            ("presence_penalty", np.float64),
            ("seed", np.int64),
            ("stop_token_ids", np.uint32, (MAX_STOP_TOKEN_IDS,)),
        ],
        align=True,
    ),
    payloads=(
        PayloadRef("prompt_off", "prompt_len", np.dtype(np.uint32)),
        PayloadRef("stop_off", "stop_len", np.dtype(np.uint8)),
        PayloadRef("grammar_off", "grammar_len", np.dtype(np.uint8)),
        PayloadRef("bias_off", "bias_len", np.dtype(np.uint8)),
    ),
)
SAMPLING_AT = REQUEST.dtype.fields["has_seed"][1]

TOKEN_OUT = RecordLayout(
    "token_out",
    np.dtype(
        [
            ("worker", np.uint16),
            ("kind", np.uint8),  # TokenKind
            ("finish", np.uint8),  # Finish
            ("slot", np.uint32),
            ("gen", np.uint32),
            ("token", np.uint32),
            ("prompt_tokens", np.uint32),
            ("completion_tokens", np.uint32),
            ("cached_tokens", np.uint32),
            ("logprob", np.float32),  # of `token`, when the request asked for logprobs
            # TOKEN: top-N alternatives (pack_top_logprobs) when asked; ERROR: UTF-8 message
            ("payload_off", np.uint32),
            ("payload_len", np.uint32),
            ("n_top", np.uint8),  # alternatives in the payload
            ("flags", np.uint8),  # unused by TOKEN and ERROR: OPEN_RECORD's `flags`
            ("error", np.uint16),  # ErrorCode
        ],
        align=True,
    ),
    payloads=(PayloadRef("payload_off", "payload_len", np.dtype(np.uint8)),),
)

NO_TOKEN = 0xFFFFFFFF  # TOKEN_OUT.token of a record that ends a request without a new token

# OPEN_RECORD's fields, each at the offset of the TOKEN_OUT field named beside it: the same
# ring carries both, and the ring translates `payload_off` (here `stop_off`) on pop.
_OPEN_AT = {
    "worker": "worker",
    "kind": "kind",
    "slot": "slot",
    "gen": "gen",
    "prompt_tokens": "prompt_tokens",
    "min_new_tokens": "completion_tokens",
    "stop_off": "payload_off",
    "stop_len": "payload_len",
    "top_logprobs": "n_top",
    "flags": "flags",
}
OPEN_RECORD = np.dtype(
    {
        "names": list(_OPEN_AT),
        "formats": [TOKEN_OUT.dtype.fields[f][0] for f in _OPEN_AT.values()],
        "offsets": [TOKEN_OUT.dtype.fields[f][1] for f in _OPEN_AT.values()],
        "itemsize": TOKEN_OUT.dtype.itemsize,
    }
)

TEXT_OUT = RecordLayout(
    "text_out",
    np.dtype(
        [
            ("worker", np.uint16),
            ("kind", np.uint8),  # TextKind
            ("finish", np.uint8),  # Finish
            ("slot", np.uint32),
            ("gen", np.uint32),
            ("text_off", np.uint32),  # UTF-8 delta (possibly empty on finish), or the error message
            ("text_len", np.uint32),
            ("n_tokens", np.uint32),  # tokens this delta covers
            ("prompt_tokens", np.uint32),
            ("completion_tokens", np.uint32),
            ("cached_tokens", np.uint32),
            ("logprobs_off", np.uint32),  # pack_logprobs() of the n_tokens tokens, when asked
            ("logprobs_len", np.uint32),
            ("ids_off", np.uint32),  # the n_tokens tokens' ids (uint32), when asked (return_ids)
            ("ids_len", np.uint32),
            ("stop_token", np.int32),  # the stop token id that finished the request, else -1
            ("stop_index", np.int16),  # index of the matched stop string, else -1
            ("error", np.uint16),  # ErrorCode
            ("n_top", np.uint8),  # alternatives per token in the logprobs payload
        ],
        align=True,
    ),
    payloads=(
        PayloadRef("text_off", "text_len", np.dtype(np.uint8)),
        PayloadRef("logprobs_off", "logprobs_len", np.dtype(np.uint8)),
        PayloadRef("ids_off", "ids_len", np.dtype(np.uint32)),
    ),
)

LAYOUTS = {layout.name: layout for layout in (REQUEST, TOKEN_OUT, TEXT_OUT)}


# ---------------------------------------------------------------- copies of records


def take_records(records: np.ndarray, index: np.ndarray) -> np.ndarray:
    """records[index] (an integer or boolean index), copied as whole rows of bytes: numpy
    copies these padded structured dtypes field by field, several times slower."""
    return _rows(records)[index].view(records.dtype)


def concat_records(parts: Sequence[np.ndarray]) -> np.ndarray:
    """np.concatenate of record arrays of one dtype, as whole rows of bytes (many times faster)."""
    return np.concatenate([_rows(p) for p in parts]).view(parts[0].dtype)


def record_struct(dtype: np.dtype, start: int = 0, stop: int | None = None) -> struct.Struct:
    """A struct.Struct laid out as bytes [start, stop) of one record of `dtype` (the fields in
    there, padding included; by default the whole record): it packs the fields' values (an
    array field's items in order) into a record's bytes in one call, several times faster than
    np.array([values], dtype)."""
    codes = {
        "b1": "?",
        "u1": "B",
        "u2": "H",
        "u4": "I",
        "u8": "Q",
        "i1": "b",
        "i2": "h",
        "i4": "i",
        "i8": "q",
        "f4": "f",
        "f8": "d",
    }
    stop = dtype.itemsize if stop is None else stop
    fmt, at = "=", start
    for name in dtype.names:
        field, offset = dtype.fields[name][:2]
        if not start <= offset < stop:
            continue
        base = field.base
        fmt += f"{offset - at}x{field.itemsize // base.itemsize}{codes[base.str[1:]]}"
        at = offset + field.itemsize
    return struct.Struct(fmt + f"{stop - at}x")


# one TOKEN_OUT record's fields in order: worker, kind, finish, slot, gen, token, prompt_tokens,
# completion_tokens, cached_tokens, logprob, payload_off, payload_len, n_top, flags, error
TOKEN_OUT_STRUCT = record_struct(TOKEN_OUT.dtype)
_OPEN_STRUCT = record_struct(OPEN_RECORD)


class OpenFields(NamedTuple):
    """An OPEN record's fields, in OPEN_RECORD's order."""

    worker: int
    kind: int
    slot: int
    gen: int
    prompt_tokens: int
    min_new_tokens: int
    stop_off: int
    stop_len: int
    top_logprobs: int
    flags: int


def pack_open(
    *,
    worker: int,
    slot: int,
    gen: int,
    prompt_tokens: int,
    min_new_tokens: int,
    top_logprobs: int,
    flags: int,
    stop_off: int = 0,
    stop_len: int = 0,
) -> bytes:
    """One OPEN record's bytes (stop_off, stop_len: the stop strings' part of the push's blob)."""
    return _OPEN_STRUCT.pack(
        worker, TokenKind.OPEN, slot, gen, prompt_tokens, min_new_tokens, stop_off, stop_len, top_logprobs, flags
    )


def unpack_open(record: bytes) -> OpenFields:
    """The fields of one OPEN record's bytes, read in one call."""
    return OpenFields._make(_OPEN_STRUCT.unpack(record))


def record_fields(record: np.void) -> dict[str, Any]:
    """One record's fields as Python values, read in one call (one by one, each field is a numpy call)."""
    return dict(zip(record.dtype.names, record.item()))


def _rows(records: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(records).view(np.dtype((np.void, records.dtype.itemsize)))


# ---------------------------------------------------------------- payload blobs


class PayloadBuilder:
    """Collects the payloads of one push into one blob; each part starts 4-byte aligned."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0

    def add(self, data: bytes | np.ndarray) -> tuple[int, int]:
        """Appends `data`; returns (offset, length) in bytes, relative to the blob."""
        raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
        pad = -self._size % 4
        if pad:
            self._parts.append(b"\0" * pad)
            self._size += pad
        off = self._size
        self._parts.append(raw)
        self._size += len(raw)
        return off, len(raw)

    def blob(self) -> bytes:
        return b"".join(self._parts)


def encode_strings(strings: tuple[str, ...] | list[str]) -> bytes:
    """[count u32][count x length u32][UTF-8 bytes]: any string, NULs included."""
    if not strings:
        return _NO_STRINGS
    encoded = [s.encode() for s in strings]
    head = np.array([len(encoded)] + [len(e) for e in encoded], np.uint32).tobytes()
    return head + b"".join(encoded)


_NO_STRINGS = bytes(4)


def decode_strings(buf: bytes | np.ndarray) -> tuple[str, ...]:
    raw = bytes(buf)
    count = int.from_bytes(raw[:4], "little")
    if not count:
        return ()
    lengths = np.frombuffer(raw, np.uint32, count, offset=4).tolist()
    pos, out = 4 + 4 * count, []
    for n in lengths:
        out.append(raw[pos : pos + n].decode())
        pos += n
    return tuple(out)


def pack_top_logprobs(ids: np.ndarray, logprobs: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Token-out top-N payload for B records at once. ids, logprobs: [B, N].

    Record i's part is [N x u32 ids][N x f32 logprobs]; returns (blob, offsets [B])."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape != np.shape(logprobs) or ids.shape[1] > MAX_TOP_LOGPROBS:
        raise ValueError(f"top logprobs must be two [B, N<={MAX_TOP_LOGPROBS}] arrays of one shape")
    b, n = ids.shape
    rows = np.concatenate([ids.astype(np.uint32), np.asarray(logprobs, np.float32).view(np.uint32)], axis=1)
    return rows.tobytes(), np.arange(b, dtype=np.uint32) * np.uint32(8 * n)


def unpack_top_logprobs(part: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of one record's part of pack_top_logprobs: (ids [N] u32, logprobs [N] f32)."""
    words = np.frombuffer(part, np.uint32, 2 * n)
    return words[:n], words[n:].view(np.float32)


def pack_logprobs(
    ids: np.ndarray, logprobs: np.ndarray, top_ids: np.ndarray | None = None, top_logprobs: np.ndarray | None = None
) -> bytes:
    """Text-out logprobs of the T tokens a delta covers: [T u32 ids][T f32][T*N u32 top ids][T*N f32]."""
    parts = [np.asarray(ids, np.uint32), np.asarray(logprobs, np.float32)]
    if top_ids is not None:
        parts += [np.asarray(top_ids, np.uint32).ravel(), np.asarray(top_logprobs, np.float32).ravel()]
    return b"".join(p.tobytes() for p in parts)


def unpack_logprobs(
    part: np.ndarray, n_tokens: int, n_top: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of pack_logprobs: ids [T], logprobs [T], top_ids [T, N], top_logprobs [T, N]."""
    t, k = n_tokens, n_top
    words = np.frombuffer(part, np.uint32, 2 * t + 2 * t * k)
    return (
        words[:t],
        words[t : 2 * t].view(np.float32),
        words[2 * t : 2 * t + t * k].reshape(t, k),
        words[2 * t + t * k :].view(np.float32).reshape(t, k),
    )


def pack_prompt_logprobs(
    ids: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray
) -> bytes:
    """Prompt logprobs of T positions with N alternatives each: pack_logprobs' layout, then each
    prompt token's rank in the vocabulary ([T u32], 1 for the likeliest; vLLM reports it)."""
    return pack_logprobs(ids, logprobs, top_ids, top_logprobs) + np.asarray(ranks, np.uint32).tobytes()


def unpack_prompt_logprobs(
    part: np.ndarray, n_positions: int, n_top: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of pack_prompt_logprobs: ids [T], logprobs [T], ranks [T], top_ids [T, N], top_logprobs [T, N]."""
    t = n_positions
    ids, logprobs, top_ids, top_logprobs = unpack_logprobs(part, t, n_top)
    ranks = np.frombuffer(part, np.uint32, t, offset=4 * (2 * t + 2 * t * n_top))
    return ids, logprobs, ranks, top_ids, top_logprobs


# ---------------------------------------------------------------- requests


def rid_hash(rid: str) -> int:
    """A request id as the u64 the scheduler matches ABORT_RID against (never 0)."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little") or 1


def pack_request(
    worker: int,
    slot: int,
    gen: int,
    params: SamplingParams,
    prompt_ids: np.ndarray | list[int],
    arrival_ns: int,
    rid: int = 0,
    base: int = 0,
) -> tuple[np.ndarray, bytes]:
    """One NEW request record and its payload blob (the prompt's uint32 ids, then the stop
    strings, the grammar and the logit bias, each 4-aligned), ready for `channel.push(record,
    blob)`. rid: rid_hash() of the request's id, 0 for none. base: where the blob starts in the
    push's payload, when several requests go in one push. The record is packed by struct
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
    )
    return np.frombuffer(bytearray(head + packed.sampling), REQUEST.dtype), prompt + packed.extras


def unpack_request(record: np.void, payload: np.ndarray) -> tuple[SamplingParams, np.ndarray]:
    """(params, prompt ids u32 view) of one NEW record of a popped batch. Requests with the
    same sampling bytes, stop strings, grammar and bias get the same (frozen) SamplingParams."""
    raw = record.tobytes()
    prompt_off, prompt_len, stop_off, stop_len, grammar_off, grammar_len, bias_off, bias_len = (
        _REQUEST_HEAD.unpack_from(raw)[6:]
    )
    key = raw[SAMPLING_AT:] + _EXTRA_LENS.pack(stop_len, grammar_len, bias_len)
    key += payload[stop_off : stop_off + stop_len].tobytes()
    if grammar_len:
        key += payload[grammar_off : grammar_off + grammar_len].tobytes()
    if bias_len:
        key += payload[bias_off : bias_off + bias_len].tobytes()
    params = _PARAMS.get(key)
    if params is None:  # a server sees a few distinct sampling settings: each converted once
        params = _params_of(key)
        _PARAMS.put(key, params, len(key) + string_bytes(params.stop))
    return params, payload[prompt_off : prompt_off + prompt_len].view(np.uint32)


def _params_of(key: bytes) -> SamplingParams:
    """The SamplingParams of unpack_request's key: a REQUEST record's sampling bytes, the
    lengths of its extras, then the stop strings, the grammar and the logit bias."""
    values = _REQUEST_SAMPLING.unpack_from(key)
    r = dict(zip(_SAMPLING_NAMES, values))  # the scalars; then stop_token_ids' items
    stop_len, grammar_len, bias_len = _EXTRA_LENS.unpack_from(key, _REQUEST_SAMPLING.size)
    at = _REQUEST_SAMPLING.size + _EXTRA_LENS.size
    grammar_at, bias_at = at + stop_len, at + stop_len + grammar_len
    n_bias = bias_len // 8
    bias_ids = np.frombuffer(key, np.uint32, n_bias, bias_at).tolist()
    biases = np.frombuffer(key, np.float32, n_bias, bias_at + 4 * n_bias).tolist()
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
        grammar=key[grammar_at:bias_at].decode(),
        logit_bias=tuple(zip(bias_ids, biases)),
        prompt_logprobs=r["prompt_logprobs"],
        prompt_logprobs_start=r["prompt_logprobs_start"],
    )


class _PackedSampling(NamedTuple):
    params: SamplingParams  # held, so that its id stays its own while the memo keeps this
    sampling: bytes  # the record's bytes from SAMPLING_AT on
    extras: bytes  # the stop strings, the grammar and the logit bias, each part 4-aligned
    stop_len: int
    grammar_at: int  # offsets in `extras`
    grammar_len: int
    bias_at: int
    bias_len: int


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
        p.top_logprobs,
        p.skip_special_tokens,
        p.spaces_between_special_tokens,
        p.no_stop_trim,
        p.return_ids,
        p.grammar_kind,
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
        *stop_ids,
        *(0,) * (MAX_STOP_TOKEN_IDS - len(stop_ids)),
    )
    stop = encode_strings(params.stop)
    grammar = params.grammar.encode()
    bias = b""
    if params.logit_bias:
        ids, values = zip(*params.logit_bias)
        bias = np.array(ids, np.uint32).tobytes() + np.array(values, np.float32).tobytes()
    grammar_at = _aligned(len(stop))
    bias_at = grammar_at + _aligned(len(grammar))
    extras = stop.ljust(grammar_at, b"\0") + grammar.ljust(bias_at - grammar_at, b"\0") + bias
    packed = _PackedSampling(params, sampling, extras, len(stop), grammar_at, len(grammar), bias_at, len(bias))
    _PACKED.put(id(params), packed, len(sampling) + 2 * len(extras) + string_bytes(params.stop))
    return packed


def _aligned(n: int) -> int:
    return n + (-n % 4)


def sampling_payload_bytes(params: SamplingParams) -> int:
    """The bytes `params` adds to a NEW record's payload: its stop strings, grammar and logit bias."""
    return len(_packed_sampling(params).extras)


def stop_payload_bytes(params: SamplingParams) -> int:
    """The bytes of `params`' stop strings in a NEW or OPEN record's payload."""
    return _packed_sampling(params).stop_len


_REQUEST_HEAD = record_struct(REQUEST.dtype, 0, SAMPLING_AT)
_REQUEST_SAMPLING = record_struct(REQUEST.dtype, SAMPLING_AT)
_EXTRA_LENS = struct.Struct("=III")  # stop_len, grammar_len, bias_len in unpack_request's key
_SAMPLING_NAMES = [n for n in REQUEST.dtype.names if REQUEST.dtype.fields[n][1] >= SAMPLING_AT][:-1]  # scalars
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


# ---------------------------------------------------------------- addressing


def live_mask(records: np.ndarray, generations: np.ndarray) -> np.ndarray:
    """True where a record's gen matches the consumer's table; out-of-range slots are stale.

    generations: [slots] (one worker's table, e.g. the TokenizerManager's) or
    [workers, slots] (e.g. the scheduler's / detokenizer's), any unsigned int dtype."""
    slot = records["slot"].astype(np.intp)
    if generations.ndim == 1:
        ok = slot < generations.shape[0]
        current = generations[np.where(ok, slot, 0)]
    else:
        worker = records["worker"].astype(np.intp)
        ok = (slot < generations.shape[1]) & (worker < generations.shape[0])
        current = generations[np.where(ok, worker, 0), np.where(ok, slot, 0)]
    return ok & (current == records["gen"])
