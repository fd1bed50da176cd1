"""The engine core in a process of its own, as vLLM's v1 engine and SGLang run it: the API server
(HTTP, tokenizing, grammar compiling, detokenizing, streaming) never shares a GIL with the step
loop. Inputs and outputs are engine/wire.py's structs as msgpack over one ZeroMQ ROUTER socket
that the core binds: each API server connects a DEALER named by its client id, and the core sends
every client its own requests' deltas.

Every client watches the core (its sentinel when the core is its child, its pid otherwise): if it
exits unasked, every stream in flight ends with an error and the client is dead (the server then
answers 503 and exits, or starts a new core). The core watches its parent in turn and exits when
the parent is gone; SIGTERM stops it cleanly, and it leaves Ctrl-C to its parent, which stops the
API servers first and the core last."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from spanserve.engine.client import EngineClient, Transport
from spanserve.engine.core import EngineCore, EngineInfo, serve
from spanserve.engine.wire import ENCODER, INPUTS, OUTPUTS, Input, Output, Shutdown

log = logging.getLogger("spanserve.core")
START_TIMEOUT_S = 3600.0  # loading a large model from a slow disk
STOP_TIMEOUT_S = 10.0
WATCH_S = 0.2  # how often a client whose core is not its child checks that the core still runs
PARENT_CHECK_S = 1.0  # how often the core checks that its parent still runs


def alive(pid: int) -> bool:
    """Whether process `pid` runs. A zombie (exited, not yet reaped by its parent) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: signal 0 tells whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _identity(client: int) -> bytes:
    return f"client-{client}".encode()


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    """No high-water marks: ZeroMQ drops what a ROUTER cannot queue for a slow peer, and a lost
    delta is a stream that never ends. Memory bounds the queues instead, as in vLLM."""
    sock = ctx.socket(kind)
    for opt, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 0)):
        sock.setsockopt(opt, value)
    return sock


def _remove_socket_dir(address: str) -> None:
    shutil.rmtree(os.path.dirname(address.removeprefix("ipc://")), ignore_errors=True)


class _Receiver:
    """The core's inputs: every message waiting on the socket, decoded. A message that does not
    decode is logged and dropped (a client's bug must not take the core down); SIGTERM and a
    vanished parent read as Shutdown."""

    def __init__(self, sock: zmq.Socket, parent: int):
        self.sock = sock
        self.poller = zmq.Poller()
        self.poller.register(sock, zmq.POLLIN)
        self.parent, self.checked = parent, time.monotonic()
        self.stopping = False

    def __call__(self, timeout: float | None) -> list[Input]:
        if self.stopping or self._orphaned():
            return [Shutdown()]
        msgs: list[Input] = []
        wait_ms = None if timeout is None else int(timeout * 1000)
        while self.poller.poll(wait_ms):
            frames = self.sock.recv_multipart()
            wait_ms = 0
            try:
                msgs.append(INPUTS.decode(frames[-1]))
            except msgspec.MsgspecError as e:
                log.error("dropped a message from %r that is not an engine core input: %s", frames[0], e)
        return msgs

    def _orphaned(self) -> bool:
        if time.monotonic() - self.checked < PARENT_CHECK_S:
            return False
        self.checked = time.monotonic()
        if os.getppid() != self.parent:
            log.warning("the API server that started the engine core is gone: the core stops")
            return True
        return False


def core_main(make_engine: Callable[[], Any], address: str, ready: Any, log_level: str) -> None:
    """The core process: build the engine, bind, report ready (or why not), serve until told to stop."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    # Ctrl-C reaches the whole process group; the parent stops the API servers, then the core.
    # (A Python handler, not SIG_IGN, which processes this one starts would inherit.)
    signal.signal(signal.SIGINT, lambda *_: None)
    parent = os.getppid()
    try:
        engine = make_engine()
    except BaseException as e:
        ready.send(("error", f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    core = EngineCore(engine)
    sock = _socket(zmq.Context.instance(), zmq.ROUTER)
    try:
        sock.bind(address)
        receive = _Receiver(sock, parent)
        # SIGTERM (until now: die at once) lets the step finish and the engine shut down
        signal.signal(signal.SIGTERM, lambda *_: setattr(receive, "stopping", True))
        ready.send(("ready", ENCODER.encode(core.info())))

        def send(client: int, out: Output) -> None:
            sock.send_multipart([_identity(client), ENCODER.encode(out)], copy=False)

        serve(core, receive, send)
    finally:
        engine.shutdown()
        sock.close()
        _remove_socket_dir(address)
    # Stopped as asked, with the engine shut down (its workers stopped, its tiers flushed): what
    # is left is the interpreter's teardown of torch and friends, a second its parent waits on.
    logging.shutdown()
    os._exit(0)


def _await_ready(conn: Any, proc: BaseProcess) -> bytes:
    """The core's EngineInfo (encoded) once its engine is built; ValueError if it fails."""
    if not conn.poll(START_TIMEOUT_S):
        raise ValueError(f"the engine core did not start in {START_TIMEOUT_S:.0f} s")
    try:
        kind, payload = conn.recv()
    except EOFError:  # it exited without a word (killed, or os._exit)
        proc.join(5)
        raise ValueError(f"the engine core exited while starting (exit code {proc.exitcode})") from None
    if kind == "error":
        proc.join(5)
        raise ValueError(f"the engine core failed to start: {payload}")
    return payload


