"""Every error the server returns is OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Handlers raise APIError; the handlers installed here turn it, FastAPI's own validation and routing errors, and
anything unexpected (a 500, logged) into that shape, so no client ever sees HTML or FastAPI's 422 layout.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499  # counted in the metrics for a client that left before its answer

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error for the client: HTTP status, a one-line message, and OpenAI's type / param / code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: no such endpoint; see GET /v1/models and the API docs"
        elif exc.status_code == 405:
            message = f"{request.method} {request.url.path}: method not allowed"
        else:
            message = str(exc.detail)
        err = APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None,
                       headers=dict(exc.headers or {}))
        return err.response()

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        # Bodies are parsed by protocol.parse_request; this only catches path or query parameters.
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return bad_request(f"{loc or 'request'}: {first.get('msg', 'invalid')}", param=loc).response()

    async def on_client_left(request: Request, _: Exception) -> Response:
        # Not a server error: one line, and 499 (nginx's "client closed request") in the metrics, as for clients
        # that leave later on. Nobody reads the response.
        log.warning("%s %s: the client disconnected before its request body was read in full (499)",
                    request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in a request handler", exc_info=exc)
        return APIError(500, f"internal server error ({type(exc).__name__}); see the server log").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ClientDisconnect, on_client_left)
    app.add_exception_handler(Exception, on_unexpected)
