"""A step's TOKEN_OUT records, transport-free: what the scheduler process pushes to the
detokenizer and what the OfflineEngine hands its in-process Detokenizer core, built one way.

The order: an OPEN record per request added since the last step, then the PROMPT_LOGPROBS
records of the step's prefill chunks, then the step's events (already TOKEN_OUT records, see
core.py) with their top-logprob and error-message payloads. The scheduler core builds the
TOKEN and ERROR records itself; this module adds the OPEN records and the payloads.
"""

from __future__ import annotations

import logging

import numpy as np

from protocol.payloads import PayloadBuilder, encode_strings, pack_top_logprobs
from protocol.record_bytes import concat_records, pack_open
from protocol.records import NO_TOKEN, TOKEN_OUT, ErrorCode, Finish, OpenFlags, TokenKind
from runtime.scheduler.core import Scheduler
from runtime.scheduler.req import Req
from runtime.scheduler.step_result import StepResult

logger = logging.getLogger(__name__)

_SKIP_SPECIAL, _NO_STOP_TRIM, _LOGPROBS, _RETURN_IDS = map(
    int, (OpenFlags.SKIP_SPECIAL_TOKENS, OpenFlags.NO_STOP_TRIM, OpenFlags.LOGPROBS, OpenFlags.RETURN_IDS)
)


def step_records(res: StepResult, scheduler: Scheduler) -> tuple[np.ndarray, bytes]:
    """The records of one step and their payload blob. A request whose OPEN record cannot be
    built is aborted in `scheduler` and gets an ERROR record in its place: it fails, not the
    step."""
    opened, ev, prompt, prompt_payloads = res.opened, res.events, res.prompt_records, res.prompt_payloads
    payload = PayloadBuilder()
    head = len(opened)  # the records before the sampled ones
    if prompt is not None and prompt_payloads is not None:  # set together
        for k, part in enumerate(prompt_payloads):
            prompt["payload_off"][k], prompt["payload_len"][k] = payload.add(part)
        ev = concat_records([prompt, ev])
        head += len(prompt)
    if opened:
        opens = []
        for req in opened:
            try:
                opens.append(_open_record(req, payload))
            except Exception:  # that request fails, not the process
                logger.exception("request (%d, %d, %d): no OPEN record", req.worker, req.slot, req.generation)
                scheduler.abort(req.worker, req.slot, req.generation)
                message = b"the request could not be opened"
                opens.append(error_record(req.worker, req.slot, req.generation, ErrorCode.INTERNAL, payload, message))
        ev = concat_records([np.frombuffer(b"".join(opens), TOKEN_OUT.dtype), ev])
    if res.top_ids is not None and res.top_logprobs is not None:  # set together
        blob, offsets = pack_top_logprobs(res.top_ids, res.top_logprobs)
        base, _ = payload.add(blob)
        sampled = ev[head : head + res.num_sampled]
        sampled["payload_off"] = offsets + base
        sampled["payload_len"] = 8 * res.top_ids.shape[1]
        sampled["n_top"] = res.top_ids.shape[1]
    if res.failed:  # their ERROR records carry the message
        failed = {(r.worker, r.slot, r.generation): r for r in res.failed}
        n = len(opened)  # the OPEN section may hold ERROR records of its own (a failed OPEN)
        for k in (np.flatnonzero(ev["kind"][n:] == TokenKind.ERROR) + n).tolist():
            failed_req = failed.get((int(ev["worker"][k]), int(ev["slot"][k]), int(ev["gen"][k])))
            if failed_req is not None:
                ev["payload_off"][k], ev["payload_len"][k] = payload.add(failed_req.error.encode())
    return ev, payload.blob()


def _open_record(req: Req, payload: PayloadBuilder) -> bytes:
    """The OPEN record of `req`, packed in one call (numpy sets a record's fields one call each)."""
    p = req.params
    flags = (
        (_SKIP_SPECIAL if p.skip_special_tokens else 0)
        | (_NO_STOP_TRIM if p.no_stop_trim else 0)
        | (_LOGPROBS if p.logprobs else 0)
        | (_RETURN_IDS if p.return_ids else 0)
    )
    if req.error_code:  # it never runs: an ERROR follows, its stop strings are not needed
        stop_off, stop_len = 0, 0
    else:
        stop_off, stop_len = payload.add(encode_strings(p.stop)) if p.stop else (0, 0)
    return pack_open(
        worker=req.worker,
        slot=req.slot,
        gen=req.generation,
        prompt_tokens=len(req.prompt),
        min_new_tokens=p.min_new_tokens,
        top_logprobs=p.top_logprobs if p.logprobs else 0,
        flags=flags,
        stop_off=stop_off,
        stop_len=stop_len,
    )


def error_record(worker: int, slot: int, gen: int, code: ErrorCode, payload: PayloadBuilder, message: bytes) -> bytes:
    """An ERROR record's bytes (its message added to `payload`)."""
    rec = np.zeros(1, TOKEN_OUT.dtype)
    rec["kind"], rec["worker"], rec["slot"], rec["gen"] = TokenKind.ERROR, worker, slot, gen
    rec["finish"], rec["error"], rec["token"] = Finish.ERROR, code, NO_TOKEN
    rec["payload_off"], rec["payload_len"] = payload.add(message) if message else (0, 0)
    return rec.tobytes()


def reply_record(worker: int, slot: int, gen: int, payload: PayloadBuilder, body: bytes) -> bytes:
    """A REPLY record's bytes (the answer to an engine call, `body` added to `payload`)."""
    rec = np.zeros(1, TOKEN_OUT.dtype)
    rec["kind"], rec["worker"], rec["slot"], rec["gen"], rec["token"] = TokenKind.REPLY, worker, slot, gen, NO_TOKEN
    rec["payload_off"], rec["payload_len"] = payload.add(body)
    return rec.tobytes()
