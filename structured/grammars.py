"""The grammar a request's fields ask for, as (GrammarKind, text), and its check before any
engine work: xgrammar's tokenizer-free constructors parse it as the scheduler's compiler will,
so a schema that does not compile, a regex that does not parse or a bad EBNF is the client's
400 rather than an engine error inside a stream.

    text = json_schema_text(schema)              # a schema object -> its canonical text
    text = choice_grammar(["yes", "no"])         # EBNF matching exactly one of the strings
    text = structural_tag_text(tag)              # xgrammar's structural tag, or vLLM's legacy one
    check_grammar(kind, text, any_whitespace)    # raises InvalidGrammar; memoized by text

A check costs what parsing the text costs: under a millisecond for common schemas, 0.1 s for a
200 KB one, and more for some small ones (nested repetition in a `pattern`), so a caller on an
event loop runs a check it has not memoized (`is_checked`) in a thread; xgrammar releases the
GIL while it parses. The memo is thread-safe for that reason."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import orjson

from protocol.memo import ByteLRU, string_bytes
from protocol.sampling_params import MAX_GRAMMAR_BYTES, GrammarKind

JSON_OBJECT_SCHEMA = '{"type":"object"}'  # response_format json_object: any JSON object
# A schema's nesting in JSON containers: parsing is superlinear in it (a schema of 256 nested
# arrays takes 0.9 s, of 500 nearly 8 s), and real schemas nest a few levels.
MAX_SCHEMA_DEPTH = 64
MEMO_BYTES = 16 << 20  # checked texts kept, by their strings' memory
MAX_MEMO_ENTRY_BYTES = 4 * MAX_GRAMMAR_BYTES + 4096  # a grammar of 4-byte characters, at most


class InvalidGrammar(ValueError):
    """A grammar that xgrammar cannot parse, or past this server's bounds; `message` says why
    for the client (the caller names the field)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def json_schema_text(schema: object) -> str:
    """A JSON schema (an object, or the text of one) as the compact text a grammar holds:
    requests sending one schema with different spacing share its memo and compiled grammar."""
    schema = _json_object(schema, "schema", "a JSON schema")
    _check_depth(schema)
    return _bounded(orjson.dumps(schema).decode())


def _json_object(value: object, name: str, a_name: str) -> dict:
    """`value`, or the JSON object a string holds; InvalidGrammar saying which is wrong."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as e:
            raise InvalidGrammar(f"the {name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidGrammar(f"{a_name} must be an object")
    return value


def choice_grammar(choices: object) -> str:
    """EBNF matching exactly one of `choices` (a non-empty list of strings), each a string
    literal in JSON's escapes, which xgrammar's EBNF reads."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidGrammar("choices must be a non-empty list of strings")
    literals = " | ".join(orjson.dumps(c).decode() for c in dict.fromkeys(choices))
    return _bounded("root ::= " + literals)


def structural_tag_text(tag: object) -> str:
    """xgrammar's structural tag ({"type": "structural_tag", "format": {...}}) as compact text;
    vLLM's legacy form ({"type": "structural_tag", "structures": [{"begin", "schema", "end"}],
    "triggers": [...]}, also SGLang's) is converted to it, as xgrammar converts it. A string is
    read as the JSON of either."""
    tag = _json_object(tag, "structural tag", "a structural tag")
    if "structures" in tag or "triggers" in tag:
        tag = _from_legacy(tag)
    _check_depth(tag)
    return _bounded(orjson.dumps(tag).decode())


def _from_legacy(tag: dict) -> dict:
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not (isinstance(triggers, list) and all(isinstance(t, str) for t in triggers)):
        raise InvalidGrammar("triggers must be a list of strings")
    if not (isinstance(structures, list) and all(isinstance(s, dict) for s in structures)):
        raise InvalidGrammar("structures must be a list of objects with begin, schema and end")
    tags = []
    for s in structures:
        begin, schema, end = s.get("begin"), s.get("schema"), s.get("end")
        if not (isinstance(begin, str) and isinstance(end, str) and isinstance(schema, (dict, bool))):
            raise InvalidGrammar("each of structures must have begin and end strings and a schema object")
        tags.append(
            {"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": schema}, "end": end}
        )
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


