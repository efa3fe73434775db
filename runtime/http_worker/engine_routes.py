"""SGLang's engine-control routes: generation paused and continued, weights updated from disk
and read back by name. Each is one engine call (TokenizerManager.call) that the scheduler
answers between steps (runtime/scheduler/control.py), so a pause from any worker holds the one
engine every worker feeds. All need the API key."""

from __future__ import annotations

import base64

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from httpapi.engine_requests import parse_continue, parse_get_weights, parse_pause, parse_update_weights
from httpapi.errors import APIError
from runtime.http_worker.asgi import Handler, api_route, json_response, orjson_dumps, read_body

CONTROL_TIMEOUT_S = 30.0  # a pause, a continue, a weight read: the engine answers between two steps


def _failed(answer: dict, status: int = 400) -> APIError:
    return APIError(status, answer["message"], answer.get("param"))


@api_route
async def pause_generation(worker, request: Request) -> Response:
    mode = parse_pause(await read_body(request))
    answer = await worker.tm.call({"op": "pause", "mode": mode}, CONTROL_TIMEOUT_S)
    if not answer["success"]:
        raise _failed(answer)
    body = {"message": "Generation paused successfully.", "status": "ok", "mode": mode}
    return json_response(orjson_dumps({**body, "num_paused_requests": answer["num_paused_requests"]}))


@api_route
async def continue_generation(worker, request: Request) -> Response:
    parse_continue(await read_body(request))
    answer = await worker.tm.call({"op": "continue"}, CONTROL_TIMEOUT_S)
    if not answer["success"]:
        raise _failed(answer)
    return json_response(orjson_dumps({"message": "Generation continued successfully.", "status": "ok"}))


@api_route
async def update_weights_from_disk(worker, request: Request) -> Response:
    """SGLang's answer ({"success", "message", "num_paused_requests"}), 400 on failure with
    OpenAI's error object beside it, naming the field at fault."""
    req = parse_update_weights(await read_body(request))
    args = {
        "op": "update_weights",
        "model_path": req.model_path,
        "load_format": req.load_format,
        "abort_all_requests": req.abort_all_requests,
        "keep_pause": req.keep_pause,
    }
    answer = await worker.tm.call(args, worker.args.request_timeout)
    body = {"success": answer["success"], "message": answer["message"]}
    body["num_paused_requests"] = answer.get("num_paused_requests", 0)
    if not answer["success"]:
        return json_response(orjson_dumps({**body, **_failed(answer).as_dict()}), 400)
    return json_response(orjson_dumps(body))


@api_route
async def get_weights_by_name(worker, request: Request) -> Response:
    """The weight's first truncate_size rows as nested lists (a vector's values), as SGLang's."""
    req = parse_get_weights(await read_body(request), dict(request.query_params))
    answer = await worker.tm.call(
        {"op": "get_weights", "name": req.name, "truncate_size": req.truncate_size}, CONTROL_TIMEOUT_S
    )
    if not answer["success"]:
        raise _failed(answer)
    values = np.frombuffer(base64.b64decode(answer["values"]), np.float32).reshape(answer["shape"])
    return json_response(orjson_dumps(values))


ENGINE_ROUTES: dict[str, dict[str, Handler]] = {
    "/pause_generation": {"POST": pause_generation},
    "/continue_generation": {"POST": continue_generation},
    "/update_weights_from_disk": {"POST": update_weights_from_disk},
    "/get_weights_by_name": {"GET": get_weights_by_name, "POST": get_weights_by_name},
}
