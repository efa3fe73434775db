"""The Detokenizer core, transport-free: a batch of TOKEN_OUT records in, TEXT_OUT records
and their payload blob out (protocol/records.py has both layouts). The detokenizer process
feeds it what it pops; the OfflineEngine feeds it each step's records in-process.

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
the scheduler does not know about it, so the request's owner (the TokenizerManager, the
OfflineEngine) must abort it (to free its KV pages); its later tokens are dropped meanwhile.

A PROMPT_LOGPROBS record (a request's prompt logprobs, before its first TOKEN) is forwarded
to the request's worker as a TEXT_OUT PROMPT_LOGPROBS record with the same payload, ahead of
the request's text; one for a request that is not open here is stale and dropped. A REPLY (the
scheduler's answer to an engine call: pause, weights) goes to its caller's worker as it is.
A POOLED record (an embedding's or a score's values) ends its request here and goes to its
worker as a TEXT_OUT POOLED record, finish STOP, the values as its text payload.

A record that cannot be handled fails its own request, never the process: an OPEN that
raises (its stop strings unreadable, say) gets an ERROR record (INTERNAL); a batch whose
vectorised TOKEN pass raises (a bug) is logged and handled again one record at a time
(`handle_isolated`), and each record that raises there fails its request. Requests that
the failed pass had already advanced through the per-request path may repeat a delta:
acceptable for what is a bug's fallback, and better than failing every request of the batch.

The payload blob's order is text_out.py's.
"""

from __future__ import annotations

import logging

import numpy as np

from ipc.ring import Batch
from protocol.memo import ByteLRU, string_bytes
from protocol.payloads import decode_strings, pack_logprobs, unpack_top_logprobs
from protocol.record_bytes import TOKEN_OUT_STRUCT, take_records, unpack_open
from protocol.records import NO_TOKEN, TEXT_OUT, TOKEN_OUT, ErrorCode, Finish, OpenFlags, TextKind, TokenKind, fields_of
from runtime.detokenizer.incremental import BatchDetokenizer, DetokOptions, DetokOutput
from runtime.detokenizer.text_out import NO_TEXT_OUT, error_records, merge_text_out

logger = logging.getLogger(__name__)

# plain ints for the hot path: an IntEnum member lookup is a Python-level __getattr__
_TOKEN, _OPEN, _STOP, _NONE = int(TokenKind.TOKEN), int(TokenKind.OPEN), int(Finish.STOP), int(Finish.NONE)
_PROMPT = int(TokenKind.PROMPT_LOGPROBS)
_REPLY = int(TokenKind.REPLY)
_POOLED = int(TokenKind.POOLED)
_KIND_AT = fields_of(TOKEN_OUT.dtype)["kind"][1]
_SKIP_SPECIAL = int(OpenFlags.SKIP_SPECIAL_TOKENS)
_LOGPROBS = int(OpenFlags.LOGPROBS)
_NO_STOP_TRIM = int(OpenFlags.NO_STOP_TRIM)
_RETURN_IDS = int(OpenFlags.RETURN_IDS)
_NO_LIMIT = np.iinfo(np.int64).max


