"""The ASGI app object of a granian worker: route dispatch, the lifespan that starts the
worker's HTTPWorkerProcess, and the helpers every route shares (bodies, errors, the API key).
Every route answers APIError with its OpenAI-format body; anything else is a bug, logged,
and a 500. The app also answers CORS (vLLM's flags, off unless origins are listed: Cors) and echoes a
request's x-request-id, which the OpenAI routes take as the request's name (client_request_id)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gpu.models.model_files import ModelLoadError
from httpapi.auth import check_api_key
from httpapi.errors import APIError, bad_request, body_timeout, body_too_large, internal_error, model_not_found
from httpapi.request_fields import check_request_id
from runtime.config import ServerArgs
from runtime.http_worker.disconnect import take_due
from runtime.http_worker.main import start_http_worker
from runtime.http_worker.process import HTTPWorkerProcess
from runtime.http_worker.req_state import ClientGone
from runtime.http_worker.streaming import EventStream
from runtime.supervise.files import EngineStartError

logger = logging.getLogger("ringserve.app")

JSON = "application/json"
WORKER_HEADER = "x-ringserve-worker"  # which HTTP worker answered (its index)
MODEL_PATH = "/v1/models/"  # + a served name: its card (routed at start-up)
REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID_SCOPE = "ringserve.request_id"  # the request's valid x-request-id, in its ASGI scope

Reply = Response | EventStream  # what a route answers: a whole response or a stream of events
Handler = Callable[[Request], Awaitable[Reply]]


def json_response(body: bytes, status: int = 200) -> Response:
    return Response(body, status, media_type=JSON)


async def read_body(request: Request) -> bytes:
    """The request body, from receive() itself: one message for a usual body, where
    starlette's Request.body() runs an async generator a request (a visible share of the
    worker's Python time). A client that leaves before sending it all is gone (ClientGone).

    Bounded (ServerArgs): a body over max_request_bytes is a 413, told by its Content-Length
    before any of it is read (a chunked one as it arrives); a body not received whole within
    body_read_timeout seconds is a 408, so that clients that trickle bodies cannot hold the
    worker's requests (granian's backpressure counts them) for as long as they like."""
    args = request.app.worker.args
    limit = args.max_request_bytes
    for name, value in request.scope["headers"]:
        if name == b"content-length":
            if value.isdigit() and int(value) > limit:
                raise body_too_large(limit)
            break
    read = BodyRead(asyncio.current_task())
    reads = request.app.body_reads
    reads.watch(read, args.body_read_timeout)
    chunks, size = [], 0
    try:
        while True:
            if read.expired:
                raise body_timeout(args.body_read_timeout)
            read.reading = True
            message = await request.receive()
            read.reading = False
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    except asyncio.CancelledError:
        if not read.expired:
            raise
        if read.task is not None and hasattr(read.task, "uncancel"):  # 3.11+: the task is no longer being cancelled
            read.task.uncancel()
        raise body_timeout(args.body_read_timeout) from None
    finally:
        reads.reading.pop(read, None)


class BodyRead:
    """One body being read: cut off by cancelling its task, only while that waits in receive()
    (the cancellation is delivered there, and read_body answers it with the 408)."""

    __slots__ = ("task", "reading", "expired")

    def __init__(self, task: asyncio.Task | None) -> None:
        self.task, self.reading, self.expired = task, False, False

    def expire(self) -> None:
        self.expired = True
        if self.reading and self.task is not None:
            self.task.cancel()


class BodyReads:
    """A worker's bodies being read, oldest first, and one task that cuts off those read for
    longer than body_read_timeout (checking every quarter of it, at most every second, so within
    1.25 times it): a timer a request (call_later, and its cancel) costs several times the rest
    of read_body."""

    def __init__(self) -> None:
        self.reading: dict[BodyRead, float] = {}  # -> when its read began (time.monotonic)
        self._task: asyncio.Task | None = None

    def watch(self, read: BodyRead, timeout: float) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(timeout), name="body-read-timeouts")
        self.reading[read] = time.monotonic()

    async def _run(self, timeout: float) -> None:
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            for read in take_due(self.reading, timeout):
                read.expire()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


def error_response(err: APIError) -> Response:
    return json_response(err.body(), err.status)


def client_request_id(request: Request, body_id: str | None) -> str | None:
    """The client's name for its request: the x-request-id header (checked by the App), else
    the body's request_id; the header wins, as in vLLM."""
    return request.scope.get(REQUEST_ID_SCOPE) or body_id


# Every method a preflight may ask for with --allowed-methods * (what starlette's CORSMiddleware lists)
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
SAFELISTED_HEADERS = ("accept", "accept-language", "content-language", "content-type")
CORS_MAX_AGE_S = 600
EXPOSED_HEADERS = f"{REQUEST_ID_HEADER}, {WORKER_HEADER}"  # what a page's script may read


