"""The Ray Serve application: a gateway (one HTTP entry point, computes each request's route
keys) in front of one deployment of engine replicas (each a whole single-server spanserve,
its FastAPI app served in process), routed by SegmentRequestRouter.

(No `from __future__ import annotations` here: Ray Serve's class ingress reads the route
signatures' annotations as objects.)"""

import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from starlette.concurrency import run_in_threadpool

from spanserve.cluster.asgi import HTTPCall, HTTPHead, run_asgi
from spanserve.cluster.forward import error_response, relay_stream
from spanserve.cluster.keys import KeyMaker
from spanserve.cluster.ray_router import SegmentRequestRouter
from spanserve.cluster.routing import RouteKey
from spanserve.engine.config import EngineConfig
from spanserve.engine.runtime import Platform, detect_platform
from spanserve.server.errors import APIError
from spanserve.server.limits import RequestLimits, read_body
from spanserve.toolcall.chat_setup import BUILTIN_TEMPLATES, read_template, resolve_chat_setup, template_text

log = logging.getLogger(__name__)

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection"}


@dataclass
class ClusterOptions:
    model: str = "smollm2"
    replicas: int = 2
    # Every replica's engine options, as LLM(...) names them (block_size, num_blocks, device,
    # dtype, ...), in plain values; each replica resolves them on its own machine with
    # EngineConfig.resolve, as `LLM(...)` and `spanserve serve` do.
    engine: dict[str, Any] = field(default_factory=dict)
    served_model_name: str | None = None
    max_queued_requests: int = 1024
    replica_cpus: float = 1.0  # Ray CPUs reserved per replica (also its torch threads, at least 1)
    # Ray GPUs per replica; None: one per tensor-parallel rank when the engine resolves to CUDA, else 0
    replica_gpus: float | None = None
    max_ongoing_requests: int = 64  # per replica; beyond it Ray Serve queues at the router
    slack: float = 0.25  # a replica may hold (1 + slack) x the mean load before requests spill
    retries: int = 1  # times a request is sent again when its replica dies before answering
    health_check_period_s: float = 2.0
    # --chat-template (a shipped name or the template's text: a replica may not see the head's
    # files) and --tool-call-parser, as `spanserve serve` takes them
    chat_template: str | None = None
    tool_call_parser: str = "auto"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if not self.replica_cpus > 0:
            raise ValueError(f"replica_cpus must be > 0, got {self.replica_cpus}")
        if self.replica_gpus is not None and not self.replica_gpus >= 0:
            raise ValueError(f"replica_gpus must be >= 0 (or unset for the default), got {self.replica_gpus}")
        if self.retries < 0 or not self.slack >= 0:
            raise ValueError("retries and slack must be >= 0")
        self.engine_config().to_dict()  # checked and shippable here, not in a replica's log
        if self.chat_template is not None and self.chat_template not in BUILTIN_TEMPLATES:
            self.chat_template = read_template(self.chat_template)  # the text travels, not the path
        resolve_chat_setup(None, self.chat_template, self.tool_call_parser)

    def engine_config(self) -> EngineConfig:
        """The replicas' engine configuration, checked but not resolved (each replica resolves it)."""
        if "model" in self.engine:
            raise ValueError("give the model as ClusterOptions.model (--model), not among the engine options")
        return EngineConfig.from_kwargs(model=self.model, **self.engine).check()


def replica_gpus(opts: ClusterOptions, platform: Platform) -> float:
    """GPUs Ray reserves for each replica: the explicit value, else one per tensor-parallel rank
    when the engine runs on CUDA (a device named cuda, or `auto` resolved on `platform`), else 0."""
    if opts.replica_gpus is not None:
        return float(opts.replica_gpus)
    config = opts.engine_config()
    asked = config.model.device.strip().lower()
    device = asked if asked != "auto" else config.resolve(platform).model.device
    return float(config.parallel.tensor_parallel_size) if device.startswith("cuda") else 0.0


