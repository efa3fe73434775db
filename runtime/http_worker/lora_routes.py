"""LoRA adapters loaded and unloaded at run time: SGLang's /load_lora_adapter and
/unload_lora_adapter ({"success", "error_message", "loaded_adapters"}; a failure is a 400 with
OpenAI's error object beside), vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (a
text answer; a failure is OpenAI's error object). Each is one engine call that the scheduler
answers (runtime/scheduler/control.py), which assigns the adapter's id and publishes it to
every worker before it answers. An unload is answered once the requests that named the
adapter before it have ended. All need the API key."""

from __future__ import annotations

from collections.abc import Awaitable

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from httpapi.errors import APIError, bad_request
from httpapi.lora_requests import parse_load_lora, parse_unload_lora
from runtime.http_worker.asgi import Handler, api_route, json_response, orjson_dumps, read_body


async def _load(worker, request: Request, endpoint: str) -> dict:
    """The scheduler's answer to a load; APIError for a request refused before it."""
    req = parse_load_lora(await read_body(request), endpoint, worker.args.lora_allowed_dirs)
    if req.name in worker.served_names:
        raise bad_request(f"lora_name {req.name!r} is the served model's name", "lora_name")
    call = {"op": "load_lora", "name": req.name, "path": req.path, "pinned": req.pinned}
    return await worker.tm.call(call, worker.args.request_timeout)


async def _unload(worker, request: Request, endpoint: str) -> dict:
    name = parse_unload_lora(await read_body(request), endpoint)
    return await worker.tm.call({"op": "unload_lora", "name": name}, worker.args.request_timeout)


def _error(answer: dict) -> APIError:
    return APIError(answer.get("status", 400), answer["message"], answer.get("param"))


async def _sglang(call: Awaitable[dict]) -> Response:
    """SGLang's body; a failure, refused here or by the engine, with OpenAI's error object beside it."""
    try:
        answer = await call
        if not answer["success"]:
            raise _error(answer)
    except APIError as err:
        body = {"success": False, "error_message": err.message, "loaded_adapters": None, **err.as_dict()}
        return json_response(orjson_dumps(body), err.status)
    return json_response(
        orjson_dumps({"success": True, "error_message": None, "loaded_adapters": answer["loaded_adapters"]})
    )


def _vllm(answer: dict) -> Response:
    if not answer["success"]:
        raise _error(answer)
    return PlainTextResponse(answer["message"])


@api_route
async def load_lora_adapter(worker, request: Request) -> Response:
    return await _sglang(_load(worker, request, "/load_lora_adapter"))


@api_route
async def unload_lora_adapter(worker, request: Request) -> Response:
    return await _sglang(_unload(worker, request, "/unload_lora_adapter"))


@api_route
async def v1_load_lora_adapter(worker, request: Request) -> Response:
    return _vllm(await _load(worker, request, "/v1/load_lora_adapter"))


@api_route
async def v1_unload_lora_adapter(worker, request: Request) -> Response:
    return _vllm(await _unload(worker, request, "/v1/unload_lora_adapter"))


LORA_ROUTES: dict[str, dict[str, Handler]] = {
    "/load_lora_adapter": {"POST": load_lora_adapter},
    "/unload_lora_adapter": {"POST": unload_lora_adapter},
    "/v1/load_lora_adapter": {"POST": v1_load_lora_adapter},
    "/v1/unload_lora_adapter": {"POST": v1_unload_lora_adapter},
}
