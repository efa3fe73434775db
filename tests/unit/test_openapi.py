"""The OpenAPI document (httpapi/openapi.py) is read from the server's own definitions: the
App's route table, and each body's parser run under a FieldLog. These tests hold it to them:
it is a valid OpenAPI 3.1 document, it lists exactly the routes the App answers, a field a
parser learns appears in it with its type and bounds, and its examples are bodies the parsers
take. tests/server/test_openapi_server.py fuzzes a running server against it."""

from __future__ import annotations

import jsonschema
import orjson
import pytest
from openapi_spec_validator import validate

from httpapi import requests as completion_requests
from httpapi.errors import APIError, bad_request
from httpapi.fields import FieldLog, Fields, load_object
from httpapi.openapi import (
    MODEL_CARD_PATH,
    OPERATIONS,
    PREFIX_NAMES,
    body_schema,
    documented_path,
    openapi_document,
    undescribed,
)
from httpapi.openapi_page import docs_page
from httpapi.pooling_requests import parse_rerank
from httpapi.responses import ChoiceResult, Usage, chat_completion_body
from protocol.sampling_params import FLOAT_RANGES, InvalidParam, SamplingParams
from runtime.app import app
from runtime.http_worker.asgi import MODEL_PATH

SERVED = ("SmolLM2-135M-Instruct", "alias")
# routes whose example names a path that must exist on the server, which the parser checks
NAMES_A_SERVER_PATH = ("/update_weights_from_disk", "/load_lora_adapter", "/v1/load_lora_adapter")


def app_routes() -> dict[str, tuple[str, ...]]:
    """The App's routes once a worker started: its table plus each served name's card."""
    routes = {path: tuple(methods) for path, methods in app.routes.items()}
    for name in SERVED:
        routes[MODEL_PATH + name] = ("GET", "HEAD")
    return routes


def document(**kwargs) -> dict:
    return openapi_document(app_routes(), app.prefixes, SERVED, **kwargs)


