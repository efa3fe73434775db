"""The detokenizer's record work, transport-free: a popped batch of TOKEN_OUT records in,
TEXT_OUT records and their payload blob out (protocol/records.py has both layouts).

Requests are addressed by (worker, slot, gen). The scheduler's OPEN record starts one
(protocol/records.py OPEN_RECORD); its TOKEN records follow; the record carrying a
finish ends it. Records whose gen is not the open one are stale (an aborted
request) and dropped.

Per step, a request gets a TEXT_OUT record when its new tokens complete some text, when
it finishes, or, if it asked for logprobs or its token ids (OpenFlags.RETURN_IDS:
/generate's output_ids), whenever it got tokens (text possibly empty), with them.
`n_tokens` counts the tokens since its previous record, so a request whose tokens
completed no character is simply not mentioned. The text of a stop token (EOS or one of
stop_token_ids: a TOKEN with finish STOP) is not output, as SGLang trims it; its id is in
`stop_token`. A stop string hit finishes the request with finish STOP and `stop_index`;
the scheduler does not know about it, so the TokenizerManager must send an ABORT for it
(to free its KV pages); the detokenizer drops the request's later tokens meanwhile.

A PROMPT_LOGPROBS record (a request's prompt logprobs, before its first TOKEN) is forwarded
to the request's worker as a TEXT_OUT PROMPT_LOGPROBS record with the same payload, ahead of
the request's text; one for a request that is not open here is stale and dropped.

A record that cannot be handled fails its own request, never the process: an OPEN that
raises (its stop strings unreadable, say) gets an ERROR record (INTERNAL); a batch whose
vectorised TOKEN pass raises (a bug) is logged and handled again one record at a time
(`handle_isolated`), and each record that raises there fails its request. Requests that
the failed pass had already advanced through the per-request path may repeat a delta:
acceptable for what is a bug's fallback, and better than failing every request of the batch.

Payload blob: every logprobs part first (pack_logprobs; each a multiple of 4 bytes, so
they stay 4-byte aligned), then the token-id runs (uint32), then the text deltas.
"""

from __future__ import annotations

import logging

import numpy as np

from ipc.ring import Batch
from protocol.memo import ByteLRU, string_bytes
from protocol.payloads import decode_strings, pack_logprobs, unpack_top_logprobs
from protocol.record_bytes import TOKEN_OUT_STRUCT, concat_records, take_records, unpack_open
from protocol.records import NO_TOKEN, TEXT_OUT, TOKEN_OUT, ErrorCode, Finish, OpenFlags, TextKind, TokenKind
from runtime.detokenizer.incremental import BatchDetokenizer, DetokOptions, DetokOutput

logger = logging.getLogger(__name__)

# plain ints for the hot path: an IntEnum member lookup is a Python-level __getattr__
_TOKEN, _OPEN, _STOP, _NONE = int(TokenKind.TOKEN), int(TokenKind.OPEN), int(Finish.STOP), int(Finish.NONE)
_PROMPT = int(TokenKind.PROMPT_LOGPROBS)
_KIND_AT = TOKEN_OUT.dtype.fields["kind"][1]
_SKIP_SPECIAL = int(OpenFlags.SKIP_SPECIAL_TOKENS)
_LOGPROBS = int(OpenFlags.LOGPROBS)
_NO_STOP_TRIM = int(OpenFlags.NO_STOP_TRIM)
_RETURN_IDS = int(OpenFlags.RETURN_IDS)
_NO_LIMIT = np.iinfo(np.int64).max
_BLOB_ORDER = (("logprobs_off", "logprobs_len"), ("ids_off", "ids_len"), ("text_off", "text_len"))


