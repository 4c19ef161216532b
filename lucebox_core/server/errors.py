"""Errors as the APIs send them.

OpenAI clients expect `{"error": {"message", "type", "param", "code"}}`; Anthropic clients (on
`/v1/messages`) expect `{"type": "error", "error": {"type", "message"}}`. Every failure a request can
cause, including Litestar's own (malformed JSON, a field of the wrong type, an unknown route), is turned
into one of these bodies with the right status, so no client ever sees a bare traceback or HTML.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException

from ..errors import LuceboxError

log = logging.getLogger("lucebox.server")

# OpenAI's `type` for each status; Anthropic uses its own names.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_unavailable",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """A request the server refuses, with what to tell the client."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class OpenAIErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(msgspec.Struct):
    """The body of every error response outside `/v1/messages`."""

    error: OpenAIErrorDetail


class AnthropicErrorDetail(msgspec.Struct):
    type: str
    message: str


class AnthropicError(msgspec.Struct):
    """The body of every error response on `/v1/messages*`."""

    type: str
    error: AnthropicErrorDetail


def error_response(path: str, error: APIError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    if path.startswith("/v1/messages"):
        kind = error.type if error.type in _ANTHROPIC_TYPES.values() else _ANTHROPIC_TYPES.get(error.status, "api_error")
        body: Any = {"type": "error", "error": {"type": kind, "message": error.message}}
    else:
        kind = error.type or _OPENAI_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
        body = {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}
    return Response(body, status_code=error.status, headers=headers, media_type="application/json")


def _from_validation(exc: ValidationException) -> APIError:
    """Litestar's 'Validation failed for POST /x' with details in `extra` -> one readable message."""
    problems = exc.extra if isinstance(exc.extra, list) else []
    if not problems:
        return invalid(str(exc.detail))
    first = problems[0] if isinstance(problems[0], dict) else {}
    key = first.get("key")
    message = str(first.get("message", exc.detail))
    if message.startswith("Object missing required field"):
        # msgspec: "Object missing required field `x` - at `$.messages[0]`"
        field, _, where = message.removeprefix("Object missing required field ").partition(" - at ")
        field = field.strip("`")
        path = where.strip("`").removeprefix("$").lstrip(".")
        param = f"{path}.{field}" if path else field
        return invalid(f"missing required field `{param}`", param=param)
    if key == "data":  # the body as a whole: missing, or not an object
        return invalid(f"the request body must be a JSON object ({message})" if message != "'data'" else
                       "the request body is missing; send a JSON object")
    param = str(key) if key else None
    return invalid(f"invalid value for `{key}`: {message}" if key else message, param=param)


def handle_exception(request: Request, exc: Exception) -> Response:
    """The one exception handler: everything becomes an API-shaped error body."""
    if isinstance(exc, APIError):
        error = exc
    elif isinstance(exc, ValidationException):
        error = _from_validation(exc)
    elif isinstance(exc, HTTPException) and isinstance(exc.__cause__, SerializationException):
        detail = str(exc.detail).removeprefix("JSON is malformed: ")
        error = invalid(f"the request body is not valid JSON: {detail}", code="malformed_json")
    elif isinstance(exc, HTTPException):
        detail = str(exc.detail)
        error = APIError(exc.status_code, detail)
        if exc.status_code >= 500:
            log.error("server error on %s %s: %s", request.method, request.url.path, detail)
    elif isinstance(exc, LuceboxError):
        error = invalid(str(exc))
    else:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        error = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
    return error_response(request.url.path, error)
