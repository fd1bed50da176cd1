"""The engine core in a process of its own, as vLLM's v1 engine and SGLang run it: the API server
(HTTP, tokenizing, grammar compiling, detokenizing, streaming) never shares a GIL with the step
loop. Inputs and outputs are engine/wire.py's structs as msgpack over one ZeroMQ ROUTER socket
that the core binds: each API server connects a DEALER named by its client id, and the core sends
every client its own requests' deltas.

The API server that starts the core watches it: if it exits unasked, every stream in flight ends
with an error and the client is dead (the server then answers 503 and exits, or starts a new
core). The core watches its parent in turn and exits when the parent is gone."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from spanserve.engine.client import EngineClient, Transport
from spanserve.engine.core import EngineCore, EngineInfo, serve
from spanserve.engine.wire import ENCODER, INPUTS, OUTPUTS, Input, Output, Shutdown

log = logging.getLogger("spanserve.core")
START_TIMEOUT_S = 3600.0  # loading a large model from a slow disk
STOP_TIMEOUT_S = 10.0
WATCH_S = 0.2  # how often an API server that did not start the core checks that it still runs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _identity(client: int) -> bytes:
    return f"client-{client}".encode()


def core_main(make_engine: Callable[[], Any], address: str, ready: Any, log_level: str) -> None:
    """The core process: build the engine, bind, report ready (or why not), serve until told to stop."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    parent, checked = os.getppid(), time.monotonic()
    try:
        engine = make_engine()
    except BaseException as e:
        ready.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    core = EngineCore(engine)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    ready.send(("ready", ENCODER.encode(core.info())))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)

    def receive(timeout: float | None) -> list[Input]:
        nonlocal checked
        if time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            if os.getppid() != parent:  # the API server is gone, and with it our purpose
                return [Shutdown()]
        msgs: list[Input] = []
        wait_ms = None if timeout is None else int(timeout * 1000)
        while poller.poll(wait_ms):
            _, data = sock.recv_multipart()
            msgs.append(INPUTS.decode(data))
            wait_ms = 0
        return msgs

    def send(client: int, out: Output) -> None:
        sock.send_multipart([_identity(client), ENCODER.encode(out)], copy=False)

    try:
        serve(core, receive, send)
    finally:
        engine.shutdown()
        sock.close()


class ProcessTransport(Transport):
    """Starts the core process (`launch`) or joins one by address, and carries the client's
    side of the socket on the event loop."""

    def __init__(self, address: str, client_id: int = 0, process: Any = None, pid: int | None = None):
        self.address = address
        self.client_id = client_id
        self.process = process  # the core process, when this client started it (it is watched)
        self.pid = pid if pid is not None else getattr(process, "pid", None)  # watched by polling otherwise
        self._sock: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._closing = False

    @classmethod
    def launch(cls, make_engine: Callable[[], Any], log_level: str = "info") -> tuple["ProcessTransport", EngineInfo]:
        """Starts a core process and waits until its engine is built; ValueError if it fails."""
        address = f"ipc://{tempfile.mkdtemp(prefix='spanserve-')}/core.sock"
        ctx = mp.get_context("spawn")
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=core_main, args=(make_engine, address, child_end, log_level),
                           name="spanserve-core")  # not a daemon: a TP driver starts worker processes
        proc.start()
        child_end.close()
        if not parent_end.poll(START_TIMEOUT_S):
            proc.terminate()
            raise ValueError("the engine core did not start")
        try:
            kind, payload = parent_end.recv()
        except EOFError:
            proc.join(5)
            raise ValueError(f"the engine core exited while starting (exit code {proc.exitcode})") from None
        if kind == "error":
            proc.join(5)
            raise ValueError(f"the engine core failed to start: {payload}")
        import msgspec

        return cls(address, 0, proc), msgspec.msgpack.decode(payload, type=EngineInfo)

    def start(self, loop: asyncio.AbstractEventLoop, on_output: Callable[[Output], None],
              on_dead: Callable[[str], None]) -> None:
        self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, _identity(self.client_id))
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.address)
        self._reader = loop.create_task(self._read(on_output))
        if self.pid is not None:
            threading.Thread(target=self._watch, args=(loop, on_dead), name="spanserve-core-watch", daemon=True).start()

    async def _read(self, on_output: Callable[[Output], None]) -> None:
        while True:
            data = await self._sock.recv()
            on_output(OUTPUTS.decode(data))

    def _watch(self, loop: asyncio.AbstractEventLoop, on_dead: Callable[[str], None]) -> None:
        if self.process is not None:  # our child: its sentinel tells at once
            multiprocessing.connection.wait([self.process.sentinel])
            code = self.process.exitcode
        else:  # another API server's child, reaped by it when it exits
            while not self._closing and _alive(self.pid):
                time.sleep(WATCH_S)
            code = None
        if not self._closing:
            reason = "the engine core process exited unexpectedly" + (f" (exit code {code})" if code is not None else "")
            try:
                loop.call_soon_threadsafe(on_dead, reason)
            except RuntimeError:
                pass

    def send(self, msg: Input) -> None:
        self._sock.send(ENCODER.encode(msg))

    async def close(self) -> None:
        self._closing = True
        if self._sock is not None and self.process is not None and self.process.is_alive():
            self.send(Shutdown())  # only the API server that started the core stops it
        if self.process is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.process.join, STOP_TIMEOUT_S)
            if self.process.is_alive():
                self.process.terminate()
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._sock.close()


def process_client(make_engine: Callable[[], Any], tokenizer: Any, max_pending: int | None = None,
                   log_level: str = "info", **kwargs: Any) -> EngineClient:
    """A client of a new engine core process built by `make_engine` (picklable)."""
    transport, info = ProcessTransport.launch(make_engine, log_level)
    return EngineClient(transport, tokenizer, info, max_pending, **kwargs)
