"""--log-requests: one log line a request, once it ended; never its text."""

from __future__ import annotations

import logging
import weakref

from runtime.http_worker.req_state import ReqGroup

logger = logging.getLogger("ringserve.app")


class RequestLog:
    """Each request's endpoint, kept from its submit to its end, for its log line."""

    def __init__(self) -> None:
        self._endpoints: weakref.WeakKeyDictionary[ReqGroup, str] = weakref.WeakKeyDictionary()

    def submitted(self, group: ReqGroup, endpoint: str) -> None:
        self._endpoints[group] = endpoint

    def ended(self, group: ReqGroup, end_ns: int) -> None:
        states = group.states
        logger.info(
            "request %s %s: %d prompt tokens, %d completion tokens, finish %s, %.3f s",
            ",".join(group.rids),
            self._endpoints.get(group, "?"),
            sum(s.prompt_tokens for s in states),
            sum(s.completion_tokens for s in states),
            ",".join(s.finish.api_name or "none" for s in states),
            (end_ns - group.arrival_ns) * 1e-9,
        )
