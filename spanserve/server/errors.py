"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}`, for every failure.

Clients (the openai package included) read `error.message`; a bare FastAPI `{"detail": ...}`
or an HTML 500 page would surface to users as an opaque failure.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from spanserve.server.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation(errors: Sequence[Any]) -> APIError:
    """One readable message for pydantic errors; `param` names the first offending field."""
    if not errors:
        return bad_request("invalid request body")
    parts = []
    for e in errors[:3]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        msg = e.get("msg", "invalid value")
        if e.get("type") == "json_invalid":
            parts.append(f"request body is not valid JSON: {msg}")
        elif e.get("type") == "extra_forbidden":
            parts.append(f"unknown parameter {loc!r}")
        elif loc:
            parts.append(f"{loc}: {msg}")
        else:
            parts.append(msg)
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    first = errors[0].get("loc", ())
    param = ".".join(str(x) for x in first if x != "body") or None
    return bad_request("; ".join(parts) + more, param=param)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422 by default; OpenAI clients expect 400 for a malformed request.
        return from_validation(exc.errors()).response()

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        return from_validation(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = APIError(404, f"no route {request.method} {request.url.path}", code="unknown_route")
        elif exc.status_code == 405:
            err = APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                           code="method_not_allowed")
        else:
            err = APIError(exc.status_code, str(exc.detail))
        resp = err.response()
        if exc.headers:
            resp.headers.update(exc.headers)
        return resp

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Input errors are all caught before this point; reaching here is a server bug.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


def stream_error_payload(e: Exception) -> str:
    """An error raised after a stream's headers went out, as the JSON of its last SSE event."""
    err = e if isinstance(e, APIError) else APIError(500, f"stream failed: {type(e).__name__}: {e}",
                                                     type="server_error")
    return err.body().model_dump_json()
