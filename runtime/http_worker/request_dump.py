"""--dump-requests-folder (SGLang's): each finished request as one JSON line: its endpoint, rids,
prompts as token ids (a chat's after its template), sampling parameters (SamplingParams' own
names), n, and each choice's raw text (before tool-call or reasoning parsing), finish reason and
token counts. Never a header: the API key cannot reach the dump. perf/replay.py sends a dump
back to a server and compares.

Each worker appends to its own file, `requests-w<worker>.jsonl`, so lines never interleave.
Bounded: once a line would take the file past half of --dump-requests-max-bytes, the file is
renamed `requests-w<worker>.1.jsonl` (dropping the one before) and a new one started, so a
worker's dump holds at most the bound and always the latest requests."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from pathlib import Path

import orjson

from protocol.sampling_params import SamplingParams
from runtime.http_worker.req_state import ReqGroup

logger = logging.getLogger("ringserve.app")


@dataclasses.dataclass(frozen=True)
class DumpedInputs:
    endpoint: str
    prompts: list
    params: list[SamplingParams]
    n: int


class RequestDump:
    """One worker's dump file; `submitted` keeps a request's inputs until `ended` writes them."""

    def __init__(self, folder: str, worker: int, max_bytes: int) -> None:
        self.dir = Path(folder)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"requests-w{worker}.jsonl"
        self.rotated = self.dir / f"requests-w{worker}.1.jsonl"
        self.file_bytes = max_bytes // 2
        self._inputs: weakref.WeakKeyDictionary[ReqGroup, DumpedInputs] = weakref.WeakKeyDictionary()
        self._file = open(self.path, "ab")  # kept open for the worker's life
        self._size = self._file.tell()

    def submitted(self, group: ReqGroup, endpoint: str, prompts: list, params: list[SamplingParams], n: int) -> None:
        self._inputs[group] = DumpedInputs(endpoint, prompts, params, n)
        for state in group.states:
            state.kept = []

    def ended(self, group: ReqGroup) -> None:
        """Written as the request ends: a non-streamed one's text is not all taken yet (parts)."""
        inputs = self._inputs.pop(group, None)
        if inputs is None:
            return
        line = orjson.dumps(
            {
                "time": time.time(),
                "endpoint": inputs.endpoint,
                "rids": list(group.rids),
                "prompts": [list(map(int, p)) for p in inputs.prompts],
                "sampling_params": [dataclasses.asdict(p) for p in inputs.params],
                "n": inputs.n,
                "outputs": [
                    {
                        "text": "".join(s.kept or ()) + b"".join(s.parts).decode(errors="replace"),
                        "finish_reason": s.finish.api_name,
                        "prompt_tokens": s.prompt_tokens,
                        "completion_tokens": s.completion_tokens,
                        "cached_tokens": s.cached_tokens,
                    }
                    for s in group.states
                ],
            }
        )
        self._write(line + b"\n")

    def _write(self, line: bytes) -> None:
        try:
            if self._size and self._size + len(line) > self.file_bytes:
                self._file.close()
                os.replace(self.path, self.rotated)
                self._file = open(self.path, "ab")
                self._size = 0
            self._file.write(line)
            self._file.flush()
            self._size += len(line)
        except OSError as e:  # a full disk loses dump lines, never requests
            logger.warning("request dump %s: %s", self.path, e)

    def close(self) -> None:
        self._file.close()
