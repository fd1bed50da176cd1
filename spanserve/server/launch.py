"""`spanserve serve`: start the engine core (in a process of its own by default), then the API
server(s) under uvicorn; watch the core, and exit non-zero (or start a new core) if it dies."""
from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spanserve.engine.config import EngineConfig
from spanserve.server.context import ServerConfig
from spanserve.server.keys import KeyRing
from spanserve.server.limits import RequestLimits
from spanserve.toolcall.chat_setup import resolve_chat_setup
from spanserve.worker.storage import bytes_per_block

if TYPE_CHECKING:
    from spanserve.engine.client import EngineClient
    from spanserve.engine.core import EngineInfo
    from spanserve.engine.engine import LLMEngine

log = logging.getLogger("spanserve")

API_KEY_ENV = "SPANSERVE_API_KEY"
STOP_API_S = 10.0  # uvicorn's graceful shutdown (5 s) and the lifespan's, with room to spare
NOTICE_S = 3.0  # how long the other API servers may take to see a dead core and stop by themselves


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
    api_keys_file: str | None = None  # `TENANT KEY` lines, read again on SIGHUP
    auth_all_routes: bool = False  # the key guards /health (and /metrics) too
    metrics_open: bool = False  # /metrics answers without a key
    strict_params: bool = False  # unknown request fields are a 400 instead of a logged warning
    engine_process: bool = True  # the engine core in a process of its own (False: a thread of the API server)
    api_server_count: int = 1  # API server processes sharing the port and the one engine core
    restart_engine: bool = False  # a core that dies is replaced (default: the server exits non-zero)
    step_timeout_s: float = 60.0  # /health is 503 once requests wait this long on a core that finishes no step
    limits: RequestLimits = field(default_factory=RequestLimits)  # bounds on one request (server/limits.py)
    chat_template: str | None = None  # a shipped template (hermes, llama3_json, mistral) or a Jinja file
    tool_call_parser: str = "auto"  # hermes | llama3_json | mistral | auto (from the template) | none

    def check(self) -> None:
        if self.api_server_count < 1:
            raise ValueError(f"--api-server-count must be >= 1, got {self.api_server_count}")
        if self.api_server_count > 1 and not self.engine_process:
            raise ValueError("--api-server-count > 1 needs the engine core in its own process; drop --no-engine-process")
        if self.restart_engine and (self.api_server_count > 1 or not self.engine_process):
            raise ValueError("--restart-engine needs one API server and the engine core in its own process")
        # a bad name or path fails here, before any model loads
        resolve_chat_setup(None, self.chat_template, self.tool_call_parser)
        if not self.step_timeout_s > 0:
            raise ValueError(f"--step-timeout must be > 0 seconds, got {self.step_timeout_s}")
        self.limits.check()


def _log_engine(engine: "LLMEngine", seconds: float) -> None:
    c = engine.config
    log.info("model loaded in %.1f s: %s, %d layers, hidden %d, vocab %d", seconds,
             c.arch, c.num_layers, c.hidden_size, c.vocab_size)
    mib = engine.pool.num_blocks * bytes_per_block(engine.model.config, engine.block_size, engine.storage.k.dtype) / 2**20
    log.info("KV pool: %.1f MiB per rank, %s", mib, str(engine.storage.k.dtype).removeprefix("torch."))
    if engine.tiers is not None:
        log.info("KV tiers below the pool: %s", ", ".join(t.name for t in engine.tiers.tiers))


def _log_info(info: "EngineInfo", pid: int, seconds: float) -> None:
    log.info("engine core (pid %d) ready in %.1f s: KV pool: %d blocks x %d tokens = %d tokens; max model len %d; "
             "default policy %s", pid, seconds, info.num_blocks, info.block_size, info.num_blocks * info.block_size,
             info.max_model_len, info.default_policy)


