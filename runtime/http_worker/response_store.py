"""The Responses API's stored responses (store: true, OpenAI's default): what GET
/v1/responses/{id}, previous_response_id, cancel, delete and input_items read.

One SQLite file in the server's private runtime directory (ServerFiles.responses), shared by
every HTTP worker of the server: a response made through one worker is found through any
other, and a background response one worker runs can be cancelled through another. The file
goes with the server (ServerFiles.remove), so nothing outlives it: a cache of the server's own
answers, not a database to keep (no fsync). Bounded by count, bytes and age: the least
recently used are evicted as new ones come. Each response belongs to the credential that made
it (a digest of its bearer token): another key's request finds nothing, as if it did not exist."""

from __future__ import annotations

import hashlib
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

MAX_STORED_RESPONSES = 4096
MAX_STORED_BYTES = 256 << 20  # the responses' and their inputs' JSON, all together
MAX_AGE_S = 24 * 3600.0
BUSY_TIMEOUT_S = 5.0  # another worker's write holds the file at most this long (each is one small row)
RUNNING = ("queued", "in_progress")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT NOT NULL,
    owner BLOB NOT NULL,     -- a digest of the bearer token that made it (owner_of)
    status TEXT NOT NULL,
    background INTEGER NOT NULL,
    response BLOB NOT NULL,  -- the response object's JSON
    history BLOB NOT NULL,   -- the conversation's items before its output (JSON list)
    size INTEGER NOT NULL,   -- bytes of response and history
    created REAL NOT NULL,
    used REAL NOT NULL,      -- last stored or read: eviction takes the least recently used
    PRIMARY KEY (owner, id)  -- a client's own request id never replaces another key's response
)
"""


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    history: list[dict[str, Any]]
    background: bool

    @property
    def status(self) -> str:
        return self.response["status"]

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """The items a response continuing this one starts from: its history, then its output."""
        return self.history + self.response["output"]


def owner_of(authorization: str | None) -> bytes:
    """Whose a stored response is: a digest of the request's Authorization header, so that the
    store holds no credential and two keys never see each other's responses."""
    return hashlib.blake2b((authorization or "").encode("latin-1", "replace"), digest_size=16).digest()


class ResponseStore:
    """A worker's handle on the server's stored responses; the file opens at first use."""

    def __init__(
        self,
        path: Path,
        max_responses: int = MAX_STORED_RESPONSES,
        max_bytes: int = MAX_STORED_BYTES,
        max_age_s: float = MAX_AGE_S,
    ) -> None:
        self.path = path
        self.max_responses, self.max_bytes, self.max_age_s = max_responses, max_bytes, max_age_s
        self._db: sqlite3.Connection | None = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=OFF")
            db.execute(_SCHEMA)
            self._db = db
        return self._db

    def put(self, response: dict[str, Any], history: list[dict[str, Any]], background: bool, owner: bytes) -> None:
        """Stores (or replaces) a response, then evicts what is over the bounds."""
        body, past, now = orjson.dumps(response), orjson.dumps(history), time.time()
        db = self._conn()
        db.execute(
            "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (response["id"], owner, response["status"], int(background), body, past, len(body) + len(past), now, now),
        )
        db.execute("DELETE FROM responses WHERE created < ?", (now - self.max_age_s,))
        db.execute(
            "DELETE FROM responses WHERE rowid IN (SELECT rowid FROM (SELECT rowid, COUNT(*) OVER newest AS n, "
            "SUM(size) OVER newest AS total FROM responses WINDOW newest AS (ORDER BY used DESC, rowid DESC)) "
            "WHERE n > ? OR total > ?)",
            (self.max_responses, self.max_bytes),
        )

    def get(self, response_id: str, owner: bytes) -> StoredResponse | None:
        db = self._conn()
        row = db.execute(
            "SELECT response, history, background FROM responses WHERE id = ? AND owner = ? AND created >= ?",
            (response_id, owner, time.time() - self.max_age_s),
        ).fetchone()
        if row is None:
            return None
        db.execute("UPDATE responses SET used = ? WHERE id = ? AND owner = ?", (time.time(), response_id, owner))
        return StoredResponse(orjson.loads(row[0]), orjson.loads(row[1]), bool(row[2]))

    def update_running(self, response: dict[str, Any], owner: bytes) -> bool:
        """A running response's new state (its end, or in_progress), unless it was cancelled or
        deleted meanwhile: whether it was written."""
        body = orjson.dumps(response)
        cursor = self._conn().execute(
            f"UPDATE responses SET status = ?, response = ?, size = length(history) + ? "
            f"WHERE id = ? AND owner = ? AND status IN {RUNNING}",
            (response["status"], body, len(body), response["id"], owner),
        )
        return cursor.rowcount == 1

    def cancel(self, response_id: str, owner: bytes) -> StoredResponse | None:
        """Marks a running background response cancelled; the stored response (cancelled, or
        as it was when it had already ended), or None if there is none."""
        stored = self.get(response_id, owner)
        if stored is None or not stored.background or stored.status not in RUNNING:
            return stored
        cancelled = {**stored.response, "status": "cancelled"}
        if not self.update_running(cancelled, owner):  # it ended meanwhile
            return self.get(response_id, owner)
        return StoredResponse(cancelled, stored.history, True)

    def delete(self, response_id: str, owner: bytes) -> bool:
        cursor = self._conn().execute("DELETE FROM responses WHERE id = ? AND owner = ?", (response_id, owner))
        return cursor.rowcount == 1

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
