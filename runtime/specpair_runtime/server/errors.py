"""OpenAI-format errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specpair_runtime.server.schemas import ErrorDetail, ErrorResponse, field_path

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    detail = ErrorDetail(
        message=message,
        type=ERROR_TYPES.get(status, "invalid_request_error"),
        param=param,
        code=code,
    )
    return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=status)


def describe_request_errors(errors: list[dict[str, object]]) -> tuple[str, str | None]:
    """The first validation problem as (message naming the field, field path)."""
    first = errors[0]
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
    else:
        message = str(first.get("msg", "invalid value"))
    more = len(errors) - 1
    suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
    return (f"{path}: {message}{suffix}" if path else f"{message}{suffix}"), path or None


async def api_error_handler(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, APIError)
    return error_response(error.status, error.message, error.param, error.code)


async def validation_error_handler(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, (RequestValidationError, ValidationError))
    errors = [dict(item) for item in error.errors()]
    message, param = describe_request_errors(errors)
    return error_response(400, message, param)


async def http_error_handler(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    return error_response(error.status_code, str(error.detail))
