"""Error answers of the API process, in the two envelopes of DESIGN.md "Errors".

Engine codes map to HTTP statuses 605 -> 400 and 606 -> 500; HTTP-level errors carry their
status as the native error_code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tapserve.api.wire import ERROR_NAMES, EXECUTION_EXCEPTION, INVALID_PARAMS

_STATUS_OF_CODE = {INVALID_PARAMS: 400, EXECUTION_EXCEPTION: 500}
_NAMES = {
    **ERROR_NAMES,
    400: "400_BAD_REQUEST",
    401: "401_UNAUTHORIZED",
    404: "404_NOT_FOUND",
    405: "405_METHOD_NOT_ALLOWED",
    413: "413_REQUEST_TOO_LARGE",
    500: "500_INTERNAL_ERROR",
    503: "503_SERVICE_UNAVAILABLE",
}
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "internal_error",
    503: "service_unavailable_error",
}


@dataclass
class ApiError(Exception):
    """An error answer: `code` is an engine code (605/606) or an HTTP status."""

    code: int
    message: str
    param: str | None = None

    def __post_init__(self) -> None:
        # quoted client text may hold a lone surrogate, which no JSON response can encode
        self.message = _encodable(self.message)
        self.param = None if self.param is None else _encodable(self.param)

    @property
    def status(self) -> int:
        return _STATUS_OF_CODE.get(self.code, self.code if 400 <= self.code < 600 else 500)

    @property
    def code_str(self) -> str:
        return _NAMES.get(self.code, f"{self.code}_ERROR")

    def openai_body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "internal_error"),
                "param": self.param,
                "code": self.code_str,
            }
        }

    def native_body(self) -> dict:
        message = self.message
        if self.param and self.param not in message:  # no "param" key here: the message names it
            message = f"invalid field '{self.param}': {message}"
        return {"error_code": self.code, "error_code_str": self.code_str, "message": message}


def _encodable(text: str) -> str:
    """text with any lone surrogate written as a backslash escape (valid UTF-8)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(INVALID_PARAMS, message, param)


def is_openai_path(path: str) -> bool:
    return path.startswith("/v1/")


def error_body(error: ApiError, path: str) -> dict:
    return error.openai_body() if is_openai_path(path) else error.native_body()


def error_response(error: ApiError, path: str) -> JSONResponse:
    return JSONResponse(error_body(error, path), status_code=error.status)


# the ASGI scope "state" key of a failed stream's HTTP status (its response began as a 200)
STREAM_ERROR_STATUS = "tapserve_stream_error_status"


def sse_error_event(error: ApiError, path: str, scope: dict | None = None) -> str:
    """The last SSE event of a stream that failed after it started; the error's status is
    noted in scope["state"] (STREAM_ERROR_STATUS) when a scope is given."""
    if scope is not None:
        scope.setdefault("state", {})[STREAM_ERROR_STATUS] = error.status
    return f"data: {json.dumps(error_body(error, path))}\n\n"


# pydantic names the union member it tried in the location ("stop.str"): not a field
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|.*\[.*\]|[a-z-]+\[.*)$")


def _field_name(loc: tuple) -> str:
    parts = [
        str(p) for p in loc if p != "body" and not (isinstance(p, str) and _UNION_MEMBER.match(p))
    ]
    return ".".join(parts) or "body"


def validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's 422 -> a 605 naming the first offending field."""
    errors = exc.errors()
    if not errors:
        return invalid("invalid request body")
    first = errors[0]
    name = _field_name(tuple(first.get("loc", ())))
    if first.get("type") == "string_unicode" and name == "body":  # a field name, say
        return invalid(
            "the request body holds a string that is not valid Unicode (a lone surrogate escape)",
            None,
        )
    if name == "body":
        return invalid(
            "the request body must be a JSON object sent with Content-Type: application/json", None
        )
    if first.get("type") == "extra_forbidden":
        return invalid(f"unsupported field '{name}'", name)
    if first.get("type") == "json_invalid":
        return invalid(f"request body is not valid JSON: {first.get('msg')}", None)
    return invalid(f"invalid field '{name}': {first.get('msg')}", name)


def install_handlers(app) -> None:
    """Route ApiError, validation errors, HTTP exceptions and unexpected exceptions into
    the envelopes."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # a body FastAPI could not parse (e.g. invalid UTF-8)
            return error_response(
                invalid(f"request body could not be read: {exc.detail}"), request.url.path
            )
        return error_response(ApiError(exc.status_code, str(exc.detail)), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # a bug of ours: still the envelope (Starlette re-raises it afterwards, and uvicorn
        # logs the traceback)
        return error_response(
            ApiError(500, f"internal server error ({type(exc).__name__})"), request.url.path
        )