class Cors:
    """CORS as vLLM's CORSMiddleware (starlette's) does it, inline in the App: a preflight
    (OPTIONS with Origin and Access-Control-Request-Method) of an allowed origin, method and
    headers is a 200 with the Access-Control-* headers, else a 400; every other response to an
    allowed Origin gets access-control-allow-origin (`*`, or the origin and `vary: origin` when
    origins are listed or credentials allowed); a disallowed origin gets none, so the browser
    withholds the answer. With no origins allowed (the default) the App holds no Cors;
    else a request costs one look at the headers the App scans anyway, and a stream nothing a
    token (its headers go out once)."""

    def __init__(self, args: ServerArgs) -> None:
        self.any_origin = "*" in args.allowed_origins
        self.origins = frozenset(o.encode("latin-1") for o in args.allowed_origins)
        self.any_method = "*" in args.allowed_methods
        self.methods = frozenset(m.upper() for m in args.allowed_methods)
        self.any_header = "*" in args.allowed_headers
        self.headers = frozenset(h.lower() for h in args.allowed_headers) | frozenset(SAFELISTED_HEADERS)
        self.credentials = args.allow_credentials
        self.echo = not self.any_origin or self.credentials  # the origin itself, not "*"
        self.extra = [("access-control-expose-headers", EXPOSED_HEADERS)]
        if self.credentials:
            self.extra.append(("access-control-allow-credentials", "true"))
        methods = ALL_METHODS if self.any_method else sorted(self.methods)
        self.preflight_headers = [
            ("access-control-allow-methods", ", ".join(methods)),
            ("access-control-max-age", str(CORS_MAX_AGE_S)),
        ]

    @classmethod
    def of(cls, args: ServerArgs) -> Cors | None:
        return cls(args) if args.allowed_origins else None

    def allows(self, origin: bytes) -> bool:
        return self.any_origin or origin in self.origins

    def add_headers(self, response, origin: bytes) -> None:
        """A response's CORS headers (none for a disallowed origin)."""
        if not self.allows(origin):
            return
        headers = response.headers
        if self.echo:
            headers.append("access-control-allow-origin", origin.decode("latin-1"))
            headers.append("vary", "origin")
        else:
            headers.append("access-control-allow-origin", "*")
        for name, value in self.extra:
            headers.append(name, value)

    def preflight(self, origin: bytes, method: bytes, asked_headers: bytes | None) -> Response:
        """The answer to a preflight; its origin headers are add_headers'."""
        if not self.allows(origin):
            return error_response(bad_request(f"CORS: origin {origin.decode('latin-1')!r} is not allowed", "origin"))
        if not self.any_method and method.decode("latin-1").upper() not in self.methods:
            return error_response(
                bad_request(
                    f"CORS: method {method.decode('latin-1')!r} is not allowed", "access-control-request-method"
                )
            )
        asked = [h.strip() for h in (asked_headers or b"").decode("latin-1").split(",") if h.strip()]
        if not self.any_header and any(h.lower() not in self.headers for h in asked):
            return error_response(
                bad_request("CORS: a requested header is not allowed", "access-control-request-headers")
            )
        response = Response(b"OK", 200, media_type="text/plain")
        for name, value in self.preflight_headers:
            response.headers.append(name, value)
        allowed = ", ".join(asked) if self.any_header else ", ".join(sorted(self.headers))
        if allowed:
            response.headers.append("access-control-allow-headers", allowed)
        return response


def api_route(handler: Callable[..., Awaitable[Reply]], key_required: bool = True) -> Handler:
    """Checks the API key (probe_route: none), hands the route the worker's state, and turns
    APIError into its response; anything else raised is a bug: logged, answered with a 500."""

    @functools.wraps(handler)
    async def route(request: Request) -> Reply:
        worker = request.app.worker
        try:
            if key_required and worker.args.api_key is not None:  # else no header to read
                check_api_key(request.headers.get("authorization"), worker.args.api_key)
            response = await handler(worker, request)
        except APIError as err:
            response = error_response(err)
        except ClientGone:  # nobody reads the answer; the request was aborted
            response = Response(b"", 499)
        except Exception:
            logger.exception("%s %s failed", request.method, request.url.path)
            response = error_response(internal_error())
        response.headers.append(WORKER_HEADER, worker.index_header)
        return response

    return route


# Probes and scrapes answer without the API key, as SGLang's /health* and /metrics do (vLLM
# guards only /v1): a load balancer or Prometheus need not hold the key.
probe_route = functools.partial(api_route, key_required=False)


def orjson_dumps(obj) -> bytes:
    import orjson

    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


