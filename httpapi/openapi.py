"""The OpenAPI 3.1 document of the routes a server answers (GET /openapi.json), read from the
server's own definitions rather than written beside them:

- which paths and methods: the route table the App dispatches on (the caller hands it in);
- each request body's fields: its parser run on example bodies under a FieldLog
  (httpapi/fields.py), which records every field the parser reads, with its type, default and
  the bounds or choices its getter checks; a field is required when the parser refuses an
  example without it, naming it. A field the parser reads raw (messages, prompt, tools, ...)
  and checks in its own code has no type in the document: any JSON, its 400 says what it takes;
- errors: APIError's body (httpapi/errors.py), on the statuses the routes answer.

A route the App answers that has no Operation here is documented as UNDESCRIBED (any JSON
body), so that the document never fails; tests/unit/test_openapi.py fails on it, so that a new
route is described when it is added."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from httpapi.chat_request import parse_batch_chat_completion, parse_chat_completion
from httpapi.decisions import parse_decisions
from httpapi.engine_requests import parse_continue, parse_get_weights, parse_pause, parse_update_weights
from httpapi.errors import APIError
from httpapi.fields import INT64_MAX, INT64_MIN, FieldLog, FieldRead
from httpapi.info import model_card, models_body
from httpapi.lora_requests import parse_load_lora, parse_unload_lora
from httpapi.pooling_requests import parse_embedding, parse_encode, parse_rerank, parse_score
from httpapi.requests import parse_abort, parse_completion, parse_detokenize, parse_generate, parse_tokenize
from httpapi.responses import ChoiceResult, Usage, chat_completion_body, completion_body, generate_body
from httpapi.responses_request import parse_responses_create

OPENAPI_VERSION = "3.1.0"
MODEL_CARD_PATH = "/v1/models/{model}"  # the App routes /v1/models/<name> for each served name
JSON, SSE = "application/json", "text/event-stream"
ERROR_SCHEMA_NAME = "Error"
MESSAGE = [{"role": "user", "content": "Say hi"}]


@dataclass(frozen=True)
class Operation:
    """One method of one path: what it does, how its body is read, what it answers.

    parse: the route's own body parser (None: the route reads no body); examples: bodies it
    takes, the first the smallest (the others reach nested objects, whose fields are read only
    when present); alternatives: each example is a form of its own, whose fields the parser
    reads only in that form (/tokenize's prompt or messages): the body is any of them;
    answers: the 200's media types (none: an empty body, as /health's, whose JSON while paused
    is left out: a client checks the status); streams: the 200 may be an SSE stream; public:
    answered without the API key (probes, scrapes, this document)."""

    summary: str
    parse: Callable[[bytes], object] | None = None
    examples: tuple[dict, ...] = ()
    alternatives: bool = False
    answers: tuple[str, ...] = (JSON,)
    streams: bool = False
    public: bool = False
    not_found: bool = False  # may answer 404 for what the path or body names (a model, a stored response)
    closed: bool = False  # a field the parser does not read is a 400 (vLLM's Decisions schema forbids extras)


CHAT = Operation(
    "OpenAI's chat completion",
    parse_chat_completion,
    (
        {"messages": MESSAGE, "max_tokens": 8},
        {
            "model": "any",
            "messages": MESSAGE,
            "max_tokens": 8,
            "stream": True,
            "stream_options": {"include_usage": True},
            "structured_outputs": {"regex": "hi"},
            "response_format": {"type": "text"},
        },
    ),
    streams=True,
    not_found=True,
)
COMPLETION = Operation(
    "OpenAI's (legacy) completion",
    parse_completion,
    ({"prompt": "Say hi", "max_tokens": 8}, {"prompt": [1, 2], "stream": True, "stream_options": {}}),
    streams=True,
    not_found=True,
)
GENERATE = Operation(
    "SGLang's native generation",
    parse_generate,
    (
        {"text": "Say hi", "sampling_params": {"max_new_tokens": 8}},
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8, "regex": "hi"}},
    ),
    streams=True,
    not_found=True,
)
TOKENIZE = Operation(
    "Text (or a chat, through its template) to token ids",
    parse_tokenize,
    ({"prompt": "Say hi"}, {"messages": MESSAGE}),
    alternatives=True,
    not_found=True,
)
DETOKENIZE = Operation("Token ids to text", parse_detokenize, ({"tokens": [1, 2]},), not_found=True)
MODEL_INFO = Operation("SGLang's model information")
SERVER_INFO = Operation("SGLang's server settings and engine state")
FLUSH_CACHE = Operation("Empties the prefix cache", answers=("text/plain",))
GET_WEIGHTS = Operation(
    "SGLang's: a weight's first rows (GET: name and truncate_size in the query)",
    lambda body: parse_get_weights(body, {}),
    ({"name": "lm_head.weight", "truncate_size": 2},),
)
RERANK = Operation(
    "vLLM's and Cohere's rerank: documents by relevance to the query",
    parse_rerank,
    ({"query": "hi", "documents": ["hello", "bye"]},),
    not_found=True,
)
LOAD_LORA = Operation(
    "Loads a LoRA adapter (the lora_path must exist on the server)",
    lambda body: parse_load_lora(body, "/load_lora_adapter"),
    ({"lora_name": "adapter1", "lora_path": "/adapters/adapter1"},),
)
UNLOAD_LORA = Operation(
    "Unloads a LoRA adapter",
    lambda body: parse_unload_lora(body, "/unload_lora_adapter"),
    ({"lora_name": "adapter1"},),
    not_found=True,
)
RESPONSE = Operation("A stored response (OpenAI's Responses API)", not_found=True)
UNDESCRIBED = Operation("Not described yet: its body is any JSON here", not_found=True)

# path -> method -> Operation, for every route the App answers; HEAD is answered wherever GET is
OPERATIONS: dict[str, dict[str, Operation]] = {
    "/v1/chat/completions": {"POST": CHAT},
    "/v1/chat/completions/batch": {
        "POST": Operation(
            "vLLM's batch of conversations, one choice each",
            parse_batch_chat_completion,
            ({"messages": [MESSAGE, MESSAGE], "max_tokens": 8},),
            not_found=True,
        )
    },
    "/invocations": {
        "POST": Operation(
            "SageMaker's: a chat (messages) or a completion (prompt), by the body's shape",
            lambda body: (parse_chat_completion if b'"messages"' in body else parse_completion)(body),
            CHAT.examples + COMPLETION.examples,
            alternatives=True,
            streams=True,
            not_found=True,
        )
    },
    "/v1/completions": {"POST": COMPLETION},
    "/v1/responses": {
        "POST": Operation(
            "OpenAI's Responses API: create a response",
            parse_responses_create,
            (
                {"input": "Say hi", "max_output_tokens": 8},
                {
                    "input": "Say hi",
                    "stream": True,
                    "stream_options": {},
                    "text": {"format": {"type": "text"}},
                    "reasoning": {"effort": "low"},
                    "metadata": {"k": "v"},
                },
            ),
            streams=True,
            not_found=True,
        )
    },
    "/v1/responses/{response_id}": {"GET": RESPONSE, "DELETE": Operation("Deletes a stored response", not_found=True)},
    "/v1/responses/{response_id}/input_items": {"GET": Operation("A stored response's input items", not_found=True)},
    "/v1/responses/{response_id}/cancel": {"POST": Operation("Cancels a background response", not_found=True)},
    "/v1/models": {"GET": Operation("The served model's names and LoRA adapters")},
    MODEL_CARD_PATH: {"GET": Operation("One served model or adapter", not_found=True)},
    "/v1/embeddings": {
        "POST": Operation(
            "OpenAI's embeddings", parse_embedding, ({"input": "hi"}, {"input": ["hi", "bye"]}), not_found=True
        )
    },
    "/encode": {"POST": Operation("SGLang's embeddings", parse_encode, ({"text": "hi"}, {"input_ids": [1, 2]}))},
    "/v1/score": {
        "POST": Operation(
            "SGLang's label-token scores, or vLLM's pair scores (text_1, text_2)",
            parse_score,
            ({"query": "hi", "items": ["a", "b"], "label_token_ids": [1, 2]}, {"text_1": "hi", "text_2": ["a"]}),
            alternatives=True,
            not_found=True,
        )
    },
    "/v1/decisions": {
        "POST": Operation(
            "vLLM's Decisions API: each question's answer probabilities, from its label tokens",
            parse_decisions,
            (
                {"input": "The screen is broken.", "questions": [{"type": "predicate", "instructions": "Broken?"}]},
                {
                    "model": "any",
                    "input": [{"role": "user", "content": [{"type": "input_text", "text": "The screen is broken."}]}],
                    "questions": [
                        {"type": "choice", "instructions": "Who?", "choices": [{"value": "returns"}, {"value": True}]},
                        {
                            "type": "score",
                            "name": "damage",
                            "instructions": "How bad?",
                            "levels": [{"label": "a"}, {"label": "b"}],
                        },
                    ],
                    "safety_identifier": "user-1",
                    "joint": False,
                },
            ),
            not_found=True,
            closed=True,
        )
    },
    "/v1/rerank": {"POST": RERANK},
    "/rerank": {"POST": RERANK},
    "/generate": {"POST": GENERATE, "PUT": GENERATE},
    "/tokenize": {"POST": TOKENIZE},
    "/v1/tokenize": {"POST": TOKENIZE},
    "/detokenize": {"POST": DETOKENIZE},
    "/v1/detokenize": {"POST": DETOKENIZE},
    "/get_model_info": {"GET": MODEL_INFO},
    "/model_info": {"GET": MODEL_INFO},
    "/get_server_info": {"GET": SERVER_INFO},
    "/server_info": {"GET": SERVER_INFO},
    "/flush_cache": {"GET": FLUSH_CACHE, "POST": FLUSH_CACHE},
    "/abort_request": {
        "POST": Operation("Aborts a request by its rid, or all", parse_abort, ({"rid": "r1"}, {"abort_all": True}))
    },
    "/get_load": {"GET": Operation("SGLang's load (sglang-router polls it)")},
    "/pause_generation": {"POST": Operation("Pauses the engine", parse_pause, ({"mode": "abort"},))},
    "/continue_generation": {"POST": Operation("Resumes a paused engine", parse_continue, ({},))},
    "/update_weights_from_disk": {
        "POST": Operation(
            "Loads new weights of the same architecture (the model_path must exist on the server)",
            parse_update_weights,
            ({"model_path": "/models/same-architecture"},),
        )
    },
    "/get_weights_by_name": {"GET": GET_WEIGHTS, "POST": GET_WEIGHTS},
    "/load_lora_adapter": {"POST": LOAD_LORA},
    "/v1/load_lora_adapter": {"POST": LOAD_LORA},
    "/unload_lora_adapter": {"POST": UNLOAD_LORA},
    "/v1/unload_lora_adapter": {"POST": UNLOAD_LORA},
    "/health": {"GET": Operation("Whether the engine is alive (while paused: a JSON status)", answers=(), public=True)},
    "/health_generate": {"GET": Operation("Whether one token goes through the whole engine", answers=(), public=True)},
    "/metrics": {"GET": Operation("Prometheus metrics", answers=("text/plain",), public=True)},
    "/openapi.json": {"GET": Operation("This document", public=True)},
    "/docs": {"GET": Operation("This document as a page (no external assets)", answers=("text/html",), public=True)},
}
# the name that follows each prefix the App routes by (/v1/responses/<id>/cancel: response_id);
# a served model's card, routed whole as /v1/models/<name>, is documented as MODEL_CARD_PATH
PREFIX_NAMES = {"/v1/responses/": "response_id"}


def documented_path(path: str) -> str:
    """The document's path of a route the App holds (a served model's card is the template's)."""
    return MODEL_CARD_PATH if path.startswith("/v1/models/") else path


