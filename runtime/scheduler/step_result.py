"""What one Scheduler.step() returns: its events as TOKEN_OUT records, with what the
records' payloads are made of."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocol.record_bytes import concat_records
from protocol.records import TOKEN_OUT
from runtime.scheduler.req import Req

# Events are TOKEN_OUT records (protocol/records.py), so the scheduler process pushes them as they
# are: one per request with news this step, its sampled token or its end. A record that ends a
# request without a new token has token NO_TOKEN; a request that could never run ends with
# kind ERROR and finish ERROR (its message is Req.error).
TOKEN_EVENT = TOKEN_OUT.dtype


@dataclass
class StepResult:
    events: np.ndarray  # TOKEN_EVENT [E]: the first num_sampled carry a sampled token, the rest end
    #                     requests without one (abort, error, no KV left)
    num_sampled: int
    top_ids: np.ndarray | None  # int32 [num_sampled, K] when some request asked for top logprobs
    top_logprobs: np.ndarray | None  # float32 [num_sampled, K]
    opened: list[Req]  # requests added since the last step, in order (the OPEN records)
    failed: list[Req]  # requests among the events' ERROR records: their error and its message
    # PROMPT_LOGPROBS records of this step's prefill chunks, to be sent before `events` (a request's
    # come before its first token), and each one's payload (pack_prompt_logprobs); then the POOLED
    # records of the pooled requests that ended this step (add_before); None: none
    prompt_records: np.ndarray | None = None
    prompt_payloads: list[bytes] | None = None

    def add_before(self, records: np.ndarray, payloads: list[bytes]) -> None:
        """Records with a payload each, sent after those already before `events`."""
        if self.prompt_records is None or self.prompt_payloads is None:
            self.prompt_records, self.prompt_payloads = records, list(payloads)
        else:
            self.prompt_records = concat_records([self.prompt_records, records])
            self.prompt_payloads = [*self.prompt_payloads, *payloads]

    @property
    def empty(self) -> bool:
        """No record to send: nothing opened, ended, sampled or reported."""
        return not self.opened and not len(self.events) and self.prompt_records is None
