"""The FastAPI application: routes, error handlers and the engine's lifetime.

Bodies are validated from the raw bytes by the pydantic models in protocol.py (strict JSON
types) instead of FastAPI's body parameters, so that malformed JSON, wrong types and unknown
fields all reach one 400 path.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.convertors import Convertor, register_url_convertor
from starlette.responses import Response

from spanserve.engine.client import EngineClient, EngineDeadError, EngineTimeout
from spanserve.engine.engine import LLMEngine
from spanserve.engine.inproc import inproc_client
from spanserve.server.auth import METRICS_PATH, OPEN_PATHS, BearerAuth, tenant_of
from spanserve.server.chat import create_chat_completion
from spanserve.server.compat import screen, screen_unknown
from spanserve.server.completions import create_completion
from spanserve.server.context import ServerConfig, ServingContext
from spanserve.server.errors import APIError, install_handlers
from spanserve.server.keys import KeyRing
from spanserve.server.limits import read_body as read_limited
from spanserve.server.metrics import CONTENT_TYPE, ServerMetrics
from spanserve.server.openapi import install_openapi
from spanserve.server.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, PinRequest,
                                       PinResponse, UnpinResponse, now_s)
from spanserve.server.query import execute_query
from spanserve.server.span import pin_segments, unpin_segment
from spanserve.server.tokenize import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
                                       detokenize, tokenize)

log = logging.getLogger(__name__)

# The core answers a stats call between steps; this long without one, /metrics answers 503.
STATS_TIMEOUT_S = 10.0



class _SegmentKey(Convertor[str]):
    """Any text, newlines and "/" included: a segment's default key is its text. (Starlette's
    `path` convertor is `.*`, which stops at a newline.)"""

    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("segment_key", _SegmentKey())


def create_app(engine: LLMEngine | EngineClient, config: ServerConfig) -> FastAPI:
    """The API over an engine core: `engine` is a client of one (a core in its own process, say),
    or an LLMEngine, which then steps on a thread of this process."""
    metrics = ServerMetrics()
    owned = engine if isinstance(engine, LLMEngine) else None
    client = inproc_client(owned, config.max_pending) if owned is not None else engine
    client.observer = metrics
    ctx = ServingContext(client, config, metrics)
    if client.compile_grammar is None:
        # Compiled in worker processes; the core, on a thread or in a process, opens the JSON text.
        client.compile_grammar = ctx.grammars
    app = FastAPI(title="spanserve", lifespan=_lifespan(owned, ctx))
    app.state.ctx = ctx
    install_handlers(app)
    app.state.keys = None
    if config.api_key or config.api_keys_file:
        app.state.keys = KeyRing(config.api_key, config.api_keys_file)
        open_paths = () if config.auth_all_routes else OPEN_PATHS + ((METRICS_PATH,) if config.metrics_open else ())
        app.add_middleware(BearerAuth, keys=app.state.keys, open_paths=open_paths)
    _add_status_routes(app, ctx)
    _add_openai_routes(app, ctx)
    _add_span_routes(app, ctx)
    install_openapi(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                          "/v1/segments": PinRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
                          "/v1/query/execute": {"type": "object", "description": "a span query in spnl's JSON"}})
    return app


def _lifespan(engine: LLMEngine | None, ctx: ServingContext) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        try:
            yield
        finally:
            await ctx.engine.shutdown()
            ctx.close()
            if engine is not None:  # a core in this process: queued tier writes finish (a disk tier
                # keeps the pool's blocks for the next start); a core process does this itself
                await asyncio.get_running_loop().run_in_executor(None, engine.close)

    return lifespan


async def read_body(http: Request) -> bytes:
    """The body, refused with 413 as soon as it passes the server's limit (server/limits.py)."""
    return await read_limited(http, http.app.state.ctx.limits.max_body_bytes)


def _add_status_routes(app: FastAPI, ctx: ServingContext) -> None:
    created = now_s()

    @app.get("/health")
    async def health() -> Response:
        if not ctx.engine.is_alive:
            return APIError(503, f"the engine is not running: {ctx.engine.dead}", code="engine_unavailable").response()
        stalled = ctx.engine.stalled_for()
        if stalled > ctx.config.step_timeout_s:
            return APIError(503, f"the engine has not finished a step in {stalled:.0f} s while requests wait",
                            code="engine_stalled").response()
        return JSONResponse({"status": "ok", "steps": ctx.engine.steps})

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=ctx.config.served_model_name, created=created,
                                         root=ctx.config.model_source, max_model_len=ctx.max_model_len)])

    @app.get("/metrics")
    async def prometheus() -> Response:
        wait = min(STATS_TIMEOUT_S, ctx.config.step_timeout_s)
        try:
            stats = await ctx.engine.call("stats", timeout=wait)
        except EngineDeadError:
            stats = {}
        except EngineTimeout as e:  # a scrape must not hang on a wedged core
            return APIError(503, str(e), code="engine_stalled").response()
        return Response(ctx.metrics.render(stats), media_type=CONTENT_TYPE)


def _add_openai_routes(app: FastAPI, ctx: ServingContext) -> None:
    config = ctx.config

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        req = CompletionRequest.model_validate_json(await read_body(http))
        ctx.check_sampling(req, req.prompt_count())  # before anything walks a long field
        screen(req, config.strict_params, "/v1/completions")
        return await create_completion(ctx, req, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        req = ChatCompletionRequest.model_validate_json(await read_body(http))
        ctx.check_sampling(req, 1)
        screen(req, config.strict_params, "/v1/chat/completions")
        return await create_chat_completion(ctx, req, http)

    @app.post("/tokenize")
    async def tokenize_route(http: Request) -> TokenizeResponse:
        req = TokenizeRequest.model_validate_json(await read_body(http))
        screen_unknown(req, config.strict_params, "/tokenize")
        return await tokenize(ctx, req)

    @app.post("/detokenize")
    async def detokenize_route(http: Request) -> DetokenizeResponse:
        req = DetokenizeRequest.model_validate_json(await read_body(http))
        screen_unknown(req, config.strict_params, "/detokenize")
        return await detokenize(ctx, req)


def _add_span_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/v1/query/execute")
    async def query_execute(http: Request) -> Response:
        # The body is spnl's query JSON, sent as text/plain or application/json alike.
        return await execute_query(ctx, await read_body(http), http)

    @app.post("/v1/segments")
    async def pin(http: Request) -> PinResponse:
        return await pin_segments(ctx, PinRequest.model_validate_json(await read_body(http)), tenant_of(http))

    @app.delete("/v1/segments/{key:segment_key}")
    async def unpin(http: Request, key: str, cache_salt: str | None = None) -> UnpinResponse:
        return await unpin_segment(ctx, key, cache_salt, tenant_of(http))