def body_of(doc: dict, path: str, method: str = "post") -> dict:
    return doc["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]


@pytest.mark.parametrize("kwargs", [{}, {"root_path": "/api", "api_key": True}])
def test_document_is_valid_openapi_3_1(kwargs):
    doc = document(**kwargs)
    validate(doc)
    assert doc["openapi"].startswith("3.1")
    assert ("servers" in doc) == ("root_path" in kwargs)
    keyed = doc["paths"]["/v1/chat/completions"]["post"]
    assert ("security" in keyed) == ("api_key" in kwargs)
    assert "security" not in doc["paths"]["/health"]["get"]  # probes and the document: public


def test_every_route_the_app_answers_is_documented_and_nothing_else():
    doc = document()
    answered = {
        (documented_path(path), method.lower())
        for path, methods in app_routes().items()
        for method in methods
        if method != "HEAD"  # answered wherever GET is, as GET
    }
    for prefix, tails in app.prefixes.items():  # /v1/responses/<id>/cancel ...
        for tail, methods in tails.items():
            path = f"{prefix}{{{PREFIX_NAMES[prefix]}}}{tail}"
            answered |= {(path, method.lower()) for method in methods if method != "HEAD"}
    documented = {(path, method) for path, methods in doc["paths"].items() for method in methods}
    assert documented == answered
    assert {MODEL_CARD_PATH, "/v1/responses/{response_id}/cancel"} <= set(doc["paths"])
    assert set(OPERATIONS) == {path for path, _ in answered}  # no description of a route nobody answers


def test_a_prefixed_path_takes_only_its_own_methods():
    """Found by the fuzzing: /v1/responses/<id>/cancel answered OPTIONS with a 405 whose Allow
    listed GET and DELETE, the methods of /v1/responses/<id>, which the document does not give it."""
    assert set(app._prefixed("/v1/responses/resp_1/cancel")) == {"POST"}
    assert set(app._prefixed("/v1/responses/resp_1")) == {"GET", "HEAD", "DELETE"}
    assert set(app._prefixed("/v1/responses/resp_1/input_items")) == {"GET", "HEAD"}
    assert app._prefixed("/v1/responses/resp_1/other") is None  # a 404
    assert app._prefixed("/v1/responses//cancel") is None  # no id: a 404


def test_every_route_is_described():
    """A route added to the App without an Operation in httpapi/openapi.py: described here."""
    assert undescribed(app_routes(), app.prefixes) == []


def test_a_route_without_a_description_is_still_documented():
    doc = openapi_document({**app_routes(), "/v1/new_route": ("POST",)}, {}, SERVED)
    validate(doc)
    assert doc["paths"]["/v1/new_route"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {}
    assert undescribed({"/v1/new_route": ("POST", "HEAD")}, {}) == ["POST /v1/new_route"]


def test_a_field_a_parser_learns_appears_in_the_document(monkeypatch):
    """A parser reading one more field (here /v1/completions') puts it in the document, with
    the type, bounds and choices its getters check."""
    before = body_of(document(), "/v1/completions")["properties"]
    assert "new_knob" not in before
    read_truncation = completion_requests.read_truncation

    def learned(f: Fields):
        f.get_int("new_knob", 4, minimum=1, maximum=9)
        f.get_str("new_mode", choices=("fast", "exact"))
        return read_truncation(f)

    monkeypatch.setattr(completion_requests, "read_truncation", learned)
    after = body_of(document(), "/v1/completions")["properties"]
    assert after["new_knob"] == {"type": ["integer", "null"], "minimum": 1, "maximum": 9, "default": 4}
    assert after["new_mode"]["enum"] == ["fast", "exact", None]
    assert set(after) - set(before) == {"new_knob", "new_mode"}


def test_fields_types_bounds_defaults_and_required_come_from_the_parsers():
    doc = document()
    chat = body_of(doc, "/v1/chat/completions")
    assert chat["required"] == ["messages"]
    props = chat["properties"]
    assert props["n"] == {"type": ["integer", "null"], "minimum": 1, "maximum": 128, "default": 1}
    assert props["temperature"]["type"] == ["number", "null"]
    assert props["stream"]["default"] is False
    assert "none" in props["reasoning_effort"]["enum"]
    assert props["stop"]["anyOf"][1] == {"type": "array", "items": {"type": "string"}}
    assert props["messages"] == {}  # read raw, its shape checked by read_messages: any JSON here
    assert "use_beam_search" in props or "best_of" in props  # refused fields are named, so a client sees them
    nested = props["stream_options"]["anyOf"][0]["properties"]  # read where an example has the object
    assert {"include_usage", "continuous_usage_stats"} <= set(nested)
    assert "required" not in body_of(doc, "/generate")  # text or input_ids: neither alone
    assert body_of(doc, "/v1/embeddings")["properties"]["encoding_format"]["enum"] == ["float", "base64", None]
    assert body_of(doc, "/v1/responses")["required"] == ["input"]
    prompt_form, chat_form = body_of(doc, "/tokenize")["anyOf"]  # alternatives: each form reads its own fields
    assert prompt_form["required"] == ["prompt"] and "reasoning_effort" not in prompt_form["properties"]
    assert "reasoning_effort" in chat_form["properties"]
    assert "requestBody" not in doc["paths"]["/get_weights_by_name"]["get"]  # its fields are its query's
    # found by the fuzzing: /continue_generation takes no body, where the document required one
    assert doc["paths"]["/continue_generation"]["post"]["requestBody"]["required"] is False
    assert doc["paths"]["/v1/completions"]["post"]["requestBody"]["required"] is True


def test_sampling_ranges_are_validates_own():
    """The float ranges the document shows are the ones SamplingParams.validate() checks: each
    edge is taken, a step past it refused, naming the parameter (/generate: renamed)."""
    for name, (low, high) in FLOAT_RANGES.items():
        for value in (low, high):
            SamplingParams(**{name: value}).validate()
        for value in (low - 1e-6, high + 1e-6):
            with pytest.raises(InvalidParam) as err:
                SamplingParams(**{name: value}).validate()
            assert err.value.param == name
    doc = document()
    assert body_of(doc, "/v1/chat/completions")["properties"]["temperature"]["maximum"] == 2.0
    sampling = body_of(doc, "/generate")["properties"]["sampling_params"]["anyOf"][0]["properties"]
    assert (sampling["repetition_penalty"]["minimum"], sampling["repetition_penalty"]["maximum"]) == (0.01, 2.0)


def test_answers_are_described_by_the_routes_body_functions():
    """A 200's schema is read from the body the route's function makes: an answer with more
    (logprobs, token ids, a finish) matches it, one without a key every answer has does not."""
    doc = document()
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert {"id", "choices", "usage", "model"} <= set(chat["required"])
    answer = orjson.loads(
        chat_completion_body("chatcmpl-1", 5, "m", [ChoiceResult(0, "", "stop", Usage(3, 2), output_ids=[7])], 1)
    )
    answer["choices"][0]["message"]["content"] = None  # a choice that only called tools
    jsonschema.validate(answer, chat)
    del answer["usage"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(answer, chat)
    generate = doc["paths"]["/generate"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert len(generate["anyOf"]) == 2  # one output, or a list of them (a batch, n > 1)


def test_errors_are_openai_shaped_on_every_operation():
    doc = document(api_key=True)
    error = doc["components"]["schemas"]["Error"]
    assert error["properties"]["error"]["required"] == list(APIError(400, "").as_dict()["error"])
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            assert "400" in op["responses"] and "503" in op["responses"], (path, method)
            assert ("401" in op["responses"]) == ("security" in op), (path, method)


def test_every_example_is_a_body_its_parser_takes():
    for path, methods in OPERATIONS.items():
        for method, op in methods.items():
            if op.parse is None or path in NAMES_A_SERVER_PATH:
                continue
            for example in op.examples:
                try:
                    op.parse(orjson.dumps(example))
                except APIError as err:
                    pytest.fail(f"{method} {path}: its example {example} is refused: {err!r}")


def test_fields_log_only_inside_a_field_log():
    assert type(Fields({})) is Fields  # serving: no logging
    with FieldLog() as log:
        f = Fields({"a": 1, "b": {"c": "x"}})
        f.get_int("a", minimum=0)
        f.get_object("b").get_str("c")
        f.raw("d")
    assert {k: r.kind for k, r in log.fields.items()} == {"a": "integer", "b": "object", "b.c": "string", "d": "any"}
    assert type(Fields({})) is Fields


@pytest.mark.parametrize(
    "read, message",
    [
        (lambda f: f.get_int("n", 1, minimum=1, maximum=128), "n must be between 1 and 128, not 0"),
        (lambda f: f.get_int("n", minimum=1), "n must be at least 1, not 0"),
        (lambda f: f.get_str("mode", choices=("a", "b")), "mode must be one of ['a', 'b'], not 'c'"),
    ],
)
def test_bounds_and_choices_are_checked_as_the_document_says(read, message):
    f = Fields({"n": 0, "mode": "c"})
    with pytest.raises(APIError) as err:
        read(f)
    assert err.value.status == 400 and err.value.message == message and err.value.param in ("n", "mode")


def test_integers_past_64_bits_are_refused_as_the_document_bounds_them():
    """Found by the fuzzing: orjson reads 2**63 .. 2**64 - 1 as an int, which every integer field
    took (top_n, max_tool_calls, top_logprobs_num, ...) where the document says 64-bit signed."""
    for value in (2**63, 2**64 - 1, -(2**63) - 1):
        with pytest.raises(APIError) as err:
            parse_rerank(b'{"query": "q", "documents": ["d"], "top_n": %d}' % value)
        assert err.value.param == "top_n" and "64-bit" in err.value.message
    assert parse_rerank(orjson.dumps({"query": "q", "documents": ["d"], "top_n": 2**63 - 1})).top_n == 2**63 - 1
    top_n = body_of(document(), "/v1/rerank")["properties"]["top_n"]
    assert (top_n["minimum"], top_n["maximum"]) == (1, 2**63 - 1)


def test_body_schema_of_a_parser():
    def parse(body: bytes) -> None:
        f = Fields(load_object(body))
        if f.get_str("name") is None:
            raise bad_request("name is required", "name")
        f.get_bool("flag", True)

    schema = body_schema(parse, ({"name": "x"},))
    assert schema["required"] == ["name"]
    assert schema["properties"]["flag"] == {"type": ["boolean", "null"], "default": True}


def test_docs_page_needs_nothing_else():
    doc = document(root_path="/api")
    page = docs_page(doc, "/api/openapi.json").decode()
    assert "<script" not in page and "http://" not in page and "https://" not in page
    assert "href='/api/openapi.json'" in page
    for path in doc["paths"]:
        assert path.replace("{", "&#x7b;") in page or path in page