def _stop(proc: BaseProcess, timeout: float) -> int | None:
    if proc.is_alive():
        proc.terminate()  # SIGTERM: the core finishes its step and shuts its engine down
        proc.join(timeout)
    if proc.is_alive():
        log.warning("the engine core did not stop in %.0f s: killing it", timeout)
        proc.kill()
        proc.join(5)
    return proc.exitcode


@dataclass
class CoreProcess:
    """A running engine core process: where to reach it and what its engine is."""

    process: BaseProcess
    address: str
    info: EngineInfo

    @classmethod
    def launch(cls, make_engine: Callable[[], Any], log_level: str = "info") -> "CoreProcess":
        """Starts a core process and waits until its engine is built; ValueError if it fails.
        `make_engine` must pickle (a module-level function, or functools.partial of one)."""
        address = f"ipc://{tempfile.mkdtemp(prefix='spanserve-')}/core.sock"
        ctx = mp.get_context("spawn")
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=core_main, args=(make_engine, address, child_end, log_level),
                           name="spanserve-core")  # not a daemon: a TP driver starts worker processes
        proc.start()
        child_end.close()
        try:
            payload = _await_ready(parent_end, proc)
        except BaseException:  # a failed start, or Ctrl-C while the model loads
            _stop(proc, 5)
            _remove_socket_dir(address)
            raise
        finally:
            parent_end.close()
        return cls(proc, address, msgspec.msgpack.decode(payload, type=EngineInfo))

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def transport(self, client_id: int = 0, owner: bool = False) -> "ProcessTransport":
        """A transport to this core; `owner`: closing it stops the core."""
        return ProcessTransport(self.address, client_id, self.process, owner=owner)

    def client(self, tokenizer: Any, client_id: int = 0, owner: bool = False, max_pending: int | None = None,
               **kwargs: Any) -> EngineClient:
        return EngineClient(self.transport(client_id, owner), tokenizer, self.info, max_pending, client_id, **kwargs)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Stops the core (if it still runs) and returns its exit code."""
        code = _stop(self.process, timeout)
        _remove_socket_dir(self.address)
        return code


class ProcessTransport(Transport):
    """The client's side of a core process's socket, on the event loop. `process`: the core, when
    it is this process's child (its sentinel tells of its exit at once); else `pid` is polled.
    Only an `owner` stops the core when it closes."""

    def __init__(self, address: str, client_id: int = 0, process: BaseProcess | None = None,
                 pid: int | None = None, owner: bool = False):
        self.address = address
        self.client_id = client_id
        self.process = process
        self.pid = pid if pid is not None else getattr(process, "pid", None)
        self.owner = owner and process is not None
        self._sock: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._closing = False

    def start(self, loop: asyncio.AbstractEventLoop, on_output: Callable[[Output], None],
              on_dead: Callable[[str], None]) -> None:
        self._sock = _socket(zmq.asyncio.Context.instance(), zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, _identity(self.client_id))
        self._sock.connect(self.address)
        self._reader = loop.create_task(self._read(on_output, on_dead))
        if self.pid is not None:
            threading.Thread(target=self._watch, args=(loop, on_dead), name="spanserve-core-watch", daemon=True).start()

    async def _read(self, on_output: Callable[[Output], None], on_dead: Callable[[str], None]) -> None:
        while True:
            try:
                data = await self._sock.recv()
            except zmq.ZMQError as e:
                if not self._closing:
                    on_dead(f"the engine core's socket failed: {e}")
                return
            try:
                msg = OUTPUTS.decode(data)
            except msgspec.MsgspecError as e:
                log.error("dropped a message from the engine core that does not decode: %s", e)
                continue
            try:
                on_output(msg)
            except Exception:  # one request's bad output must not stop every other's
                log.exception("an engine core output could not be delivered")

    def _watch(self, loop: asyncio.AbstractEventLoop, on_dead: Callable[[str], None]) -> None:
        code = None
        if self.process is not None:
            while not self._closing and not multiprocessing.connection.wait([self.process.sentinel], WATCH_S):
                pass
            if self.owner and not self._closing:  # only the owner reaps it: two threads that wait
                self.process.join(1.0)  # for one child race, and the loser reads no exit code
                code = self.process.exitcode
        else:
            while not self._closing and alive(self.pid):  # type: ignore[arg-type]
                time.sleep(WATCH_S)
        if not self._closing:
            reason = "the engine core process exited unexpectedly" + (f" (exit code {code})" if code is not None else "")
            try:
                loop.call_soon_threadsafe(on_dead, reason)
            except RuntimeError:  # the loop closed first
                pass

    def send(self, msg: Input) -> None:
        self._sock.send(ENCODER.encode(msg))

    async def close(self) -> None:
        self._closing = True
        if self.owner:
            assert self.process is not None
            if self._sock is not None and self.process.is_alive():
                self.send(Shutdown())
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.process.join, STOP_TIMEOUT_S)
            await loop.run_in_executor(None, _stop, self.process, 5.0)
            _remove_socket_dir(self.address)
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._sock.close()


def process_client(make_engine: Callable[[], Any], tokenizer: Any, max_pending: int | None = None,
                   log_level: str = "info", **kwargs: Any) -> EngineClient:
    """A client of a new engine core process built by `make_engine` (picklable); shutting the
    client down stops the core."""
    return CoreProcess.launch(make_engine, log_level).client(tokenizer, 0, True, max_pending, **kwargs)