class TextDeltas:
    def __init__(self, tokenizer, max_open: int = 8192, use_byte_table: bool = True) -> None:
        """max_open: requests open at once (OPENed and not finished, queued ones included)."""
        self.core = BatchDetokenizer(tokenizer, max_open, use_byte_table=use_byte_table)
        self._index = np.full((1, 1), -1, np.int64)  # [workers, slots] core index of the open request
        self._gen = np.zeros((1, 1), np.uint32)  # [workers, slots] its generation
        self._free = list(range(max_open - 1, -1, -1))
        self._addr = np.zeros((max_open, 3), np.int64)  # per core index: worker, slot, gen
        self._logprobs = np.zeros(max_open, bool)
        self._ids = np.zeros(max_open, bool)  # return_ids: its tokens' ids go with its text
        self._n_top = np.zeros(max_open, np.uint8)
        self._unsent = np.zeros(max_open, np.int64)  # tokens since the request's last record
        self._usage = np.zeros((max_open, 3), np.uint32)  # prompt, completion, cached tokens
        self._finish = np.zeros(max_open, np.uint8)  # the scheduler's finish, once it came
        self._stop_token = np.full(max_open, -1, np.int32)
        self._trim_stop_token = np.ones(max_open, bool)  # its stop token's text is not output
        self._mark = np.zeros(max_open, bool)  # scratch
        self._row = np.zeros(max_open, np.int64)  # scratch: a request's row in a step's records
        self._limit = np.full(max_open, _NO_LIMIT, np.int64)  # scratch: records a request keeps in a step

    @property
    def num_open(self) -> int:
        return len(self._addr) - len(self._free)

    def handle(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """One popped TOKEN_OUT batch -> (TEXT_OUT records, payload blob), all workers mixed."""
        recs = batch.records
        token = recs["kind"] == _TOKEN
        if token.all():
            return self._tokens(recs, batch.payload)
        # A batch holds several steps, each OPENing requests; a pass of TOKEN records is a run
        # of numpy calls whose fixed cost dwarfs its per-record work, whatever its size, so when
        # the control records commute with the TOKEN records they go first, then every TOKEN
        # record in one pass. Else runs of TOKEN records between control records, in order.
        control = take_records(recs, ~token)
        if self._commute(control):
            outs = [self._control(r, batch.payload) for r in control]
            outs.append(self._tokens(take_records(recs, token), batch.payload))
            return _merge(outs)
        cuts = np.flatnonzero(token[1:] != token[:-1]) + 1
        outs = []
        for start, end in zip([0, *cuts.tolist()], [*cuts.tolist(), len(recs)]):
            if token[start]:
                outs.append(self._tokens(recs[start:end], batch.payload))
            else:
                outs.extend(self._control(r, batch.payload) for r in recs[start:end])
        return _merge(outs)

    # ---------------------------------------------------------------- OPEN / ERROR

    def _commute(self, control: np.ndarray) -> bool:
        """Whether handling `control` (OPEN / ERROR records) before the batch's TOKEN records
        gives what handling them in order gives: each addresses a slot no other control
        record of the batch addresses and that holds no open request. A TOKEN record then
        only matches a control record's request if it follows its OPEN (a request's tokens
        come after its OPEN), and an OPEN closes nothing a token might still need.
        PROMPT_LOGPROBS records are left out of the check: they come after their request's
        OPEN (kept in order among the control records) and before all of its TOKEN records,
        and open or close nothing."""
        prompt = control["kind"] == _PROMPT
        if prompt.any():
            control = take_records(control, ~prompt)
        w, s = control["worker"].astype(np.int64), control["slot"].astype(np.int64)
        if len(control) > 1 and len(np.unique(w << 32 | s)) < len(control):
            return False
        inside = (w < self._index.shape[0]) & (s < self._index.shape[1])
        return not (self._index[w[inside], s[inside]] >= 0).any()

    def handle_isolated(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """`handle` one record at a time, in order (after `handle` raised): a record that
        raises fails its request (closed here, an ERROR record to its worker), the rest go on."""
        recs, outs = batch.records, []
        for k in range(len(recs)):
            try:
                if recs["kind"][k] == _TOKEN:
                    outs.append(self._tokens(recs[k : k + 1], batch.payload))
                else:
                    outs.append(self._control(recs[k], batch.payload))
            except Exception:
                w, s, gen = int(recs["worker"][k]), int(recs["slot"][k]), int(recs["gen"][k])
                logger.exception("request (%d, %d, %d): its record could not be detokenized", w, s, gen)
                outs.append(self.fail(w, s, gen, ErrorCode.INTERNAL, b"the detokenizer failed on this request"))
        return _merge(outs)

    def fail(self, w: int, s: int, gen: int, code: int, message: bytes) -> tuple[np.ndarray, np.ndarray]:
        """Ends request (w, s, gen) here (its later tokens are dropped) and gives the ERROR
        record that tells its worker."""
        if self._is_open(w, s, gen):
            self._close(w, s)
        return error_records(w, s, gen, code, message)

    def close_worker(self, w: int) -> list[tuple[int, int]]:
        """Closes every open request of worker `w` (its later tokens are dropped); their (slot, gen)."""
        if w >= self._index.shape[0]:
            return []
        slots = np.flatnonzero(self._index[w] >= 0).tolist()
        gens = self._gen[w, slots].tolist()
        for s in slots:
            self._close(w, s)
        return list(zip(slots, gens))

    def _control(self, rec: np.void, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raw = rec.tobytes()  # fields read in one call: numpy reads a record's fields one at a time
        if raw[_KIND_AT] == _PROMPT:
            return self._prompt_logprobs(raw, payload)
        if raw[_KIND_AT] != _OPEN:
            return self._error_record(raw, rec, payload)
        o = unpack_open(raw)
        try:
            opened = self._open(
                o.worker,
                o.slot,
                o.gen,
                o.flags,
                o.top_logprobs,
                o.min_new_tokens,
                payload[o.stop_off : o.stop_off + o.stop_len],
            )
        except Exception:  # that request fails, not the batch
            logger.exception("request (%d, %d, %d): its OPEN record could not be handled", o.worker, o.slot, o.gen)
            return self.fail(o.worker, o.slot, o.gen, ErrorCode.INTERNAL, b"the detokenizer could not open the request")
        if opened:
            return _NOTHING
        message = f"the detokenizer has {len(self._addr)} requests open, its limit".encode()
        return error_records(o.worker, o.slot, o.gen, ErrorCode.OVERLOADED, message, rec)

    def _error_record(self, raw: bytes, rec: np.void, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        (w, kind, _, s, gen, _, _, _, _, _, off, size, _, _, error) = TOKEN_OUT_STRUCT.unpack(raw)
        if kind != TokenKind.ERROR:
            logger.error("token-out record of unknown kind %d for (%d, %d, %d) dropped", kind, w, s, gen)
            return _NOTHING
        if self._is_open(w, s, gen):
            self._close(w, s)
        return error_records(w, s, gen, error, np.ascontiguousarray(payload[off : off + size]), rec)

    def _prompt_logprobs(self, raw: bytes, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A PROMPT_LOGPROBS record as its TEXT_OUT twin (protocol/records.py), payload as it is."""
        (w, _, _, s, gen, first, prompt_tokens, count, cached, _, off, size, n_top, _, _) = TOKEN_OUT_STRUCT.unpack(raw)
        if not self._is_open(w, s, gen):
            return _NOTHING
        out = np.zeros(1, TEXT_OUT.dtype)
        out["worker"], out["slot"], out["gen"], out["kind"] = w, s, gen, TextKind.PROMPT_LOGPROBS
        out["n_tokens"], out["n_top"], out["stop_token"], out["stop_index"] = count, n_top, first, -1
        out["prompt_tokens"], out["cached_tokens"], out["logprobs_len"] = prompt_tokens, cached, size
        return out, np.array(payload[off : off + size], np.uint8)

    def _open(self, w: int, s: int, gen: int, flags: int, n_top: int, min_tokens: int, body: np.ndarray) -> bool:
        """False when max_open requests are open already. flags: OpenFlags bits."""
        if w >= self._index.shape[0] or s >= self._index.shape[1]:
            self._grow(w + 1, s + 1)
        if self._index[w, s] >= 0:  # the slot's previous request never finished here: drop it
            self._close(w, s)
        if not self._free:
            return False
        options = _options(flags & (_SKIP_SPECIAL | _NO_STOP_TRIM), min_tokens, body.tobytes())
        i = self._free[-1]
        self.core.open(i, options)
        self._free.pop()  # taken only once opened: an OPEN that raises takes nothing
        keep_stop = bool(flags & _NO_STOP_TRIM)
        self._trim_stop_token[i] = not keep_stop
        self._index[w, s], self._gen[w, s] = i, gen
        self._addr[i] = w, s, gen
        self._logprobs[i] = bool(flags & _LOGPROBS)
        self._ids[i] = bool(flags & _RETURN_IDS)
        self._n_top[i] = n_top
        self._unsent[i] = 0
        self._usage[i] = 0
        self._finish[i], self._stop_token[i] = Finish.NONE, -1
        return True

    def _grow(self, workers: int, slots: int) -> None:
        """Address tables big enough for (workers, slots); slots double, to grow rarely."""
        w0, s0 = self._index.shape
        w, s = max(workers, w0), max(slots, 2 * s0) if slots > s0 else s0
        index, gen = np.full((w, s), -1, np.int64), np.zeros((w, s), np.uint32)
        index[: self._index.shape[0], : self._index.shape[1]] = self._index
        gen[: self._gen.shape[0], : self._gen.shape[1]] = self._gen
        self._index, self._gen = index, gen

    def _is_open(self, w: int, s: int, gen: int) -> bool:
        return (
            w < self._index.shape[0] and s < self._index.shape[1] and self._index[w, s] >= 0 and self._gen[w, s] == gen
        )

    def _close(self, w: int, s: int) -> None:
        i = int(self._index[w, s])
        self.core.close(i)
        self._index[w, s] = -1
        self._free.append(i)

    # ---------------------------------------------------------------- TOKEN

    def _tokens(self, recs: np.ndarray, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        w, s = recs["worker"].astype(np.intp), recs["slot"].astype(np.intp)
        inside = (w < self._index.shape[0]) & (s < self._index.shape[1])
        if not inside.all():
            w, s = np.where(inside, w, 0), np.where(inside, s, 0)
        idx = self._index[w, s]
        live = inside & (idx >= 0) & (self._gen[w, s] == recs["gen"])
        if not live.all():
            recs, idx = take_records(recs, live), idx[live]
            if len(recs) == 0:
                return _NOTHING
        out = self.core.step(
            idx, text_tokens(recs["token"], recs["finish"], self._trim_stop_token[idx]), recs["finish"] != _NONE
        )
        cut = out.used >= 0
        if cut.any():  # a stop string ended a request: its later tokens are not its own
            recs, idx = self._through_stops(recs, idx, out.req[cut], out.used[cut])

        finish, token = recs["finish"], recs["token"]
        real = token != NO_TOKEN
        np.add.at(self._unsent, idx[real], 1)
        self._usage[idx, 0] = recs["prompt_tokens"]
        self._usage[idx, 2] = recs["cached_tokens"]
        np.maximum.at(self._usage[:, 1], idx, recs["completion_tokens"])
        ended = finish != _NONE
        if ended.any():
            self._finish[idx[ended]] = finish[ended]
            stops = (finish == _STOP) & real
            self._stop_token[idx[stops]] = token[stops]

        lp_asked, ids_asked = self._logprobs[idx], self._ids[idx]
        asked = lp_asked | ids_asked
        if asked.any():  # logprob and return_ids requests get a record for every step with tokens
            mark = self._mark
            mark[out.req] = True
            extra = idx[asked][~mark[idx[asked]]]
            mark[out.req] = False
            rows = np.concatenate([out.req, np.unique(extra)])
        else:
            rows = out.req
        if len(rows) == 0:
            return _NOTHING
        return self._records(rows, out, recs, idx, lp_asked, ids_asked, payload)

    def _through_stops(
        self, recs: np.ndarray, idx: np.ndarray, stopped: np.ndarray, used: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """recs (and their idx) without the records of each stopped request past its first
        `used` (the one that completed its stop string): their tokens are not in its usage,
        logprobs or ids."""
        order = np.argsort(idx, kind="stable")
        grouped = idx[order]
        head = np.ones(len(grouped), bool)
        head[1:] = grouped[1:] != grouped[:-1]
        starts = np.flatnonzero(head)
        rank = np.empty(len(idx), np.int64)  # each record's place among its request's records
        rank[order] = np.arange(len(idx)) - np.repeat(starts, np.diff(np.append(starts, len(idx))))
        limit = self._limit
        limit[stopped] = used
        keep = rank < limit[idx]
        limit[stopped] = _NO_LIMIT
        return take_records(recs, keep), idx[keep]

    def _records(
        self,
        rows: np.ndarray,
        out: DetokOutput,
        recs: np.ndarray,
        idx: np.ndarray,
        lp_asked: np.ndarray,
        ids_asked: np.ndarray,
        payload: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        n, m = len(rows), len(out.req)
        res = np.zeros(n, TEXT_OUT.dtype)  # kind TEXT (0), no logprobs unless set below
        addr = self._addr[rows]
        res["worker"], res["slot"], res["gen"] = addr[:, 0], addr[:, 1], addr[:, 2]
        res["n_tokens"] = self._unsent[rows]
        self._unsent[rows] = 0
        usage = self._usage[rows]
        res["prompt_tokens"], res["completion_tokens"], res["cached_tokens"] = usage[:, 0], usage[:, 1], usage[:, 2]
        finished = np.zeros(n, bool)
        finished[:m] = out.finished
        stop_hit = np.full(n, -1, np.int16)
        stop_hit[:m] = out.stop
        res["stop_index"] = stop_hit
        res["finish"] = np.where(finished, np.where(stop_hit >= 0, _STOP, self._finish[rows]), _NONE)
        res["stop_token"] = np.where(finished & (stop_hit < 0), self._stop_token[rows], -1)

        parts: list[bytes] = []  # logprobs, then ids (each a multiple of 4 bytes), then the text
        size = 0
        if lp_asked.any():
            size = self._logprob_parts(res, rows, recs[lp_asked], idx[lp_asked], payload, parts)
        if ids_asked.any():
            size += self._id_parts(res, rows, recs[ids_asked], idx[ids_asked], size, parts)
        res["text_off"][:m] = out.offset + size
        res["text_len"][:m] = out.length
        for w, s, _ in addr[finished].tolist():
            self._close(w, s)
        return res, np.concatenate([np.frombuffer(b"".join(parts), np.uint8), out.text])

    def _logprob_parts(
        self,
        res: np.ndarray,
        rows: np.ndarray,
        recs: np.ndarray,
        idx: np.ndarray,
        payload: np.ndarray,
        parts: list[bytes],
    ) -> int:
        """pack_logprobs of each logprob request's tokens of this step (Python per such token:
        the top-N alternatives are per token anyway). Returns the parts' total size."""
        row_of = {r: k for k, r in enumerate(rows.tolist())}
        order = np.argsort(idx, kind="stable")
        idx, recs = idx[order], recs[order]
        cuts = np.flatnonzero(idx[1:] != idx[:-1]) + 1
        size = 0
        for start, end in zip([0, *cuts.tolist()], [*cuts.tolist(), len(idx)]):
            i = int(idx[start])
            group = recs[start:end]
            group = group[group["token"] != NO_TOKEN]
            n_top = int(self._n_top[i])
            top_ids = np.zeros((len(group), n_top), np.uint32)
            top_lps = np.full((len(group), n_top), -np.inf, np.float32)
            for t, rec in enumerate(group):
                k = min(n_top, int(rec["n_top"]))
                if k:
                    ids, lps = unpack_top_logprobs(
                        payload[rec["payload_off"] : rec["payload_off"] + rec["payload_len"]], int(rec["n_top"])
                    )
                    top_ids[t, :k], top_lps[t, :k] = ids[:k], lps[:k]
            part = pack_logprobs(
                group["token"], group["logprob"], top_ids if n_top else None, top_lps if n_top else None
            )
            k = row_of[i]
            res["logprobs_off"][k], res["logprobs_len"][k], res["n_top"][k] = size, len(part), n_top
            parts.append(part)
            size += len(part)
        return size

    def _id_parts(
        self, res: np.ndarray, rows: np.ndarray, recs: np.ndarray, idx: np.ndarray, base: int, parts: list[bytes]
    ) -> int:
        """The token ids of each return_ids request's tokens of this step, in order, one uint32
        run a request at `base` bytes into the blob. Returns their size."""
        real = recs["token"] != NO_TOKEN
        idx, tokens = idx[real], recs["token"][real]
        if not len(idx):
            return 0
        order = np.argsort(idx, kind="stable")
        reqs, starts, counts = np.unique(idx[order], return_index=True, return_counts=True)
        self._row[rows] = np.arange(len(rows))
        at = self._row[reqs]
        res["ids_off"][at] = base + 4 * starts
        res["ids_len"][at] = 4 * counts
        parts.append(tokens[order].astype(np.uint32).tobytes())
        return 4 * len(tokens)


def text_tokens(token: np.ndarray, finish: np.ndarray, trim_stop_token: np.ndarray) -> np.ndarray:
    """The ids of TOKEN_OUT tokens whose text the detokenizer outputs, -1 for none: a record
    without a token, and a stop token (EOS, stop_token_ids: finish STOP) whose text is trimmed,
    as SGLang trims it (all but no_stop_trim requests)."""
    return np.where(((finish == _STOP) & trim_stop_token) | (token == NO_TOKEN), -1, token.astype(np.int64))


def error_records(
    w: int, s: int | list[int], gen: int | list[int], code: int, message, rec: np.void | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """ERROR records ending request (w, s, gen), or one per (slot, gen) of lists, each with
    `message` (all pointing at the one blob), and `rec`'s usage counts when given."""
    out = np.zeros(np.size(s), TEXT_OUT.dtype)
    out["worker"], out["slot"], out["gen"] = w, s, gen
    out["kind"], out["finish"], out["error"] = TextKind.ERROR, Finish.ERROR, code
    if rec is not None:
        out["prompt_tokens"], out["completion_tokens"] = rec["prompt_tokens"], rec["completion_tokens"]
        out["cached_tokens"] = rec["cached_tokens"]
    out["stop_token"], out["stop_index"] = -1, -1
    blob = np.frombuffer(message, np.uint8) if isinstance(message, bytes) else message
    out["text_len"] = len(blob)
    return out, blob


def split_by_worker(records: np.ndarray, blob: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """TEXT_OUT records of several workers -> {worker: (its records, its own blob)}."""
    workers = records["worker"]
    if len(records) == 0:
        return {}
    if (workers == workers[0]).all():
        return {int(workers[0]): (records, blob)}
    out = {}
    for w in np.unique(workers).tolist():
        sel = take_records(records, workers == w)
        out[w] = sel, _regather(sel, blob, [sel[off] for off, _ in _BLOB_ORDER])
    return out


def _gather(blob: np.ndarray, off: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The spans blob[off:off+length], back to back, and where each starts in the result."""
    length = length.astype(np.int64)
    end = np.cumsum(length)
    start = end - length
    total = int(end[-1]) if len(end) else 0
    src = np.repeat(off.astype(np.int64) - start, length) + np.arange(total)
    return blob[src], start.astype(np.uint32)


def _merge(outs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Several (records, blob) -> one, logprobs parts still first and 4-byte aligned."""
    outs = [o for o in outs if len(o[0])]
    if len(outs) <= 1:
        return outs[0] if outs else _NOTHING
    records = concat_records([r for r, _ in outs])
    blob = np.concatenate([b for _, b in outs])
    return records, _regather(records, blob, [_shifted(outs, off) for off, _ in _BLOB_ORDER])


def _regather(records: np.ndarray, blob: np.ndarray, offsets: list[np.ndarray]) -> np.ndarray:
    """A blob holding just `records`' payloads, in _BLOB_ORDER (`offsets`: where each field's
    spans start in `blob`); the records' offsets are set to where they are in it."""
    pieces, size = [], 0
    for (off, length), starts in zip(_BLOB_ORDER, offsets):
        data, new = _gather(blob, starts, records[length])
        records[off] = new + size
        pieces.append(data)
        size += len(data)
    return np.concatenate(pieces)


def _shifted(outs: list[tuple[np.ndarray, np.ndarray]], field: str) -> np.ndarray:
    base = np.cumsum([0] + [len(b) for _, b in outs[:-1]])
    return np.concatenate([r[field].astype(np.int64) + b for (r, _), b in zip(outs, base)])


_NOTHING = (np.zeros(0, TEXT_OUT.dtype), np.zeros(0, np.uint8))


# keyed by client stop strings: bounded by bytes (issue 19), not only by entries
_OPTIONS = ByteLRU(max_bytes=16 << 20, max_entries=1024)


def _options(flags: int, min_tokens: int, stop: bytes) -> DetokOptions:
    """An OPEN record's DetokOptions (frozen): one per distinct setting, not one a request."""
    key = (flags, min_tokens, stop)
    options = _OPTIONS.get(key)
    if options is None:
        strings = decode_strings(stop)
        if "" in strings:  # the HTTP layer refuses them; a record that holds one fails its request
            raise ValueError("an empty stop string")
        options = DetokOptions(
            skip_special_tokens=bool(flags & _SKIP_SPECIAL),
            stop=strings,
            min_tokens=min_tokens,
            no_stop_trim=bool(flags & _NO_STOP_TRIM),
        )
        _OPTIONS.put(key, options, len(stop) + string_bytes(options.stop))
    return options