def check_grammar(kind: int, text: str, any_whitespace: bool = False) -> None:
    """Raises InvalidGrammar unless xgrammar parses `text` as a grammar of `kind` (a GrammarKind; its verdict
    is kept: the same text, valid or not, costs nothing again). `any_whitespace`: a JSON
    schema's whitespace as the server's --constrained-json-any-whitespace asks."""
    key = (int(kind), any_whitespace, text)
    with _LOCK:
        verdict = _MEMO.get(key)
    if verdict is None:
        verdict = _parse_error(kind, text, any_whitespace) or ""
        with _LOCK:
            _MEMO.put(key, verdict, string_bytes((text, verdict)))
    if verdict:
        raise InvalidGrammar(verdict)


def is_checked(kind: int, text: str, any_whitespace: bool = False) -> bool:
    """Whether check_grammar has the verdict kept (then it costs a lookup)."""
    with _LOCK:
        return _MEMO.get((int(kind), any_whitespace, text)) is not None


_MEMO = ByteLRU(MEMO_BYTES, max_entry_bytes=MAX_MEMO_ENTRY_BYTES)
_LOCK = threading.Lock()  # checks run in threads too


def _parse_error(kind: int, text: str, any_whitespace: bool) -> str | None:
    """xgrammar's complaint about `text`, or None."""
    import xgrammar  # the HTTP worker pays its import only when a request has a grammar

    if len(text) > MAX_GRAMMAR_BYTES or len(text.encode()) > MAX_GRAMMAR_BYTES:
        return f"a grammar must be at most {MAX_GRAMMAR_BYTES} bytes"
    try:
        if kind == GrammarKind.JSON_SCHEMA:
            _check_depth(orjson.loads(text))
            xgrammar.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
        elif kind == GrammarKind.REGEX:
            xgrammar.Grammar.from_regex(text)
        elif kind == GrammarKind.EBNF:
            xgrammar.Grammar.from_ebnf(text)
        elif kind == GrammarKind.STRUCTURAL_TAG:
            _check_depth(orjson.loads(text))
            xgrammar.Grammar.from_structural_tag(text)
        else:
            return f"unknown grammar kind {kind!r}"
    except InvalidGrammar as e:
        return e.message
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors: RuntimeError and its subclasses
        return _clean(str(e))
    return None


def _clean(message: str) -> str:
    """xgrammar's C++ message without its "[hh:mm:ss] /path/file.cc:line: " prefix and the
    check that failed, which say nothing to the client."""
    text = message.strip()
    if text.startswith("["):
        _, _, text = text.partition("] ")
        head, sep, rest = text.partition(": ")
        if sep and (".cc:" in head or ".h:" in head):
            text = rest
    text = text.removeprefix("Check failed: (error.empty()) is false: ")
    return text[:500] or "the grammar is invalid"


def _check_depth(value: object) -> None:
    """Raises InvalidGrammar when `value` nests JSON containers past MAX_SCHEMA_DEPTH."""
    level: Sequence[object] = [value]
    for _ in range(MAX_SCHEMA_DEPTH):
        level = [
            child
            for v in level
            if isinstance(v, (dict, list))
            for child in (v.values() if isinstance(v, dict) else v)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return
    raise InvalidGrammar(f"the schema nests more than {MAX_SCHEMA_DEPTH} levels of objects and arrays")


def _bounded(text: str) -> str:
    if len(text) > MAX_GRAMMAR_BYTES or len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise InvalidGrammar(f"a grammar must be at most {MAX_GRAMMAR_BYTES} bytes")
    return text
