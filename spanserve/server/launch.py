"""`spanserve serve`: start the engine core (in a process of its own by default), then the API
server(s) under uvicorn; watch the core, and exit non-zero (or start a new core) if it dies."""
from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spanserve.engine.config import EngineConfig
from spanserve.server.context import ServerConfig
from spanserve.server.limits import RequestLimits
from spanserve.worker.storage import bytes_per_block

if TYPE_CHECKING:
    from spanserve.engine.client import EngineClient
    from spanserve.engine.core import EngineInfo
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
    engine_process: bool = True  # the engine core in a process of its own (False: a thread of the API server)
    api_server_count: int = 1  # API server processes sharing the port and the one engine core
    restart_engine: bool = False  # a core that dies is replaced (default: the server exits non-zero)
    step_timeout_s: float = 60.0  # /health is 503 once requests wait this long on a core that finishes no step
    limits: RequestLimits = field(default_factory=RequestLimits)  # bounds on one request (server/limits.py)

    def check(self) -> None:
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count must be >= 1, got {self.api_server_count}")
        if self.api_server_count > 1 and not self.engine_process:
            raise ValueError("--api-server-count > 1 needs the engine core in its own process; drop --no-engine-process")
        if self.restart_engine and (self.api_server_count > 1 or not self.engine_process):
            raise ValueError("--restart-engine needs one API server and the engine core in its own process")
        if not self.step_timeout_s > 0:
            raise ValueError(f"--step-timeout must be > 0 seconds, got {self.step_timeout_s}")
        self.limits.check()


def _log_engine(engine: "LLMEngine", seconds: float) -> None:
    c = engine.config
    log.info("model loaded in %.1f s: %s, %d layers, hidden %d, vocab %d", seconds,
             c.arch, c.num_layers, c.hidden_size, c.vocab_size)
    mib = engine.pool.num_blocks * bytes_per_block(engine.model.config, engine.block_size, engine.dtype) / 2**20
    log.info("KV pool: %.1f MiB per rank", mib)
    if engine.tiers is not None:
        log.info("KV tiers below the pool: %s", ", ".join(t.name for t in engine.tiers.tiers))


def _log_info(info: "EngineInfo", seconds: float) -> None:
    log.info("engine core ready in %.1f s: KV pool of %d blocks x %d tokens = %d tokens; max model len %d; "
             "default policy %s", seconds, info.num_blocks, info.block_size, info.num_blocks * info.block_size,
             info.max_model_len, info.default_policy)