def serve(opts: ServeOptions) -> int:
    """Blocks until the server stops; the exit status (1 if it never came up, e.g. port taken, or
    if the engine core died)."""
    from spanserve.engine.engine import LLMEngine

    opts.check()
    if opts.api_keys_file:  # a bad keys file fails now, before anything loads
        KeyRing(resolve_api_key(opts.api_key, os.environ), opts.api_keys_file)
        # SIGHUP means "reload the keys": until the handler is in place (and in the engine core
        # and the other API servers, which inherit this) it must not end the process
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
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
    from spanserve.engine.core_process import CoreProcess

    make = functools.partial(LLMEngine, engine_config)
    with ThreadPoolExecutor(1, thread_name_prefix="spanserve-startup") as pool:  # while the model loads
        api = pool.submit(_prepare_api, engine_config.model.source)
        core = CoreProcess.launch(make, opts.log_level)
    _log_info(core.info, core.pid, time.monotonic() - t0)
    tokenizer = api.result()
    workers = [_spawn_api_server(opts, config, core.address, core.info, i, core.pid, tokenizer is not None)
               for i in range(1, opts.api_server_count)]
    # With one API server, closing its client stops the core (or the core that replaced it).
    # With several, the API servers stop first and the core last, here.
    client = core.client(tokenizer, 0, owner=not workers, max_pending=config.max_pending)
    try:
        code = run_api(opts, client, config, relaunch=make if opts.restart_engine else None, others=workers)
    finally:
        # a dead core: the other API servers see it too and stop by themselves, non-zero
        failed = _stop_api_servers(workers, NOTICE_S if not core.process.is_alive() else 0.0)
        core.stop()
    return code or int(failed)


def _prepare_api(source: Any) -> Any:
    """The API server's tokenizer (None for a model given as an object), and its imports."""
    import spanserve.server.app  # noqa: F401
    from spanserve.model.loader import load_tokenizer

    return load_tokenizer(str(source)) if isinstance(source, str) else None


def server_config(opts: ServeOptions, engine_config: EngineConfig) -> ServerConfig:
    source = str(engine_config.model.source)
    keys_file = os.path.abspath(opts.api_keys_file) if opts.api_keys_file else None
    return ServerConfig(served_model_name=opts.served_model_name or default_served_name(source), model_source=source,
                        max_pending=engine_config.scheduler.max_num_seqs + opts.max_queued_requests,
                        strict_params=opts.strict_params, api_key=resolve_api_key(opts.api_key, os.environ),
                        api_keys_file=keys_file, auth_all_routes=opts.auth_all_routes,
                        metrics_open=opts.metrics_open, step_timeout_s=opts.step_timeout_s, limits=opts.limits,
                        chat_template=opts.chat_template, tool_call_parser=opts.tool_call_parser)


def run_api(opts: ServeOptions, engine: "LLMEngine | EngineClient", config: ServerConfig,
            relaunch: Any = None, index: int = 0, others: Sequence[Any] = ()) -> int:
    """One API server (number `index`) over `engine` until it stops: 0, 130 on Ctrl-C, 1 if it
    never came up, its engine core died (without `relaunch`, the core's factory to start a new
    one with) or one of the `others` API server processes exited (a SIGHUP here is passed on to
    them)."""
    import uvicorn

    from spanserve.engine.client import EngineClient
    from spanserve.server.app import create_app

    app = create_app(engine, config)
    asgi = _named(app, index) if opts.api_server_count > 1 else app
    server = uvicorn.Server(uvicorn.Config(asgi, host=opts.host, port=opts.port, log_level=opts.log_level,
                                           access_log=False, timeout_graceful_shutdown=5))
    died: list[str] = []
    client = app.state.ctx.engine
    if isinstance(engine, EngineClient):
        client.on_death = functools.partial(_on_core_death, server, client, died, relaunch, opts.log_level)
    if others:
        threading.Thread(target=_watch_api_servers, args=(others, server, died), name="spanserve-api-watch",
                         daemon=True).start()
    if app.state.keys is not None and config.api_keys_file:
        reload_keys_on_sighup(app.state.keys, [w.pid for w in others])
    url = f"http://{opts.host}:{opts.port}"
    log.info("serving %r at %s/v1 (metrics at %s/metrics)", config.served_model_name, url, url)
    log.info("access: %s; unknown request fields: %s", _access(config, app.state.keys),
             "refused (--strict-params)" if opts.strict_params else "ignored with a warning")
    sockets = [_shared_socket(opts.host, opts.port)] if opts.api_server_count > 1 else None
    # uvicorn shuts down gracefully on SIGTERM, then restores this handler and raises the signal
    # again: without one, the process would die there, before the API servers and the core stop.
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:
        # uvicorn has already shut down gracefully and re-raises Ctrl-C; a traceback would be noise.
        return 130
    except _Stopped:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 1 if died or not server.started else 0


class _Stopped(Exception):
    """SIGTERM: the server was asked to stop."""


def _raise_stopped(_sig: int, _frame: Any) -> None:
    raise _Stopped()


def _access(config: ServerConfig, keys: KeyRing | None) -> str:
    """The start-up log's words for access control (never a key)."""
    if keys is None:
        return "open (no API key)"
    who = f"{len(keys)} keys of {len(keys.tenants)} tenants"
    if config.auth_all_routes:
        return f"API key required on every route; {who}"
    return f"API key required (/health{' and /metrics' if config.metrics_open else ''} open); {who}"


