"""The engine core on a thread of the API server's process: the structs cross as they are, with
no copy or encoding. For tests, notebooks and replicas that are processes of their own already."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

from spanserve.engine.client import EngineClient, Transport
from spanserve.engine.core import EngineCore, serve
from spanserve.engine.engine import LLMEngine
from spanserve.engine.wire import Input, Output, Shutdown

log = logging.getLogger("spanserve.core")


class InprocTransport(Transport):
    def __init__(self, engine: LLMEngine):
        self.core = EngineCore(engine)
        self._inbox: queue.SimpleQueue[Input] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closing = False

    def start(self, loop: asyncio.AbstractEventLoop, on_output: Callable[[Output], None],
              on_dead: Callable[[str], None]) -> None:
        def send(_client: int, out: Output) -> None:
            try:
                loop.call_soon_threadsafe(on_output, out)
            except RuntimeError:  # the loop closed under us (interpreter shutdown)
                pass

        def run() -> None:
            try:
                serve(self.core, self._receive, send)
            except BaseException as e:  # a bug in the loop itself: say so rather than hang every client
                log.exception("engine core thread crashed")
                if not self._closing:
                    loop.call_soon_threadsafe(on_dead, f"the engine core stopped: {type(e).__name__}: {e}")
                raise

        self._thread = threading.Thread(target=run, name="spanserve-engine", daemon=True)
        self._thread.start()

    def _receive(self, timeout: float | None) -> list[Input]:
        try:
            msgs = [self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()]
        except queue.Empty:
            return []
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return msgs

    def send(self, msg: Input) -> None:
        self._inbox.put(msg)

    async def close(self) -> None:
        self._closing = True
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(Shutdown())
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)


def inproc_client(engine: LLMEngine, max_pending: int | None = None, **kwargs: object) -> EngineClient:
    """A client of `engine`, stepped on a thread of this process. The client tokenizes with a
    copy of the engine's tokenizer: a Rust tokenizer used from two threads can fail."""
    import copy

    transport = InprocTransport(engine)
    tok = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
    return EngineClient(transport, tok, transport.core.info(), max_pending, **kwargs)  # type: ignore[arg-type]
