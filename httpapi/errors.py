"""The one exception the HTTP layer raises, and its OpenAI-format body.

Statuses and types (OpenAI's own choices, so OpenAI clients map them to the right
exception class):
  400 invalid_request_error  malformed JSON, wrong types, out-of-range values, empty or
                             over-long prompts (code context_length_exceeded), max_tokens
                             past the context, unsupported features
  401 invalid_request_error  code invalid_api_key: missing or wrong API key
  408 invalid_request_error  code request_timeout: the body did not arrive within the server's limit
  413 invalid_request_error  code request_too_large: the body is over the server's limit
  404 invalid_request_error  code model_not_found, param "model": an unknown model
                             (OpenAI's shape; vLLM answers type "NotFoundError" instead)
  503 server_error           code engine_unavailable: the engine is down or stopping
  500 server_error           code internal_error: a bug, never the client's input
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson

from protocol.records import GRAMMAR_ERROR_PREFIX, ErrorCode
from protocol.sampling_params import InvalidParam


class APIError(Exception):
    """An error the routes turn into `status` with body() as JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def fresh(self) -> APIError:
        """The same error as a new instance, for one more raise of an error kept and raised
        again (an engine that is gone): each raise of one instance prepends the raiser's
        frames to its __traceback__, which keeps them, and all they refer to, alive, so a
        kept instance grows by every request it fails (tens of MB in a 503 storm)."""
        return APIError(self.status, self.message, self.param, self.type, self.code)

    def as_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body(self) -> bytes:
        return orjson.dumps(self.as_dict())

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r}, code={self.code!r})"


def bad_request(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code=code)


def from_invalid_param(err: InvalidParam, names: Mapping[str, str]) -> APIError:
    """SamplingParams.validate() names parameters as the OpenAI API spells them; `names`
    renames them to this endpoint's fields (e.g. max_tokens -> sampling_params.max_new_tokens)."""
    param = names.get(err.param, err.param)
    message = err.message.replace(err.param, param, 1) if param != err.param else err.message
    return bad_request(message, param)


def body_too_large(limit: int) -> APIError:
    return APIError(
        413, f"The request body is larger than this server's limit of {limit} bytes.", code="request_too_large"
    )


def body_timeout(seconds: float) -> APIError:
    return APIError(
        408, f"The request body was not received within this server's limit of {seconds:g} s.", code="request_timeout"
    )


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "model", code="model_not_found")


def unauthorized() -> APIError:
    return APIError(
        401, "Invalid or missing API key: send the header `Authorization: Bearer <key>`.", code="invalid_api_key"
    )


def engine_unavailable(message: str = "The inference engine is not running.") -> APIError:
    return APIError(503, message, type="server_error", code="engine_unavailable")


def internal_error() -> APIError:
    return APIError(500, "Internal server error.", type="server_error", code="internal_error")


def engine_error(code: int, message: str, grammar_param: str | None = None) -> APIError:
    """The APIError of a request the engine ended with an ERROR record; `grammar_param`: the
    field of the request's grammar, which a grammar error (the scheduler's "grammar: ...") names."""
    if code == ErrorCode.INVALID_REQUEST and grammar_param and message.startswith(GRAMMAR_ERROR_PREFIX):
        return bad_request(f"{grammar_param}: {message.removeprefix(GRAMMAR_ERROR_PREFIX)}", grammar_param)
    if code in (ErrorCode.PROMPT_TOO_LONG, ErrorCode.INVALID_REQUEST):
        return bad_request(
            message or "The engine rejected the request.",
            None,
            code="context_length_exceeded" if code == ErrorCode.PROMPT_TOO_LONG else None,
        )
    if code == ErrorCode.OVERLOADED:
        return engine_unavailable(message or "The engine is overloaded; retry later.")
    return APIError(500, message or "The engine failed the request.", type="server_error", code="internal_error")