def reload_keys_on_sighup(keys: KeyRing, siblings: Sequence[int] = ()) -> None:
    """SIGHUP reads the keys file again (a bad file keeps the keys as they are) and is passed on
    to the other API server processes, which each hold their own keys. Only the main thread can
    install a handler: elsewhere (a server run on a thread) the keys stay as loaded."""
    if threading.current_thread() is not threading.main_thread():
        log.warning("API keys will not be reloaded on SIGHUP: the server does not run on the main thread")
        return

    def on_hup(signum: int, frame: Any) -> None:
        keys.reload()
        for pid in siblings:
            try:
                os.kill(pid, signal.SIGHUP)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGHUP, on_hup)


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
        from spanserve.engine.core_process import CoreProcess

        try:
            core = CoreProcess.launch(relaunch, log_level)
        except ValueError as e:
            log.error("the new engine core did not start (%s): the server stops", e)
            server.should_exit = True
            return
        if server.should_exit:  # stopping meanwhile: the new core has nothing to serve
            core.stop()
            return
        died.clear()
        asyncio.run_coroutine_threadsafe(client.reconnect(core.transport(owner=True), core.info), loop).result()
        log.info("a new engine core (pid %d) serves requests", core.pid)

    threading.Thread(target=start, name="spanserve-core-restart", daemon=True).start()


def _watch_api_servers(others: Sequence[Any], server: Any, died: list[str]) -> None:
    """An API server that exits while this one serves stops this one too (and so the core), as
    a dead core does: a supervisor then restarts the whole, rather than a part silently gone."""
    gone = multiprocessing.connection.wait([w.sentinel for w in others])
    if server.should_exit:  # stopping anyway
        return
    w = next(w for w in others if w.sentinel in gone)
    w.join(1.0)
    died.append(f"{w.name} exited")
    log.error("API server %s exited unexpectedly (exit code %s): the server stops", w.name.rsplit("-", 1)[1],
              w.exitcode)
    server.should_exit = True


def _named(app: Any, index: int) -> Any:
    """The app, answering with a header that names this API server (one of several on the port)."""
    header = (b"x-spanserve-api-server", str(index).encode())

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_named(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await app(scope, receive, send_named)

    return asgi


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


def _spawn_api_server(opts: ServeOptions, config: ServerConfig, address: str, info: "EngineInfo", index: int,
                      core_pid: int, has_tokenizer: bool) -> Any:
    # Not a daemon: it starts grammar compile workers, and daemonic processes may have no children
    # (`serve` stops it when it returns; it exits by itself when the core is gone).
    proc = mp.get_context("spawn").Process(target=api_server_main, name=f"spanserve-api-{index}",
                                           args=(opts, config, address, info, index, core_pid, has_tokenizer))
    proc.start()
    return proc


def _stop_api_servers(workers: list[Any], grace: float) -> bool:
    """Waits up to `grace` seconds for the API servers to stop by themselves, then stops the rest
    (SIGTERM: uvicorn's graceful shutdown; SIGKILL past STOP_API_S). Whether any failed."""
    deadline = time.monotonic() + grace
    for w in workers:
        w.join(max(0.0, deadline - time.monotonic()))
    stopped = [w for w in workers if w.is_alive()]
    for w in stopped:
        w.terminate()
    failed = False
    for w in workers:
        w.join(STOP_API_S)
        if w.is_alive():
            log.warning("%s did not stop: killing it", w.name)
            w.kill()
            w.join()
        ok = w.exitcode == 0 or (w in stopped and w.exitcode == -signal.SIGTERM)  # stopped while it started
        failed |= not ok
        (log.info if ok else log.error)("API server %s exited with code %s", w.name.rsplit("-", 1)[1], w.exitcode)
    return failed


def api_server_main(opts: ServeOptions, config: ServerConfig, address: str, info: "EngineInfo", index: int,
                    core_pid: int, has_tokenizer: bool) -> None:
    """Another API server process over the same engine core (--api-server-count). It is client
    `index` of the core, never its owner: the process that started the core stops it."""
    if config.api_keys_file:  # a SIGHUP passed on before run_api's handler is in place must not end it
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from spanserve.engine.client import EngineClient
    from spanserve.engine.core_process import ProcessTransport
    from spanserve.model.loader import load_tokenizer

    logging.basicConfig(level=opts.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[api-{index}]: %(message)s")
    tokenizer = load_tokenizer(config.model_source) if has_tokenizer else None
    transport = ProcessTransport(address, index, pid=core_pid)
    client = EngineClient(transport, tokenizer, info, config.max_pending, index)
    raise SystemExit(run_api(opts, client, config, index=index))
