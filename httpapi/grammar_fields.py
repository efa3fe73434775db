"""The grammar a request asks for, from OpenAI's and vLLM's fields (response_format,
structured_outputs, guided_*, a forced tool call): at most one source a request."""

from __future__ import annotations

from typing import Any

from httpapi.errors import bad_request
from httpapi.fields import Fields
from httpapi.request_fields import REFUSED_OPENAI, refuse_unserved, shown
from protocol.sampling_params import GrammarKind
from structured.grammars import (
    JSON_OBJECT_SCHEMA,
    InvalidGrammar,
    choice_grammar,
    json_schema_text,
    structural_tag_text,
)

GUIDED_BACKENDS = ("auto", "xgrammar")  # guided_decoding_backend values this server serves


def grammar_text(value: Any) -> str:
    if type(value) is not str or not value:
        raise InvalidGrammar("it must be a non-empty string")
    return value


# SGLang's grammar fields on its OpenAI routes' top level and in /generate's sampling_params
# (where structural_tag joins them; on the OpenAI routes it is vLLM's field too)
SGLANG_GRAMMARS = (
    ("json_schema", GrammarKind.JSON_SCHEMA, json_schema_text),
    ("regex", GrammarKind.REGEX, grammar_text),
    ("ebnf", GrammarKind.EBNF, grammar_text),
)


def read_grammar(f: Fields, names: dict[str, str], forced: str | None = None) -> dict[str, Any]:
    """The grammar OpenAI's and vLLM's fields ask for, as read_sampling's grammar_kind and
    grammar (none: {}); at most one source. `forced`: a forced tool call's schema. Sets
    names["grammar"] to its field, and names["compact_json"] to the field that demands JSON
    without whitespace, if one does."""
    candidates: list[tuple[str, GrammarKind, Any]] = []
    if forced is not None:
        candidates.append(("tools", GrammarKind.JSON_SCHEMA, lambda: json_schema_text(forced)))
    candidates += _response_format(f)
    candidates += structured_outputs(f, names)
    candidates += _guided(f, ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag"))
    candidates += [  # SGLang's, on its OpenAI routes as in /generate's sampling_params
        (f.param(key), kind, lambda read=read, value=value: read(value))
        for key, kind, read in SGLANG_GRAMMARS
        if (value := f.raw(key)) is not None
    ]
    backend = f.get_str("guided_decoding_backend")
    if backend is not None and backend not in GUIDED_BACKENDS:
        raise bad_request(
            f"guided_decoding_backend {backend!r} is not served: this server's grammars are xgrammar's "
            f"(one of {list(GUIDED_BACKENDS)})",
            "guided_decoding_backend",
        )
    return one_grammar(candidates, names)


def structured_outputs(f: Fields, names: dict[str, str]) -> list[tuple[str, GrammarKind, Any]]:
    """vLLM's structured_outputs object (chat, completions and the Responses API take it)."""
    so = f.get_object("structured_outputs")
    if so is None:
        return []
    candidates = _guided(so, ("json", "regex", "choice", "grammar", "structural_tag"))
    if so.get_bool("json_object", False):
        candidates.append((so.param("json_object"), GrammarKind.JSON_SCHEMA, lambda: JSON_OBJECT_SCHEMA))
    if so.get_bool("disable_any_whitespace", False):
        names["compact_json"] = so.param("disable_any_whitespace")
    so.get_bool("disable_additional_properties", False)  # xgrammar's strict mode refuses them already
    so.get_bool("disable_fallback", False)  # one backend: nothing to fall back to
    refuse_unserved(so, {"whitespace_pattern": REFUSED_OPENAI["guided_whitespace_pattern"]})
    so.warn_unknown("structured_outputs")
    return candidates


def _guided(f: Fields, keys: tuple[str, ...]) -> list[tuple[str, GrammarKind, Any]]:
    """vLLM's grammar fields (json, regex, choice, grammar, structural_tag, or their guided_
    names) that `f` has."""
    kinds = {
        "json": (GrammarKind.JSON_SCHEMA, json_schema_text),
        "regex": (GrammarKind.REGEX, grammar_text),
        "choice": (GrammarKind.EBNF, choice_grammar),
        "grammar": (GrammarKind.EBNF, grammar_text),
        "structural_tag": (GrammarKind.STRUCTURAL_TAG, structural_tag_text),
    }
    found = []
    for key in keys:
        value = f.raw(key)
        if value is not None:
            kind, read = kinds[key.removeprefix("guided_")]
            found.append((f.param(key), kind, lambda read=read, value=value: read(value)))
    return found


def _response_format(f: Fields) -> list[tuple[str, GrammarKind, Any]]:
    rf = f.get_object("response_format")
    if rf is None:
        return []
    kind = rf.get_str("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", GrammarKind.JSON_SCHEMA, lambda: JSON_OBJECT_SCHEMA)]
    if kind == "json_schema":
        js = rf.get_object("json_schema")
        if js is None:
            raise bad_request(
                'response_format.json_schema must be provided when its type is "json_schema": {"name", "schema"}',
                "response_format.json_schema",
            )
        return json_schema_format(js, "response_format")
    if kind == "structural_tag":
        rf.ignore(*rf.obj)
        return [("response_format", GrammarKind.STRUCTURAL_TAG, lambda: structural_tag_text(rf.obj))]
    raise bad_request(
        f"response_format.type must be one of text, json_object, json_schema and structural_tag, not {shown(kind)}",
        "response_format.type",
    )


def json_schema_format(fmt: Fields, label: str) -> list[tuple[str, GrammarKind, Any]]:
    """A json_schema format's {"name", "description", "strict", "schema"} (chat's
    response_format.json_schema, the Responses API's flat text.format): its schema is the
    grammar. `label` names it in the unknown-fields warning."""
    if not fmt.get_str("name"):
        raise bad_request(f"{fmt.param('name')} is required", fmt.param("name"))
    fmt.get_str("description")
    fmt.get_bool("strict", False)
    schema, param = fmt.raw("schema"), fmt.param("schema")
    if type(schema) is not dict:
        raise bad_request(f"{param} must be a JSON schema object", param)
    fmt.warn_unknown(label)
    return [(param, GrammarKind.JSON_SCHEMA, lambda: json_schema_text(schema))]


def one_grammar(candidates: list[tuple[str, GrammarKind, Any]], names: dict[str, str]) -> dict[str, Any]:
    """The one grammar of `candidates` ((field, kind, its text's maker)) as read_sampling's values;
    a second is a 400 naming it, a text that cannot be a grammar one naming its field."""
    if not candidates:
        return {}
    (param, kind, make), *others = candidates
    if others:
        raise bad_request(f"{others[0][0]}: a request may ask for one grammar, and {param} asks for one", others[0][0])
    try:
        text = make()
    except InvalidGrammar as e:
        raise bad_request(f"{param} is not a valid grammar: {e.message}", param) from None
    names["grammar"] = param
    return {"grammar_kind": kind, "grammar": text}