def documented_routes(
    routes: Mapping[str, Collection[str]], prefixes: Mapping[str, Mapping[str, Collection[str]]]
) -> dict[str, Collection[str]]:
    """The App's routes (path -> methods) and its prefixes' (prefix -> what follows the name
    -> methods) as the document's paths -> methods."""
    out: dict[str, Collection[str]] = {documented_path(path): methods for path, methods in routes.items()}
    for prefix, tails in prefixes.items():
        for tail, methods in tails.items():
            out[f"{prefix}{{{PREFIX_NAMES[prefix]}}}{tail}"] = methods
    return out


def openapi_document(
    routes: Mapping[str, Collection[str]],
    prefixes: Mapping[str, Mapping[str, Collection[str]]],
    model_names: Collection[str],
    root_path: str = "",
    api_key: bool = False,
    version: str = "unknown",
) -> dict:
    """The document of the App's `routes` (path -> methods; HEAD is left out: it answers as GET)
    and its `prefixes`' (prefix -> what follows the name -> methods). model_names: the names
    /v1/models/{model} answers; root_path: --root-path, the document's server URL; api_key:
    whether routes need the key."""
    paths: dict[str, dict[str, Any]] = {}
    for path, methods in documented_routes(routes, prefixes).items():
        for method in methods:
            if method != "HEAD":
                paths.setdefault(path, {})[method.lower()] = _operation(path, method, api_key, model_names)
    document: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "ringserve",
            "version": version,
            "description": "An OpenAI-compatible LLM inference server (OpenAI's, vLLM's and SGLang's routes).",
        },
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": {ERROR_SCHEMA_NAME: error_schema()}},
    }
    if root_path:
        document["servers"] = [{"url": root_path}]
    if api_key:
        document["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    return document


def undescribed(
    routes: Mapping[str, Collection[str]], prefixes: Mapping[str, Mapping[str, Collection[str]]]
) -> list[str]:
    """The App's routes that have no Operation: each is a test failure."""
    return [
        f"{method} {path}"
        for path, methods in documented_routes(routes, prefixes).items()
        for method in methods
        if method != "HEAD" and method not in OPERATIONS.get(path, {})
    ]


def _operation(path: str, method: str, api_key: bool, model_names: Collection[str]) -> dict[str, Any]:
    op = OPERATIONS.get(path, {}).get(method, UNDESCRIBED)
    out: dict[str, Any] = {
        "summary": op.summary,
        "operationId": f"{method.lower()}{path.replace('/', '_').replace('{', '').replace('}', '').replace('.', '_')}",
        "responses": _responses(path, op, api_key and not op.public),
    }
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
        for name in _path_names(path)
    ]
    if path == MODEL_CARD_PATH and model_names:
        parameters[0]["examples"] = {name: {"value": name} for name in model_names}
    if parameters:
        out["parameters"] = parameters
    if op is UNDESCRIBED and method != "GET":
        out["requestBody"] = {"content": {JSON: {"schema": {}}}}
    if op.parse is not None and method != "GET":  # a GET's fields are in its query (get_weights_by_name)
        out["requestBody"] = {
            "required": not _takes_no_body(op.parse),
            "content": {
                JSON: {
                    "schema": {"anyOf": [body_schema(op.parse, (ex,)) for ex in op.examples]}
                    if op.alternatives
                    else body_schema(op.parse, op.examples, op.closed),
                    "examples": {f"example{i}": {"value": ex} for i, ex in enumerate(op.examples)},
                }
            },
        }
    if api_key and not op.public:
        out["security"] = [{"apiKey": []}]
    return out


