"""Typed reads of a request body's fields. A wrong type raises a 400 naming the field;
JSON null reads as "unset" (the default), as pydantic's Optional fields do in vLLM.
Types are strict: "0.5" is not a number and true is not an integer.

A request names a few of the ~40 fields an endpoint reads, so a read of an absent field
is one dict lookup: no call, nothing recorded.

The reads are also the bodies' definitions: under a FieldLog (httpapi/openapi.py, never while
serving) every Fields records what its parser reads (name, type, default, bounds, choices), and
the OpenAPI document describes each body from that record."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

import orjson

from httpapi.errors import APIError, bad_request
from protocol.memo import ByteLRU

log = logging.getLogger("ringserve.httpapi")

GZIP_MAGIC = b"\x1f\x8b"
# Every integer field is 64-bit signed (orjson reads up to 2**64 - 1 as an int, past that a float)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


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
        log = _FIELD_LOG.get()
        if log is not None:  # a parser read for the OpenAPI document; while serving, this lookup is all
            self.__class__ = LoggedFields
            self.obj = _LoggedObject(obj, log, prefix)

    def param(self, key: str) -> str:
        return self.prefix + key

    def raw(self, key: str) -> Any:
        value = self.obj.get(key)
        if value is not None:
            self.read.add(key)
        return value

    def present(self, keys: Collection[str]) -> list[str]:
        """Those of `keys` the object has, in its order: a parser loops over the few fields a
        request names instead of the many it might."""
        return [k for k in self.obj if k in keys]

    def ignore(self, *keys: str) -> None:
        """Fields the API defines that this server accepts and does not use (e.g. `user`)."""
        self.read.update(keys)

    @overload
    def get_int(self, key: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int: ...
    @overload
    def get_int(
        self, key: str, default: None = None, *, minimum: int | None = None, maximum: int | None = None
    ) -> int | None: ...
    def get_int(
        self, key: str, default: int | None = None, *, minimum: int | None = None, maximum: int | None = None
    ) -> int | None:
        """An integer; `minimum` and `maximum` (inclusive) bound it, and the document shows them."""
        value = self.obj.get(key)
        if value is None:
            return default
        self.read.add(key)
        if type(value) is not int:
            if type(value) is float and abs(value) >= 2**63:  # orjson reads an integer past 64 bits as a float
                raise past_int64(self.param(key), value)
            raise bad_request(f"{self.param(key)} must be an integer, not {_json_type(value)}", self.param(key))
        if not INT64_MIN <= value <= INT64_MAX:
            raise past_int64(self.param(key), value)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise bad_request(f"{self.param(key)} must be {_range(minimum, maximum)}, not {value}", self.param(key))
        return value

    def get_float(
        self, key: str, default: float | None = None, *, within: tuple[float, float] | None = None
    ) -> float | None:
        """A number; `within`: the inclusive range its consumer checks (SamplingParams.validate(),
        with its own message), which the document shows; not checked here, so not twice."""
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

    @overload
    def get_str(self, key: str, default: str, *, choices: tuple[str, ...] = ()) -> str: ...
    @overload
    def get_str(self, key: str, default: None = None, *, choices: tuple[str, ...] = ()) -> str | None: ...
    def get_str(self, key: str, default: str | None = None, *, choices: tuple[str, ...] = ()) -> str | None:
        """A string; `choices`, when given, are the only values taken (the document's enum)."""
        value = self.obj.get(key)
        if value is None:
            return default
        self.read.add(key)
        if type(value) is not str:
            raise bad_request(f"{self.param(key)} must be a string, not {_json_type(value)}", self.param(key))
        if choices and value not in choices:
            raise bad_request(f"{self.param(key)} must be one of {list(choices)}, not {shown(value)}", self.param(key))
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
            params = [self.param(k) for k in unknown]
            held = _WARNINGS.get()
            if held is not None:
                held.append((endpoint, params))
            _warn_unknown(endpoint, params)


def _warn_unknown(endpoint: str, params: list[str]) -> None:
    log.warning("%s: ignoring unknown fields %s", endpoint, params)


T = TypeVar("T")
# the warnings of the parse a ParseMemo runs: (endpoint, unknown params) per warn_unknown
_WARNINGS: ContextVar[list[tuple[str, list[str]]] | None] = ContextVar("ringserve_parse_warnings", default=None)
# a memo entry's cost per byte of its key: what a parse keeps (parsed tools, compiled stop_regex
# patterns, grammar text) is a few times the JSON it came from
PARSE_MEMO_COST_PER_KEY_BYTE = 8


class ParseMemo(Generic[T]):
    """`parse` (a JSON object -> what a request asks) kept by the object's JSON text: a parse
    is a function of the fields it reads, and clients send a few distinct settings, so requests
    that send the same are parsed once instead of in ~40 field reads each. What is kept must not
    be changed by its users (they share it). The warnings of a parse (unknown fields) are kept
    with it and logged again on every request that hits it, as a parse would; a parse that fails
    keeps nothing (the next request parses again). Under a FieldLog (the OpenAPI document)
    every call parses, so that its reads are recorded."""

    def __init__(self, parse: Callable[[dict], T], max_bytes: int) -> None:
        self.parse = parse
        self._kept = ByteLRU(max_bytes)

    def __call__(self, obj: dict) -> T:
        if _FIELD_LOG.get() is not None:
            return self.parse(obj)
        try:
            key = orjson.dumps(obj)
        except orjson.JSONEncodeError:  # nested past orjson's depth for writing: parsed, not kept
            return self.parse(obj)
        hit = self._kept.get(key)
        if hit is not None:
            kept, kept_warnings = hit
            for endpoint, params in kept_warnings:
                _warn_unknown(endpoint, params)
            return kept
        warnings: list[tuple[str, list[str]]] = []
        token = _WARNINGS.set(warnings)
        try:
            value = self.parse(obj)
        finally:
            _WARNINGS.reset(token)
        self._kept.put(key, (value, warnings), PARSE_MEMO_COST_PER_KEY_BYTE * len(key))
        return value


def shown(value: Any) -> str:
    """A client's value in a message, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def past_int64(param: str, value: float) -> APIError:
    """An integer past 64 bits, in the words of vLLM's answer (pydantic's error type, which its
    clients match: `less_than_equal` / `greater_than_equal`)."""
    side, bound = ("less", INT64_MAX) if value > 0 else ("greater", INT64_MIN)
    return bad_request(
        f"{param} is out of range: integers are at most 64-bit (Input should be {side} than or equal to "
        f"{bound} [type={side}_than_equal])",
        param,
    )


def _range(minimum: int | None, maximum: int | None) -> str:
    if minimum is None:
        return f"at most {maximum}"
    return f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"


# ---------------------------------------------------------------- the record of a parser's reads


@dataclass
class FieldRead:
    """One field a parser read: its JSON kind (integer, number, boolean, string, strings: a string
    or a list of them, token_ids, object, or any: read raw, its shape checked by the parser's own
    code), the default it reads as when absent, and the bounds or choices its getter checks."""

    kind: str
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()


class FieldLog:
    """While open (a `with` block), every Fields made in this context records its reads here:
    param (nested ones with their prefix: "stream_options.include_usage") -> FieldRead."""

    def __init__(self) -> None:
        self.fields: dict[str, FieldRead] = {}
        self._token: Token | None = None

    def add(self, param: str, read: FieldRead) -> None:
        """A typed read describes a field better than a raw one; the first typed read stands."""
        known = self.fields.get(param)
        if known is None or (known.kind == "any" and read.kind != "any"):
            self.fields[param] = read

    def __enter__(self) -> FieldLog:
        self._token = _FIELD_LOG.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._token is not None
        _FIELD_LOG.reset(self._token)


_FIELD_LOG: ContextVar[FieldLog | None] = ContextVar("ringserve_field_log", default=None)


class _LoggedObject(dict):
    """A logged Fields' object: a key read raw (f.raw, f.obj.get) is recorded as kind "any"."""

    def __init__(self, obj: dict, log: FieldLog, prefix: str) -> None:
        super().__init__(obj)
        self.log, self.prefix = log, prefix

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.log.add(self.prefix + key, FieldRead("any"))
        return super().get(key, default)


