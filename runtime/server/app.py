"""The FastAPI app: OpenAI-compatible routes over one AsyncEngine, plus /tokenize, /detokenize, /health, /metrics.

Routes only parse and delegate (completions.py, chat.py). The app owns the engine thread: its lifespan starts the
AsyncEngine and shuts it down. `extra_routers` lets other parts (the admin page) mount their own routes; they find
the engine and the served name on `app.state.envex` (a ServerContext).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from envex.runtime.server.async_engine import AsyncEngine
from envex.runtime.server.chat import create_chat_completion
from envex.runtime.server.completions import create_completion
from envex.runtime.server.context import ServerContext
from envex.runtime.server.errors import APIError, bad_request, install_error_handlers
from envex.runtime.server.limits import ServerLimits
from envex.runtime.server.metrics import CONTENT_TYPE, Metrics, MetricsMiddleware
from envex.runtime.server.protocol import DetokenizeRequest, TokenizeChatRequest, parse_tokenize, read_body

OPENAI_PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
OPEN_PATHS = ("/health", "/metrics")


def _context(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.envex
    return ctx


def _authorized(request: Request) -> None:
    _context(request).check_api_key(request)


def _openai_router() -> APIRouter:
    router = APIRouter(dependencies=[Depends(_authorized)])

    @router.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_model_card(_context(request))]})

    @router.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> JSONResponse:
        ctx = _context(request)
        ctx.check_model(model)
        return JSONResponse(_model_card(ctx))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(_context(request), request)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(_context(request), request)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        ctx = _context(request)
        body = await read_body(request, ctx.limits.max_body_bytes)
        req = await ctx.prep(len(body) <= ctx.limits.inline_bytes, parse_tokenize, body, ctx.limits)
        ctx.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            tokens = await ctx.encode_chat(req.messages, add_generation_prompt=req.add_generation_prompt is not False,
                                           add_special_tokens=bool(req.add_special_tokens))
        else:
            tokens = (await ctx.encode([req.prompt], add_special_tokens=req.add_special_tokens is not False))[0]
        if len(tokens) <= ctx.limits.inline_chars:
            return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": ctx.max_model_len})
        return Response(await ctx.pool.run(_tokens_json, tokens, ctx.max_model_len), media_type="application/json")

    @router.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        ctx = _context(request)
        req = await ctx.parse(request, DetokenizeRequest)
        ctx.check_model(req.model)
        vocab = ctx.async_engine.engine.model_config.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens: token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        text = (await ctx.decode([req.tokens]))[0]
        return await ctx.prep(len(text) <= ctx.limits.inline_chars, JSONResponse, {"prompt": text})

    return router


def _tokens_json(tokens: list[int], max_model_len: int, chunk: int = 16_384) -> bytes:
    """/tokenize's answer for a long prompt. json.dumps holds the interpreter lock for all of a list (30 ms for
    230K ids, even on a prep thread, and the event loop waits for it); in chunks, the loop runs in between."""
    parts = [json.dumps(tokens[i:i + chunk], separators=(",", ":"))[1:-1] for i in range(0, len(tokens), chunk)]
    return f'{{"tokens":[{",".join(parts)}],"count":{len(tokens)},"max_model_len":{max_model_len}}}'.encode()


def _model_card(ctx: ServerContext) -> dict[str, object]:
    engine = ctx.async_engine.engine
    return {"id": ctx.served_model_name, "object": "model", "created": int(ctx.async_engine.started_at),
            "owned_by": "envex", "root": engine.source.name, "max_model_len": ctx.max_model_len}


def _open_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> JSONResponse:
        engine = _context(request).async_engine
        if not engine.is_running:
            reason = f": {engine.last_error}" if engine.last_error else ""
            raise APIError(503, f"the engine thread is not running{reason}", code="engine_down")
        return JSONResponse({"status": "ok"})

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        ctx = _context(request)
        return Response(ctx.metrics.render(ctx.async_engine), media_type=CONTENT_TYPE)

    return router


def build_app(async_engine: AsyncEngine, *, api_key: str | None = None, served_model_name: str | None = None,
              extra_routers: Sequence[APIRouter] = (), limits: ServerLimits | None = None) -> FastAPI:
    """The server app over `async_engine` (started and stopped by the app's lifespan).

    `api_key`: when given, /v1/*, /tokenize and /detokenize need `Authorization: Bearer <api_key>`; /health and
    /metrics stay open. `served_model_name`: the name clients send as `model` (default: the engine's).
    `limits`: what one request may cost (ServerLimits' defaults when None).
    """
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key: must not be empty or blank; omit it to serve without a key")

    metrics = Metrics(known_paths=(*OPENAI_PATHS, *OPEN_PATHS))
    ctx = ServerContext(
        async_engine=async_engine,
        served_model_name=served_model_name or async_engine.engine.model_name,
        metrics=metrics,
        api_key=api_key,
        limits=limits or ServerLimits(),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            ctx.pool.shutdown()
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="Envex", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.envex = ctx
    install_error_handlers(app)
    app.include_router(_openai_router())
    app.include_router(_open_router())
    for router in extra_routers:
        app.include_router(router)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