def _path_names(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{")]


def _responses(path: str, op: Operation, keyed: bool) -> dict[str, Any]:
    ok: dict[str, Any] = {}
    for media in op.answers:
        ok[media] = {"schema": _answer_schema(path)} if media == JSON else {}
    if op.streams:
        ok[SSE] = {}
    responses: dict[str, Any] = {"200": {"description": "OK", **({"content": ok} if ok else {})}}
    error = {"$ref": f"#/components/schemas/{ERROR_SCHEMA_NAME}"}
    statuses = {"400": "A bad request: the error names the field (param)", "503": "The engine is not running"}
    if not op.public:
        statuses["408"] = "The body did not arrive in time"
        statuses["413"] = "The body is over the server's limit"
    if op.not_found or not op.public:
        statuses["404"] = "What the request names does not exist"
    if keyed:
        statuses["401"] = "A missing or wrong API key"
    for status, why in sorted(statuses.items()):
        responses[status] = {"description": why, "content": {JSON: {"schema": error}}}
    return responses


def _answer_samples() -> dict[str, tuple[Any, ...]]:
    """path -> the 200 answers (its forms) the routes' body functions of httpapi/ make of a plain
    choice that ran (no logprobs, tools or finish yet: what every answer has)."""
    choice = ChoiceResult(0, "hi", None, Usage(2, 1))
    chat = chat_completion_body("chatcmpl-1", 0, "m", [choice], 1)
    completion = completion_body("cmpl-1", 0, "m", [choice], 1)
    ran = ChoiceResult(0, "hi", None, Usage(2, 1), output_ids=[1])  # /generate's choices carry their ids
    generate = generate_body(["gen-1"], [ran], False), generate_body(["gen-1", "gen-2"], [ran, ran], True)
    return {
        "/v1/models": (models_body(("m",), 0, 1, ("adapter",)),),
        MODEL_CARD_PATH: (orjson.dumps(model_card("m", 0, 1, "m")),),
        "/v1/chat/completions": (chat,),
        "/v1/chat/completions/batch": (chat,),
        "/v1/completions": (completion,),
        "/invocations": (chat, completion),
        "/generate": generate,
    }


def _answer_schema(path: str) -> dict[str, Any]:
    """A 200's JSON, where the route's body functions make it from plain values (else any JSON)."""
    samples = _answer_samples().get(path, ())
    schemas = [schema_of(orjson.loads(sample)) for sample in samples]
    return {} if not schemas else schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def schema_of(value: Any) -> dict[str, Any]:
    """The JSON schema of one sample answer: its objects' keys required, the shape of its lists,
    its scalars' types (or null: a choice's content is null when it only calls tools); a null
    is any JSON, as the field holds another type when asked (logprobs, matched_stop, ...)."""
    if isinstance(value, dict):
        return {
            "type": "object",
            "properties": {k: schema_of(v) for k, v in value.items()},
            "required": list(value),
        }
    if isinstance(value, list):
        return {"type": "array", "items": schema_of(value[0]) if value else {}}
    if value is None:
        return {}
    return {"type": [{bool: "boolean", int: "integer", float: "number", str: "string"}[type(value)], "null"]}


def error_schema() -> dict[str, Any]:
    """APIError's body (OpenAI's error format): its keys, message and type strings, param and code nullable."""
    keys = APIError(400, "").as_dict()["error"]
    text = {"type": "string"}
    nullable = {"type": ["string", "null"]}
    properties = {k: text if k in ("message", "type") else nullable for k in keys}
    return {
        "type": "object",
        "properties": {"error": {"type": "object", "properties": properties, "required": list(keys)}},
        "required": ["error"],
    }


# ---------------------------------------------------------------- request bodies from their parsers


def body_schema(parse: Callable[[bytes], object], examples: tuple[dict, ...], closed: bool = False) -> dict[str, Any]:
    """The schema of the body `parse` reads: every field it reads on `examples` (nested ones
    where an example has their object), and as required the fields every example has that the
    parser refuses an example without, naming them. `closed`: no other top-level field."""
    log = FieldLog()
    with log:
        outcomes = [_outcome(parse, example) for example in examples]
    required = [
        key
        for key in examples[0]
        if all(key in ex and _needs(parse, ex, outcome, key) for ex, outcome in zip(examples, outcomes))
    ]
    schema = _object_schema(log.fields, "")
    if required:
        schema["required"] = required
    if closed:
        schema["additionalProperties"] = False
    return schema


def _outcome(parse: Callable[[bytes], object], body: dict) -> tuple:
    """() when `parse` takes `body`, else its error's (param, message)."""
    try:
        parse(orjson.dumps(body))
    except APIError as err:
        return (err.param, err.message)
    return ()


def _takes_no_body(parse: Callable[[bytes], object]) -> bool:
    """Whether the parser takes an empty body (/continue_generation's): the body is optional."""
    try:
        parse(b"")
    except APIError:
        return False
    return True


def _needs(parse: Callable[[bytes], object], example: dict, outcome: tuple, key: str) -> bool:
    """Whether `parse` refuses `example` without `key`, naming it, where it answered the whole
    example otherwise (an example may fail later, on what only the server can check)."""
    dropped = _outcome(parse, {k: v for k, v in example.items() if k != key})
    return bool(dropped) and dropped[0] == key and dropped != outcome


def _object_schema(fields: Mapping[str, FieldRead], prefix: str) -> dict[str, Any]:
    """The fields named `prefix` + a name (no further dot or bracket) as an object's properties;
    an object field's own fields nest inside it. Unknown fields are allowed: they are ignored
    with a warning, as vLLM does."""
    properties: dict[str, Any] = {}
    for param, read in fields.items():
        name = param[len(prefix) :]
        if not param.startswith(prefix) or "." in name or "[" in name:
            continue
        schema = _field_schema(read)
        nested = _object_schema(fields, param + ".") if read.kind in ("object", "any") else {}
        if nested.get("properties"):  # read raw (/generate's sampling_params: an object or a list): not an object
            schema = {"anyOf": [nested, {"type": "null"} if read.kind == "object" else {"not": {"type": "object"}}]}
        properties[name] = schema
    return {"type": "object", "properties": dict(sorted(properties.items()))}


def _field_schema(read: FieldRead) -> dict[str, Any]:
    """One field's schema; JSON null reads as unset wherever a field is typed (fields.py)."""
    kind = read.kind
    if kind == "any":
        return {}
    if kind == "strings":
        return {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]}
    if kind == "token_ids":
        return {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}}
    schema: dict[str, Any] = {"type": [kind, "null"]}
    if kind == "integer":
        schema["minimum"] = read.minimum if read.minimum is not None else INT64_MIN
        schema["maximum"] = read.maximum if read.maximum is not None else INT64_MAX
    elif kind == "number" and read.minimum is not None:
        schema["minimum"], schema["maximum"] = read.minimum, read.maximum
    if read.choices:
        schema["enum"] = [*read.choices, None]
    if read.default is not None and type(read.default) in (bool, int, float, str):
        schema["default"] = read.default
    return schema
