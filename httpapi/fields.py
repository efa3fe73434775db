"""Typed reads of a request body's fields. A wrong type raises a 400 naming the field;
JSON null reads as "unset" (the default), as pydantic's Optional fields do in vLLM.
Types are strict: "0.5" is not a number and true is not an integer.

A request names a few of the ~40 fields an endpoint reads, so a read of an absent field
is one dict lookup: no call, nothing recorded."""

from __future__ import annotations

import logging
from typing import Any, overload

import orjson

from httpapi.errors import bad_request

log = logging.getLogger("ringserve.httpapi")

GZIP_MAGIC = b"\x1f\x8b"


def load_object(body: bytes) -> dict:
    """The request body as a JSON object; anything else is a 400 with param None."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        if body[:2] == GZIP_MAGIC:  # checked only here: the happy path reads no header for it
            raise bad_request(
                "The request body is gzip-compressed; Content-Encoding is not supported: send plain JSON", None
            ) from None
        raise bad_request(f"The request body is not valid JSON: {e}", None) from None
    if not isinstance(obj, dict):
        raise bad_request("The request body must be a JSON object.", None)
    return obj


def is_token_ids(value: Any) -> bool:
    return type(value) is list and all(type(t) is int and t >= 0 for t in value)


class Fields:
    """One JSON object's fields; remembers which were read so the rest can be reported."""

    __slots__ = ("obj", "prefix", "read")

    def __init__(self, obj: dict, prefix: str = "") -> None:
        self.obj = obj
        self.prefix = prefix  # how params nested in this object are named: "sampling_params."
        self.read: set[str] = set()

    def param(self, key: str) -> str:
        return self.prefix + key

    def raw(self, key: str) -> Any:
        value = self.obj.get(key)
        if value is not None:
            self.read.add(key)
        return value

    def ignore(self, *keys: str) -> None:
        """Fields the API defines that this server accepts and does not use (e.g. `user`)."""
        self.read.update(keys)

    @overload
    def get_int(self, key: str, default: int) -> int: ...
    @overload
    def get_int(self, key: str, default: None = None) -> int | None: ...
    def get_int(self, key: str, default: int | None = None) -> int | None:
        value = self.obj.get(key)
        if value is None:
            return default
        self.read.add(key)
        if type(value) is not int:
            if type(value) is float and abs(value) >= 2**63:  # orjson reads an integer past 64 bits as a float
                raise bad_request(f"{self.param(key)} is out of range: integers are at most 64-bit", self.param(key))
            raise bad_request(f"{self.param(key)} must be an integer, not {_json_type(value)}", self.param(key))
        return value

    def get_float(self, key: str, default: float | None = None) -> float | None:
        value = self.obj.get(key)
        if value is None:
            return default
        self.read.add(key)
        if type(value) not in (int, float):
            raise bad_request(f"{self.param(key)} must be a number, not {_json_type(value)}", self.param(key))
        return float(value)

    @overload
    def get_bool(self, key: str, default: bool) -> bool: ...
    @overload
    def get_bool(self, key: str, default: None = None) -> bool | None: ...
    def get_bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.obj.get(key)
        if value is None:
            return default
        self.read.add(key)
        if type(value) is not bool:
            raise bad_request(f"{self.param(key)} must be true or false, not {_json_type(value)}", self.param(key))
        return value

    def get_str(self, key: str, default: str | None = None) -> str | None:
        value = self.obj.get(key)
        if value is None:
            return default
        self.read.add(key)
        if type(value) is not str:
            raise bad_request(f"{self.param(key)} must be a string, not {_json_type(value)}", self.param(key))
        return value

    def get_strs(self, key: str) -> tuple[str, ...]:
        """A string or a list of strings (`stop`)."""
        value = self.obj.get(key)
        if value is None:
            return ()
        self.read.add(key)
        if type(value) is str:
            return (value,)
        if type(value) is list and all(type(s) is str for s in value):
            return tuple(value)
        raise bad_request(f"{self.param(key)} must be a string or a list of strings", self.param(key))

    def get_token_ids(self, key: str) -> tuple[int, ...]:
        value = self.obj.get(key)
        if value is None:
            return ()
        self.read.add(key)
        if not is_token_ids(value):
            raise bad_request(f"{self.param(key)} must be a list of non-negative integer token ids", self.param(key))
        return tuple(value)

    def get_object(self, key: str) -> Fields | None:
        value = self.obj.get(key)
        if value is None:
            return None
        self.read.add(key)
        if type(value) is not dict:
            raise bad_request(f"{self.param(key)} must be an object, not {_json_type(value)}", self.param(key))
        return Fields(value, self.param(key) + ".")

    def warn_unknown(self, endpoint: str) -> None:
        """Unknown fields are ignored, with a warning, as vLLM does (a null one: silently)."""
        unknown = [k for k, v in self.obj.items() if k not in self.read and v is not None]
        if unknown:
            log.warning("%s: ignoring unknown fields %s", endpoint, [self.param(k) for k in unknown])


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)