class EngineReplica:
    """One engine and its API, the same app `spanserve serve` runs, minus the socket."""

    def __init__(self, options: dict[str, Any]):
        import torch

        from spanserve.engine.engine import LLMEngine
        from spanserve.server.app import create_app
        from spanserve.server.context import ServerConfig
        from spanserve.server.launch import default_served_name

        opts = ClusterOptions(**options)
        torch.set_num_threads(max(1, int(opts.replica_cpus)))
        config = opts.engine_config().resolve()  # on this replica's machine
        log.info("runtime: %s", config.summary())
        self.engine = LLMEngine(config)
        max_pending = config.scheduler.max_num_seqs + opts.max_queued_requests
        server = ServerConfig(served_model_name=opts.served_model_name or default_served_name(opts.model),
                              model_source=opts.model, max_pending=max_pending, chat_template=opts.chat_template,
                              tool_call_parser=opts.tool_call_parser)
        self.app = create_app(self.engine, server)
        self._lifespan: Any = None
        self._name = serve.get_replica_context().replica_id.unique_id

    async def _start(self) -> None:
        if self._lifespan is None:  # the app's startup (the engine thread) on this replica's loop
            self._lifespan = self.app.router.lifespan_context(self.app)
            await self._lifespan.__aenter__()

    async def forward(self, call: HTTPCall, route: list[RouteKey] | None = None) -> AsyncIterator[HTTPHead | bytes]:
        """The app's response to `call`: its head, then its body chunks. `route` is read by the
        router only."""
        await self._start()
        async for item in run_asgi(self.app, call):
            if isinstance(item, HTTPHead):  # which replica answered: for logs, tests and operators
                item.headers.append(("x-spanserve-replica", self._name))
            yield item

    def record_routing_stats(self) -> dict[str, Any]:
        return {"pool_tokens": self.engine.pool.num_blocks * self.engine.block_size}

    async def check_health(self) -> None:
        await self._start()
        if not self.app.state.ctx.engine.is_alive:
            raise RuntimeError("the engine thread has stopped")

    async def __del__(self) -> None:
        if self._lifespan is not None:
            await self._lifespan.__aexit__(None, None, None)


gateway_api = FastAPI(title="spanserve cluster")


@serve.ingress(gateway_api)
class Gateway:
    """The one HTTP entry point: every route of the single-server API, forwarded to a replica."""

    def __init__(self, engines: Any, options: dict[str, Any]):
        opts = ClusterOptions(**options)
        self.engines = engines
        self.retries = opts.retries
        self.max_body_bytes = RequestLimits().max_body_bytes  # the replicas' own limit, checked here first
        config = opts.engine_config()
        from spanserve.model.loader import load_tokenizer  # the replicas' own: what they tokenize with

        tok = load_tokenizer(opts.model)
        setup = resolve_chat_setup(template_text(tok), opts.chat_template, opts.tool_call_parser)
        self.keys = KeyMaker(tok, config.cache.block_size, str(config.scheduler.default_policy), setup.template)

    @gateway_api.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def proxy(self, path: str, request: Request) -> Response:
        try:
            body = await read_body(request, self.max_body_bytes)
        except APIError as e:
            return e.response()
        call = HTTPCall(request.method, "/" + path, request.url.query, tuple(request.headers.items()), body)
        keys: list[RouteKey] = []
        if request.method == "POST":
            keys = await run_in_threadpool(self.keys.keys, call.path, body, call.query)
        last: Exception | None = None
        for _ in range(self.retries + 1):
            stream = self.engines.options(stream=True).forward.remote(call, route=keys)
            try:
                head = await stream.__anext__()
                assert isinstance(head, HTTPHead)
                headers = {k: v for k, v in head.headers if k.lower() not in _HOP_HEADERS}
                if head.headers and dict(head.headers).get("content-type", "").startswith("text/event-stream"):
                    return StreamingResponse(relay_stream(stream), status_code=head.status, headers=headers)
                chunks = [c async for c in stream]  # whole, so a replica lost midway is retried
                return Response(b"".join(chunks), status_code=head.status, headers=headers)
            except RayActorError as e:
                log.warning("replica lost while serving %s: %s", call.path, e)
                last = e
        return error_response(503, f"the replica serving this request stopped ({type(last).__name__}); "
                      "the deployment is restarting it: retry", "replica_unavailable")


def build_app(opts: ClusterOptions) -> Any:
    """The application, ready for serve.run."""
    options = asdict(opts)
    engines = serve.deployment(EngineReplica).options(
        name="SpanserveEngine", num_replicas=opts.replicas,
        ray_actor_options={"num_cpus": opts.replica_cpus, "num_gpus": replica_gpus(opts, detect_platform(opts.model))},
        max_ongoing_requests=opts.max_ongoing_requests,
        health_check_period_s=opts.health_check_period_s, health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class=SegmentRequestRouter, request_router_kwargs={"slack": opts.slack},
            request_routing_stats_period_s=5.0),
    )
    gateway = serve.deployment(Gateway).options(name="SpanserveGateway", num_replicas=1,
                                                ray_actor_options={"num_cpus": 0})
    return gateway.bind(engines.bind(options), options)


def app_builder(args: dict[str, Any]) -> Any:
    """For Ray Serve's own tooling: `serve run spanserve.cluster.app:app_builder replicas=4
    model=/models/x`, or `import_path` + `args` in a Serve config file (`serve deploy`). Values
    given as text (the command line) are read as Python literals where they are one."""
    import ast

    def value(v: Any) -> Any:
        if not isinstance(v, str):
            return v
        try:
            return ast.literal_eval(v)
        except (ValueError, SyntaxError):
            return v

    return build_app(ClusterOptions(**{k: value(v) for k, v in args.items()}))