class App:
    """The ASGI app: a route is one dict lookup (path, then method) and its handler gets a
    starlette Request and returns a starlette Response; the lifespan is the app's own, so
    that a worker that cannot start says why in one line.

    No starlette application object: its two middlewares, router scan and exception wrapper
    cost a sizeable share of what the HTTP worker spends on a streamed request (a bare
    streaming app costs much more server CPU a request through Starlette() than dispatched
    like this: docs/perf-notes.md). Nothing of it is needed: api_route turns every error into
    its response, and unknown paths and methods are answered here, in OpenAI's error format."""

    def __init__(
        self,
        routes: dict[str, dict[str, Handler]],
        model_card: Handler,
        prefixes: dict[str, dict[str, dict[str, Handler]]] | None = None,
    ) -> None:
        """model_card: the route of GET /v1/models/<the served model's name, or a LoRA adapter's>; prefixes: routes of
        the paths under a prefix, looked up when no path matches whole: prefix -> what follows the
        name after it -> its routes (/v1/responses/ -> "/cancel" -> POST /v1/responses/<id>/cancel)."""
        self.routes: dict[str, dict[str, Handler]] = {}
        for path, methods in routes.items():
            self.add_route(path, methods)
        self.prefixes = {
            prefix: {tail: _with_head(methods) for tail, methods in tails.items()}
            for prefix, tails in (prefixes or {}).items()
        }
        self.model_card = model_card
        self.worker: HTTPWorkerProcess | None = None
        self.body_reads = BodyReads()
        self.cors: Cors | None = None  # from the worker's arguments, at start-up
        self.root_path = ""  # --root-path, at start-up

    def add_route(self, path: str, methods: dict[str, Handler]) -> None:
        self.routes[path] = _with_head(methods)

    def _prefixed(self, path: str) -> dict[str, Handler] | None:
        """The routes of a path under a prefix: <prefix><name><tail>, the name not empty; so that
        a method another tail takes is a 405 whose Allow lists only this path's methods."""
        for prefix, tails in self.prefixes.items():
            if path.startswith(prefix):
                name, slash, tail = path[len(prefix) :].partition("/")
                return tails.get(slash + tail) if name else None
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope["app"] = self  # what request.app returns
            origin = request_id = preflight = None
            for name, value in scope["headers"]:
                if name == b"x-request-id":
                    request_id = value
                elif name == b"origin":
                    origin = value
                elif name == b"access-control-request-method":
                    preflight = value
            cors = self.cors  # answers requests that carry an Origin
            if self.root_path and scope["path"].startswith(self.root_path + "/"):  # behind a proxy's prefix
                scope["path"] = scope["path"][len(self.root_path) :]
            methods = self.routes.get(scope["path"])
            if methods is None and self.prefixes:
                methods = self._prefixed(scope["path"])
            handler = None if methods is None else methods.get(scope["method"])
            if request_id is not None:
                request_id = self._request_id(scope, request_id)
            response: Reply
            if cors is not None and origin is not None and preflight is not None and scope["method"] == "OPTIONS":
                response = cors.preflight(origin, preflight, _header(scope, b"access-control-request-headers"))
            elif isinstance(request_id, Response):  # a bad x-request-id: 400
                response, request_id = request_id, None
            elif handler is not None:
                request = Request(scope, receive)
                try:
                    response = await handler(request)
                except Exception:  # api_route answers errors; this is a bug in a route outside it
                    logger.exception("%s %s failed", scope["method"], scope["path"])
                    response = error_response(internal_error())
            elif methods is None and scope["path"].startswith(MODEL_PATH) and scope["method"] in ("GET", "HEAD"):
                response = await self.model_card(Request(scope, receive))  # a LoRA adapter's card, else a 404
            elif methods is None and scope["path"].startswith(MODEL_PATH):  # another model's card
                response = error_response(model_not_found(scope["path"][len(MODEL_PATH) :]))
            elif methods is None:
                response = error_response(APIError(404, f"{scope['method']} {scope['path']}: Not Found"))
            else:
                response = error_response(APIError(405, f"{scope['method']} {scope['path']}: Method Not Allowed"))
                response.headers["allow"] = ", ".join(methods)
            if isinstance(request_id, str):
                response.headers.append(REQUEST_ID_HEADER, request_id)
            if cors is not None and origin is not None:
                cors.add_headers(response, origin)
            await response(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        else:  # a websocket: none is served
            await send({"type": "websocket.close"})

    @staticmethod
    def _request_id(scope, raw: bytes) -> str | Response:
        """A valid x-request-id, kept in the scope for the routes; else the 400 naming it."""
        try:
            request_id = check_request_id(raw.decode("latin-1"), REQUEST_ID_HEADER)
        except APIError as err:
            return error_response(err)
        scope[REQUEST_ID_SCOPE] = request_id
        return request_id

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.worker = await start_http_worker()
                except (EngineStartError, ModelLoadError) as e:
                    await send({"type": "lifespan.startup.failed", "message": f"ringserve: {e}"})
                    return
                except Exception as e:
                    logger.exception("the worker failed to start")
                    await send({"type": "lifespan.startup.failed", "message": f"ringserve: {e!r}"})
                    return
                for name in self.worker.served_names:  # LoRA adapters come and go: looked up when asked
                    self.add_route(MODEL_PATH + name, {"GET": self.model_card})
                self.cors = Cors.of(self.worker.args)
                self.root_path = self.worker.args.root_path or ""
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.body_reads.close()
                if self.worker is not None:
                    await self.worker.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _with_head(methods: dict[str, Handler]) -> dict[str, Handler]:
    """HEAD is answered where GET is."""
    return {**methods, **({"HEAD": methods["GET"]} if "GET" in methods else {})}


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None
