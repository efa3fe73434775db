"""Record layouts of every ring of the server, their kinds and enums: the one contract between
the processes.

    REQUEST    HTTP worker k -> scheduler      one record per new request / abort / control
    TOKEN_OUT  scheduler -> detokenizer        one record per running request per step (hot)
    TEXT_OUT   detokenizer -> HTTP worker k    one record per text delta

What each kind carries, in what order and when it is sent, and how a request is addressed
(worker, slot, gen): docs/architecture.md, "Records". Filling and reading them:
record_bytes.py (records as rows of bytes, OPEN records), payloads.py (the payload blob and
what goes in it), request_records.py (REQUEST records and the sampling settings they carry).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from protocol.sampling_params import MAX_STOP_TOKEN_IDS

# The arenas of the rings that carry a request's variable-length data (runtime/scheduler/process.py
# REQUEST_SPEC, runtime/detokenizer/process.py TOKEN_OUT_SPEC), and what one request may take of
# them: the HTTP worker pushes a request's choices (prompt ids and stop strings, n times) in one
# push, and the scheduler pushes their OPEN records (the stop strings, n times) in one step's push;
# a payload larger than its arena can never be pushed. A quarter leaves room for the others.
REQUEST_ARENA_BYTES = 16 << 20
TOKEN_OUT_ARENA_BYTES = 8 << 20
MAX_REQUEST_PAYLOAD_BYTES = REQUEST_ARENA_BYTES // 4  # one request's NEW records' payload, all choices
MAX_OPEN_PAYLOAD_BYTES = TOKEN_OUT_ARENA_BYTES // 4  # one request's OPEN records' payload, all choices


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


def fields_of(dtype: np.dtype) -> dict[str, tuple[np.dtype, int]]:
    """A record dtype's fields in order: name -> (the field's dtype, its byte offset)."""
    if dtype.names is None or dtype.fields is None:
        raise TypeError(f"{dtype} is not a record dtype")
    return {name: dtype.fields[name][:2] for name in dtype.names}


class RequestKind(enum.IntEnum):
    NEW = 1
    ABORT = 2  # the request at (worker, slot, gen)
    FLUSH_CACHE = 3
    ABORT_RID = 4  # every request whose rid hashes to rid_hash, whichever worker holds it
    ABORT_ALL = 5  # every request of every worker
    CONTROL = 6  # an engine call (pause, continue, weights): its UTF-8 JSON arguments in the grammar
    #              field's payload; answered by a REPLY to (worker, slot, gen), a slot the caller holds


# SGLang's /pause_generation modes (runtime/scheduler/control.py says what each does)
PAUSE_MODES = ("abort", "retract", "in_place")


class TokenKind(enum.IntEnum):
    TOKEN = 0  # one generated token of a running request
    OPEN = 1  # a newly admitted request, in the OPEN_RECORD layout
    ERROR = 2  # the request failed: `error` holds an ErrorCode, the payload a UTF-8 message
    PROMPT_LOGPROBS = 3  # prompt positions [token, token + completion_tokens): pack_prompt_logprobs
    REPLY = 4  # the answer to a CONTROL record: UTF-8 JSON in the payload
    # A pooled request's answer, which ends it (finish STOP, token NO_TOKEN, no TOKEN record before
    # or after): float32 values in the payload (SamplingParams.pooling: a hidden state, summed over
    # the prompt for MEAN; LABELS: one log-probability per label token). Generation's records are
    # untouched: only pooled requests (prefill only) produce these.
    POOLED = 5


class TextKind(enum.IntEnum):
    TEXT = 0
    ERROR = 1  # `error` holds an ErrorCode, the text payload a UTF-8 message
    PROMPT_LOGPROBS = 2  # prompt positions [stop_token, stop_token + n_tokens): pack_prompt_logprobs
    REPLY = 3  # TokenKind.REPLY passed on: its JSON in the text payload
    POOLED = 4  # TokenKind.POOLED passed on (finish STOP): its float32 values as the text payload


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


# an INVALID_REQUEST message about the request's grammar starts so: the HTTP side names the grammar's field
GRAMMAR_ERROR_PREFIX = "grammar: "


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
            ("allowed_off", np.uint32),  # allowed_token_ids: u32 token ids (none: any token)
            ("allowed_len", np.uint32),
            ("think_off", np.uint32),  # the reasoning's markers: u32 count of start ids, the start ids, the end ids
            ("think_len", np.uint32),
            ("lp_ids_off", np.uint32),  # logprob_token_ids: u32 token ids whose logprobs replace the top ones
            ("lp_ids_len", np.uint32),
            # its sampling parameters, from has_seed to the end: requests that share them share these
            # bytes, so each side converts them once (request_records.py pack_request, unpack_request)
            ("has_seed", np.uint8),
            ("n_stop_token_ids", np.uint8),
            ("ignore_eos", np.uint8),
            ("logprobs", np.uint8),
            ("skip_special_tokens", np.uint8),
            ("spaces_between_special_tokens", np.uint8),
            ("no_stop_trim", np.uint8),
            ("return_ids", np.uint8),
            ("grammar_kind", np.uint8),  # GrammarKind
            ("pooling", np.uint8),  # Pooling: NONE generates, the others answer with a POOLED record
            ("lora_id", np.uint16),  # 0: the base model; i: the i-th LoRA adapter (--lora-paths)
            ("top_logprobs", np.uint32),  # alternatives per position: up to the vocabulary
            ("prompt_logprobs", np.int32),  # -1: none, else top alternatives per prompt position
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
            ("thinking_budget", np.int32),  # -1: no bound
            ("stop_token_ids", np.uint32, (MAX_STOP_TOKEN_IDS,)),
        ],
        align=True,
    ),
    payloads=(
        PayloadRef("prompt_off", "prompt_len", np.dtype(np.uint32)),
        PayloadRef("stop_off", "stop_len", np.dtype(np.uint8)),
        PayloadRef("grammar_off", "grammar_len", np.dtype(np.uint8)),
        PayloadRef("bias_off", "bias_len", np.dtype(np.uint8)),
        PayloadRef("allowed_off", "allowed_len", np.dtype(np.uint8)),
        PayloadRef("think_off", "think_len", np.dtype(np.uint8)),
        PayloadRef("lp_ids_off", "lp_ids_len", np.dtype(np.uint8)),
    ),
)

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
            ("n_top", np.uint32),  # alternatives in the payload
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
_TOKEN_OUT_FIELDS = fields_of(TOKEN_OUT.dtype)
OPEN_RECORD = np.dtype(
    {
        "names": list(_OPEN_AT),
        "formats": [_TOKEN_OUT_FIELDS[f][0] for f in _OPEN_AT.values()],
        "offsets": [_TOKEN_OUT_FIELDS[f][1] for f in _OPEN_AT.values()],
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
            ("n_top", np.uint32),  # alternatives per token in the logprobs payload
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
