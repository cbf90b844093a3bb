"""OpenAI-format errors: ``{"error": {"message", "type", "param", "code"}}``.

Every error answer goes through ``error_response``, so no input can produce a
body of another shape, and every one is counted by its code. Messages are
written here and in the routes; an exception's own text is logged, never sent.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specpair_runtime.server.metrics import ServerMetrics
from specpair_runtime.server.schemas import ErrorDetail, ErrorResponse, field_path

log = logging.getLogger("specpair.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}
# Seconds a client should wait before retrying: the queue drains in about a
# step; a draining or loading server needs longer (or another replica).
RETRY_AFTER = {"queue_full": 1, "not_ready": 5, "shutting_down": 5}
INTERNAL_ERROR = "the server failed while handling this request"


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None, code: str | None) -> bytes:
    detail = ErrorDetail(
        message=message,
        type=ERROR_TYPES.get(status, "invalid_request_error"),
        param=param,
        code=code,
    )
    return json.dumps(ErrorResponse(error=detail).model_dump()).encode()


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    *,
    close: bool = False,
) -> JSONResponse:
    """The OpenAI-shaped error; ``close`` for answers sent before the body was read."""
    detail = ErrorDetail(
        message=message,
        type=ERROR_TYPES.get(status, "invalid_request_error"),
        param=param,
        code=code,
    )
    response = JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=status)
    if code in RETRY_AFTER:
        response.headers["Retry-After"] = str(RETRY_AFTER[code])
    if close:
        response.headers["Connection"] = "close"
    return response


# pydantic's type errors, by what the field expects (in JSON's words).
EXPECTED_TYPES = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
}


def json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words (``2.0`` is a decimal number)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _loc(error: dict[str, object]) -> tuple[int | str, ...]:
    loc = error.get("loc", ())
    return tuple(loc) if isinstance(loc, (tuple, list)) else ()


def _first_problem(errors: list[dict[str, object]]) -> dict[str, object]:
    """The first error, unless it is a union's plain-string branch failing.

    For ``content: str | list[ContentPart]`` a bad part fails both branches;
    "should be a valid string" says less than the deepest error of the other branch.
    """
    first = errors[0]
    loc = _loc(first)
    string_branch = bool(loc) and (loc[-1] == "str" or str(loc[-1]).endswith(", str]"))
    if not string_branch:
        return first
    prefix = loc[:-1]
    deeper = [e for e in errors[1:] if _loc(e)[: len(prefix)] == prefix]
    return max(deeper, key=lambda e: len(_loc(e))) if deeper else first


def _type_mismatch(errors: list[dict[str, object]], path: str, given: object) -> str:
    """Say "expected an integer, got a string"; a union's branches are joined by "or"."""
    expected: list[str] = []
    for error in errors:
        kind = str(error.get("type", ""))
        same_field = kind in EXPECTED_TYPES and field_path(_loc(error)) == path
        if same_field and EXPECTED_TYPES[kind] not in expected:
            expected.append(EXPECTED_TYPES[kind])
    return f"expected {' or '.join(expected)}, got {json_kind(given)}"


def _other_fields(errors: list[dict[str, object]], path: str) -> int:
    """Fields with problems besides ``path``; a union's failed branches are one problem."""
    paths = {field_path(_loc(error)) for error in errors}
    return len({other for other in paths if other != path and not path.startswith(other)})


def describe_request_errors(errors: list[dict[str, object]]) -> tuple[str, str | None]:
    """The first validation problem as (message naming the field, field path)."""
    first = _first_problem(errors)
    kind = str(first.get("type", ""))
    loc = first.get("loc", ())
    path = field_path(tuple(loc)) if isinstance(loc, (tuple, list)) else ""
    if kind == "json_invalid":
        ctx = first.get("ctx")
        reason = ctx.get("error", "") if isinstance(ctx, dict) else ""
        return f"request body is not valid JSON: {reason}".rstrip(": "), None
    if kind == "missing" and not path:
        return "request body is missing", None
    if kind == "model_attributes_type" or (kind.endswith("_type") and not path):
        return "request body must be a JSON object", None
    if kind == "extra_forbidden":
        message = "unknown field"
    elif kind == "missing":
        message = "field required"
    elif kind in EXPECTED_TYPES:
        message = _type_mismatch(errors, path, first.get("input"))
    else:
        message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    more = _other_fields(errors, path)
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return (f"{path}: {message}{suffix}" if path else f"{message}{suffix}"), path or None


def install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """OpenAI-shaped answers for every error the app can raise, each counted."""

    async def api_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, APIError)
        metrics.error(error.code)
        return error_response(error.status, error.message, error.param, error.code)

    async def validation_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, (RequestValidationError, ValidationError))
        errors = [dict(item) for item in error.errors()]
        message, param = describe_request_errors(errors)
        metrics.error(None)
        return error_response(400, message, param)

    async def http_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, StarletteHTTPException)
        metrics.error(None)
        return error_response(error.status_code, str(error.detail))

    async def unhandled(request: Request, error: Exception) -> JSONResponse:
        # Starlette logs the traceback too; the client gets no internal text.
        log.error("unhandled error on %s %s: %r", request.method, request.url.path, error)
        metrics.error("internal_error")
        return error_response(500, INTERNAL_ERROR, code="internal_error")

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unhandled)