def serve(opts: ServeOptions) -> int:
    """Blocks until the server stops; the exit status (1 if it never came up, e.g. port taken, or
    if the engine core died)."""
    from spanserve.engine.engine import LLMEngine

    opts.check()
    logging.basicConfig(level=opts.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_config = opts.engine.updated(tp_on_failure="exit").resolve()  # a dead TP worker ends the server
    config = server_config(opts, engine_config)
    log.info("runtime: %s", engine_config.summary())
    log.info("loading model %s on %s (%s) ...", config.model_source, engine_config.model.device,
             engine_config.model.dtype)
    t0 = time.monotonic()
    if not opts.engine_process:
        engine = LLMEngine(engine_config)
        _log_engine(engine, time.monotonic() - t0)
        return run_api(opts, engine, config)
    from spanserve.engine.core_process import ProcessTransport
    from spanserve.model.loader import load_tokenizer

    make = functools.partial(LLMEngine, engine_config)
    transport, info = ProcessTransport.launch(make, opts.log_level)
    _log_info(info, time.monotonic() - t0)
    tokenizer = load_tokenizer(config.model_source) if isinstance(engine_config.model.source, str) else None
    workers = [_spawn_api_server(opts, config, transport.address, info, i, transport.process.pid)
               for i in range(1, opts.api_server_count)]
    client = _client(transport, tokenizer, info, config)
    try:
        return run_api(opts, client, config, relaunch=make if opts.restart_engine else None)
    finally:
        for w in workers:
            w.join(5)
            if w.is_alive():
                w.terminate()


def server_config(opts: ServeOptions, engine_config: EngineConfig) -> ServerConfig:
    source = str(engine_config.model.source)
    return ServerConfig(served_model_name=opts.served_model_name or default_served_name(source), model_source=source,
                        max_pending=engine_config.scheduler.max_num_seqs + opts.max_queued_requests,
                        strict_params=opts.strict_params, api_key=resolve_api_key(opts.api_key, os.environ),
                        auth_all_routes=opts.auth_all_routes, step_timeout_s=opts.step_timeout_s,
                        limits=opts.limits)


def _client(transport: Any, tokenizer: Any, info: "EngineInfo", config: ServerConfig, client_id: int = 0) -> "EngineClient":
    from spanserve.engine.client import EngineClient

    return EngineClient(transport, tokenizer, info, config.max_pending, client_id)


def run_api(opts: ServeOptions, engine: "LLMEngine | EngineClient", config: ServerConfig,
            relaunch: Any = None) -> int:
    """One API server over `engine` until it stops: 0, 130 on Ctrl-C, 1 if it never came up or
    its engine core died (without `relaunch`, the core's factory to start a new one with)."""
    import uvicorn

    from spanserve.engine.client import EngineClient
    from spanserve.server.app import create_app

    app = create_app(engine, config)
    server = uvicorn.Server(uvicorn.Config(app, host=opts.host, port=opts.port, log_level=opts.log_level,
                                           access_log=False, timeout_graceful_shutdown=5))
    died: list[str] = []
    client = app.state.ctx.engine
    if isinstance(engine, EngineClient):
        client.on_death = functools.partial(_on_core_death, server, client, died, relaunch, opts.log_level)
    url = f"http://{opts.host}:{opts.port}"
    log.info("serving %r at %s/v1 (metrics at %s/metrics)", config.served_model_name, url, url)
    log.info("access: %s; unknown request fields: %s",
             ("API key required on every route" if opts.auth_all_routes else
              "API key required (/health and /metrics open)") if config.api_key else "open (no --api-key)",
             "refused (--strict-params)" if opts.strict_params else "ignored with a warning")
    sockets = [_shared_socket(opts.host, opts.port)] if opts.api_server_count > 1 else None
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:
        # uvicorn has already shut down gracefully and re-raises Ctrl-C; a traceback would be noise.
        return 130
    return 1 if died or not server.started else 0


def _on_core_death(server: Any, client: "EngineClient", died: list[str], relaunch: Any, log_level: str,
                   reason: str) -> None:
    """The core died (its streams have ended with an error; new requests get 503): stop the
    server, which then exits non-zero, or start a new core and take requests again."""
    died.append(reason)
    if relaunch is None:
        log.error("the engine core died (%s): the server stops", reason)
        server.should_exit = True
        return
    loop = asyncio.get_running_loop()
    log.error("the engine core died (%s): starting a new one", reason)

    def start() -> None:
        from spanserve.engine.core_process import ProcessTransport

        try:
            transport, info = ProcessTransport.launch(relaunch, log_level)
        except ValueError as e:
            log.error("the new engine core did not start (%s): the server stops", e)
            server.should_exit = True
            return
        died.clear()
        asyncio.run_coroutine_threadsafe(client.reconnect(transport, info), loop)
        log.info("a new engine core serves requests")

    threading.Thread(target=start, name="spanserve-core-restart", daemon=True).start()


def _shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket that each API server process binds itself: the kernel spreads
    connections over them (SO_REUSEPORT)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _spawn_api_server(opts: ServeOptions, config: ServerConfig, address: str, info: "EngineInfo", client_id: int,
                      core_pid: int) -> Any:
    # Not a daemon: it starts grammar compile workers, and daemonic processes may have no children
    # (`serve` stops it when it returns; it exits by itself when the core is gone).
    proc = mp.get_context("spawn").Process(target=api_server_main, name=f"spanserve-api-{client_id}",
                                           args=(opts, config, address, info, client_id, core_pid))
    proc.start()
    return proc


def api_server_main(opts: ServeOptions, config: ServerConfig, address: str, info: "EngineInfo", client_id: int,
                    core_pid: int) -> None:
    """Another API server process over the same engine core (--api-server-count)."""
    from spanserve.engine.core_process import ProcessTransport
    from spanserve.model.loader import load_tokenizer

    logging.basicConfig(level=opts.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[api-{client_id}]: %(message)s")
    tokenizer = load_tokenizer(config.model_source)
    client = _client(ProcessTransport(address, client_id, pid=core_pid), tokenizer, info, config, client_id)
    raise SystemExit(run_api(opts, client, config))