class Detokenizer:
    def __init__(self, tokenizer, max_open: int = 8192, use_byte_table: bool = True) -> None:
        """max_open: requests open at once (OPENed and not finished, queued ones included)."""
        self.incremental = BatchDetokenizer(tokenizer, max_open, use_byte_table=use_byte_table)
        self._index = np.full((1, 1), -1, np.int64)  # [workers, slots] core index of the open request
        self._gen = np.zeros((1, 1), np.uint32)  # [workers, slots] its generation
        self._free = list(range(max_open - 1, -1, -1))
        self._addr = np.zeros((max_open, 3), np.int64)  # per core index: worker, slot, gen
        self._logprobs = np.zeros(max_open, bool)
        self._ids = np.zeros(max_open, bool)  # return_ids: its tokens' ids go with its text
        self._n_top = np.zeros(max_open, np.uint32)
        self._unsent = np.zeros(max_open, np.int64)  # tokens since the request's last record
        self._usage = np.zeros((max_open, 3), np.uint32)  # prompt, completion, cached tokens
        self._finish = np.zeros(max_open, np.uint8)  # the scheduler's finish, once it came
        self._stop_token = np.full(max_open, -1, np.int32)
        self._trim_stop_token = np.ones(max_open, bool)  # its stop token's text is not output
        self._mark = np.zeros(max_open, bool)  # scratch
        self._row = np.zeros(max_open, np.int64)  # scratch: a request's row in a step's records
        self._limit = np.full(max_open, _NO_LIMIT, np.int64)  # scratch: records a request keeps in a step

    @property
    def max_open(self) -> int:
        return len(self._addr)

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
            return merge_text_out(outs)
        cuts = np.flatnonzero(token[1:] != token[:-1]) + 1
        outs = []
        for start, end in zip([0, *cuts.tolist()], [*cuts.tolist(), len(recs)]):
            if token[start]:
                outs.append(self._tokens(recs[start:end], batch.payload))
            else:
                outs.extend(self._control(r, batch.payload) for r in recs[start:end])
        return merge_text_out(outs)

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
        return merge_text_out(outs)

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
        if raw[_KIND_AT] == _REPLY:
            return self._reply(raw, payload)
        if raw[_KIND_AT] == _POOLED:
            return self._pooled(raw, payload)
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
            return NO_TEXT_OUT
        message = f"the detokenizer has {len(self._addr)} requests open, its limit".encode()
        return error_records(o.worker, o.slot, o.gen, ErrorCode.OVERLOADED, message, rec)

    def _error_record(self, raw: bytes, rec: np.void, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        (w, kind, _, s, gen, _, _, _, _, _, off, size, _, _, error) = TOKEN_OUT_STRUCT.unpack(raw)
        if kind != TokenKind.ERROR:
            logger.error("token-out record of unknown kind %d for (%d, %d, %d) dropped", kind, w, s, gen)
            return NO_TEXT_OUT
        if self._is_open(w, s, gen):
            self._close(w, s)
        return error_records(w, s, gen, error, np.ascontiguousarray(payload[off : off + size]), rec)

    def _prompt_logprobs(self, raw: bytes, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A PROMPT_LOGPROBS record as its TEXT_OUT twin (protocol/records.py), payload as it is."""
        (w, _, _, s, gen, first, prompt_tokens, count, cached, _, off, size, n_top, _, _) = TOKEN_OUT_STRUCT.unpack(raw)
        if not self._is_open(w, s, gen):
            return NO_TEXT_OUT
        out = np.zeros(1, TEXT_OUT.dtype)
        out["worker"], out["slot"], out["gen"], out["kind"] = w, s, gen, TextKind.PROMPT_LOGPROBS
        out["n_tokens"], out["n_top"], out["stop_token"], out["stop_index"] = count, n_top, first, -1
        out["prompt_tokens"], out["cached_tokens"], out["logprobs_len"] = prompt_tokens, cached, size
        return out, np.array(payload[off : off + size], np.uint8)

    def _pooled(self, raw: bytes, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A POOLED record as its TEXT_OUT twin, which ends the request (payload as it is)."""
        (w, _, finish, s, gen, _, prompt_tokens, _, cached, _, off, size, _, _, _) = TOKEN_OUT_STRUCT.unpack(raw)
        if not self._is_open(w, s, gen):
            return NO_TEXT_OUT
        self._close(w, s)
        out = np.zeros(1, TEXT_OUT.dtype)
        out["worker"], out["slot"], out["gen"], out["kind"], out["finish"] = w, s, gen, TextKind.POOLED, finish
        out["prompt_tokens"], out["cached_tokens"], out["text_len"] = prompt_tokens, cached, size
        out["stop_token"], out["stop_index"] = -1, -1
        return out, np.array(payload[off : off + size], np.uint8)

    @staticmethod
    def _reply(raw: bytes, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A REPLY to an engine call, passed on to its caller's worker: it opened nothing here."""
        (w, _, _, s, gen, _, _, _, _, _, off, size, _, _, _) = TOKEN_OUT_STRUCT.unpack(raw)
        out = np.zeros(1, TEXT_OUT.dtype)
        out["worker"], out["slot"], out["gen"], out["kind"], out["text_len"] = w, s, gen, TextKind.REPLY, size
        out["stop_token"], out["stop_index"] = -1, -1
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
        self.incremental.open(i, options)
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
        self.incremental.close(i)
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
                return NO_TEXT_OUT
        out = self.incremental.step(
            idx, _text_tokens(recs["token"], recs["finish"], self._trim_stop_token[idx]), recs["finish"] != _NONE
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
            return NO_TEXT_OUT
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


def _text_tokens(token: np.ndarray, finish: np.ndarray, trim_stop_token: np.ndarray) -> np.ndarray:
    """The ids of TOKEN_OUT tokens whose text the detokenizer outputs, -1 for none: a record
    without a token, and a stop token (EOS, stop_token_ids: finish STOP) whose text is trimmed,
    as SGLang trims it (all but no_stop_trim requests)."""
    return np.where(((finish == _STOP) & trim_stop_token) | (token == NO_TOKEN), -1, token.astype(np.int64))


# keyed by client stop strings: bounded by bytes (a client may send many long ones), not only by entries
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
