"""The Responses API's stored responses (store: true, OpenAI's default): what GET
/v1/responses/{id}, previous_response_id, cancel, delete and input_items read.

One SQLite file in the server's private runtime directory (ServerFiles.responses), shared by
every HTTP worker of the server: a response made through one worker is found through any
other, and a background response one worker runs can be cancelled through another. The file
goes with the server (ServerFiles.remove), so nothing outlives it: a cache of the server's own
answers, not a database to keep (no fsync). Bounded: the newest MAX_STORED_RESPONSES are kept,
older ones are evicted as new ones come."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

MAX_STORED_RESPONSES = 4096
BUSY_TIMEOUT_S = 5.0  # another worker's write holds the file at most this long (each is one small row)
RUNNING = ("queued", "in_progress")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    background INTEGER NOT NULL,
    response BLOB NOT NULL,  -- the response object's JSON
    history BLOB NOT NULL    -- the conversation's items before its output (JSON list)
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


class ResponseStore:
    """A worker's handle on the server's stored responses; the file opens at first use."""

    def __init__(self, path: Path, max_responses: int = MAX_STORED_RESPONSES) -> None:
        self.path = path
        self.max_responses = max_responses
        self._db: sqlite3.Connection | None = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=OFF")
            db.execute(_SCHEMA)
            self._db = db
        return self._db

    def put(self, response: dict[str, Any], history: list[dict[str, Any]], background: bool) -> None:
        """Stores (or replaces) a response; the oldest beyond the bound are evicted."""
        db = self._conn()
        db.execute(
            "INSERT OR REPLACE INTO responses (id, status, background, response, history) VALUES (?, ?, ?, ?, ?)",
            (response["id"], response["status"], int(background), orjson.dumps(response), orjson.dumps(history)),
        )
        db.execute(
            "DELETE FROM responses WHERE seq <= (SELECT seq FROM responses ORDER BY seq DESC LIMIT 1 OFFSET ?)",
            (self.max_responses,),
        )

    def get(self, response_id: str) -> StoredResponse | None:
        row = (
            self._conn()
            .execute("SELECT response, history, background FROM responses WHERE id = ?", (response_id,))
            .fetchone()
        )
        if row is None:
            return None
        return StoredResponse(orjson.loads(row[0]), orjson.loads(row[1]), bool(row[2]))

    def update_running(self, response: dict[str, Any]) -> bool:
        """A running response's new state (its end, or in_progress), unless it was cancelled or
        deleted meanwhile: whether it was written."""
        cursor = self._conn().execute(
            f"UPDATE responses SET status = ?, response = ? WHERE id = ? AND status IN {RUNNING}",
            (response["status"], orjson.dumps(response), response["id"]),
        )
        return cursor.rowcount == 1

    def cancel(self, response_id: str) -> StoredResponse | None:
        """Marks a running background response cancelled; the stored response (cancelled, or
        as it was when it had already ended), or None if there is none."""
        stored = self.get(response_id)
        if stored is None or not stored.background or stored.status not in RUNNING:
            return stored
        cancelled = {**stored.response, "status": "cancelled"}
        if not self.update_running(cancelled):  # it ended meanwhile
            return self.get(response_id)
        return StoredResponse(cancelled, stored.history, True)

    def delete(self, response_id: str) -> bool:
        return self._conn().execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount == 1

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
