"""`spanserve serve`: load the model, size the KV pool, and run the API under uvicorn."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from spanserve.engine.config import EngineConfig
from spanserve.worker.storage import bytes_per_block

if TYPE_CHECKING:
    from spanserve.engine.engine import LLMEngine

log = logging.getLogger("spanserve")

API_KEY_ENV = "SPANSERVE_API_KEY"

def resolve_api_key(flag: str | None, env: Mapping[str, str]) -> str | None:
    """--api-key, else $SPANSERVE_API_KEY; None (open access) when neither is a non-empty key."""
    return flag or env.get(API_KEY_ENV) or None


def default_served_name(model: str) -> str:
    return "smollm2" if model.lower() == "smollm2" else Path(model).expanduser().name or model


@dataclass
class ServeOptions:
    engine: EngineConfig = field(default_factory=EngineConfig)  # the model and every engine option
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    # Requests that may wait beyond the running batch before new ones get 429.
    max_queued_requests: int = 1024
    log_level: str = "info"
    api_key: str | None = None  # None: the SPANSERVE_API_KEY environment variable, if set
    auth_all_routes: bool = False  # the key guards /health and /metrics too
    strict_params: bool = False  # unknown request fields are a 400 instead of a logged warning


def _log_engine(engine: "LLMEngine", seconds: float) -> None:
    c = engine.config
    log.info("model loaded in %.1f s: %s, %d layers, hidden %d, vocab %d", seconds,
             c.arch, c.num_layers, c.hidden_size, c.vocab_size)
    blocks = engine.pool.num_blocks
    mib = blocks * bytes_per_block(engine.model.config, engine.block_size, engine.dtype) / 2**20  # per rank
    log.info("KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB); max model len %d; default policy %s",
             blocks, engine.block_size, blocks * engine.block_size, mib, engine.max_model_len,
             engine.default_policy.name)
    if engine.tiers is not None:
        log.info("KV tiers below the pool: %s", ", ".join(t.name for t in engine.tiers.tiers))


def serve(opts: ServeOptions) -> int:
    """Blocks until the server stops; the exit status (1 if it never came up, e.g. port taken)."""
    # Imported here so `spanserve generate` does not pay for the web stack.
    import uvicorn

    from spanserve.engine.engine import LLMEngine
    from spanserve.server.app import create_app
    from spanserve.server.context import ServerConfig

    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_config = opts.engine.updated(tp_on_failure="exit").resolve()  # a dead TP worker ends the server
    source = str(engine_config.model.source)
    name = opts.served_model_name or default_served_name(source)
    api_key = resolve_api_key(opts.api_key, os.environ)
    config = ServerConfig(served_model_name=name, model_source=source,
                          max_pending=engine_config.scheduler.max_num_seqs + opts.max_queued_requests,
                          strict_params=opts.strict_params, api_key=api_key, auth_all_routes=opts.auth_all_routes)
    log.info("runtime: %s", engine_config.summary())
    log.info("loading model %s on %s (%s) ...", source, engine_config.model.device, engine_config.model.dtype)
    t0 = time.monotonic()
    engine = LLMEngine(engine_config)
    _log_engine(engine, time.monotonic() - t0)
    app = create_app(engine, config)
    url = f"http://{opts.host}:{opts.port}"
    log.info("serving %r at %s/v1 (metrics at %s/metrics)", name, url, url)
    log.info("access: %s; unknown request fields: %s",
             ("API key required on every route" if opts.auth_all_routes else
              "API key required (/health and /metrics open)") if api_key else "open (no --api-key)",
             "refused (--strict-params)" if opts.strict_params else "ignored with a warning")
    server = uvicorn.Server(uvicorn.Config(app, host=opts.host, port=opts.port, log_level=opts.log_level,
                                           access_log=False, timeout_graceful_shutdown=5))
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn has already shut down gracefully and re-raises Ctrl-C; a traceback would be noise.
        return 130
    return 0 if server.started else 1