class LoggedFields(Fields):
    """A Fields that records each typed read in the FieldLog before reading (Fields.__init__ makes
    one while a FieldLog is open)."""

    __slots__ = ()

    def _log(self, key: str, kind: str, default: Any = None, **facts: Any) -> None:
        obj = self.obj
        assert isinstance(obj, _LoggedObject)
        obj.log.add(self.param(key), FieldRead(kind, default, **facts))

    def present(self, keys: Collection[str]) -> list[str]:
        """Every one of `keys`: each is read, so the record lists them all."""
        return list(keys)

    def get_int(self, key, default=None, *, minimum=None, maximum=None):  # type: ignore[no-untyped-def]
        self._log(key, "integer", default, minimum=minimum, maximum=maximum)
        return super().get_int(key, default, minimum=minimum, maximum=maximum)

    def get_float(self, key, default=None, *, within=None):  # type: ignore[no-untyped-def]
        minimum, maximum = within or (None, None)
        self._log(key, "number", default, minimum=minimum, maximum=maximum)
        return super().get_float(key, default)

    def get_bool(self, key, default=None):  # type: ignore[no-untyped-def]
        self._log(key, "boolean", default)
        return super().get_bool(key, default)

    def get_str(self, key, default=None, *, choices=()):  # type: ignore[no-untyped-def]
        self._log(key, "string", default, choices=choices)
        return super().get_str(key, default, choices=choices)

    def get_strs(self, key):  # type: ignore[no-untyped-def]
        self._log(key, "strings")
        return super().get_strs(key)

    def get_token_ids(self, key):  # type: ignore[no-untyped-def]
        self._log(key, "token_ids")
        return super().get_token_ids(key)

    def get_object(self, key):  # type: ignore[no-untyped-def]
        self._log(key, "object")
        return super().get_object(key)


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
