"""Web plumbing of the admin page: security headers on every route, form parsing, origin check, templates."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jinja2
from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

HERE = Path(__file__).parent
MAX_FORM_BYTES = 16 * 1024
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


def duration(seconds: float) -> str:
    """12 s, 3 min 4 s, 5 h 6 min: the same form as admin.js writes when it refreshes the figure."""
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {(s % 3600) // 60} min"


def templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE), autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["duration"] = duration
    return env


class SecureRoute(APIRoute):
    """Adds the security headers to every response of the admin routes, redirects and refusals included."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def secured(request: Request) -> Response:
            response = await handler(request)
            response.headers.update(SECURITY_HEADERS)
            return response

        return secured


async def read_form(request: Request) -> dict[str, str] | None:
    """An urlencoded form body of at most MAX_FORM_BYTES (no multipart: the admin forms never upload)."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
        return None
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True, max_num_fields=20)
    return {k: v[0] for k, v in fields.items()}


def same_origin(request: Request) -> bool:
    """False when the browser says the request comes from another site (its Origin is not this Host)."""
    origin = request.headers.get("origin")
    if origin is None or (origin == "null" and request.headers.get("sec-fetch-site") == "same-origin"):
        return True
    return urlsplit(origin).netloc == request.headers.get("host", "")
