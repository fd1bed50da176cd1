"""Asyncio front of the synchronous engine.

The model step is blocking CPU/GPU work, so one dedicated thread owns the LLMEngine: every
engine call happens on it. Coroutines hand it work through a command queue that the thread
drains between steps, and it hands outputs back with one `call_soon_threadsafe` per step.
Nothing else touches the engine, so the engine itself needs no locks.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from spanserve.engine.engine import LLMEngine
from spanserve.engine.layout import Segment
from spanserve.engine.outputs import RequestOutput
from spanserve.engine.params import SamplingParams
from spanserve.reuse.policies import Policy

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineOverloaded(RuntimeError):
    """More requests are in flight than the configured limit; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread is gone (shut down, or never started)."""


class EngineStepError(RuntimeError):
    """A model step raised; every request in flight at that moment was aborted."""


class EngineObserver(Protocol):
    """Hooks run on the engine thread (so they see outputs in step order, without locking)."""

    def on_outputs(self, outputs: Sequence[RequestOutput], now: float) -> None: ...

    def on_abort(self, request_id: str) -> None: ...


@dataclass
class _Command:
    """Work for the engine thread; `fut` (if any) receives its result or exception."""

    fn: Callable[[], Any]
    fut: concurrent.futures.Future[Any] | None

    def run(self) -> None:
        if self.fut is None:
            try:
                self.fn()
            except Exception:  # fire-and-forget (aborts): nobody to report to, keep serving
                log.exception("engine command failed")
            return
        if not self.fut.set_running_or_notify_cancel():
            return  # its caller was cancelled before the command started: skip it
        try:
            self.fut.set_result(self.fn())
        except BaseException as e:  # handed to the awaiting coroutine, not raised on this thread
            self.fut.set_exception(e)


@dataclass
class RequestSpec:
    prompt: str | list[int] | list[Segment]  # a list of Segments is a span layout
    params: SamplingParams
    request_id: str
    namespace: str = ""
    policy: str | Policy | None = None  # None = the engine's default policy


class RequestStream:
    """Consumer side of one request: async-iterates the latest RequestOutput per step.

    Outputs carry cumulative text/tokens/logprobs, so when the consumer falls behind it skips
    to the newest one instead of replaying every step: a slow client costs no memory growth.
    """

    def __init__(self, request_id: str, owner: AsyncEngine):
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _push(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not self._queue.empty() and isinstance(item, RequestOutput) and not item.finished:
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop the request and free its blocks; no-op once finished. Does not wait, so it is
        safe from `finally` blocks of cancelled tasks."""
        if not self.finished:
            self.finished = True
            self._owner._submit_abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_pending: int | None = None,
                 observer: EngineObserver | None = None):
        self.engine = engine
        # Requests admitted but not finished (running + waiting). None = unbounded.
        self.max_pending = max_pending
        self.observer = observer
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._num_pending = 0  # engine thread writes; other threads only read it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from inside the event loop that will consume outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="spanserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            return
        self._commands.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped.is_set()

    @property
    def num_pending(self) -> int:
        return self._num_pending

    # ---- requests -------------------------------------------------------------------------
    async def add_requests(self, specs: Sequence[RequestSpec]) -> list[RequestStream]:
        """Add all of `specs` or none: a ValueError from any (bad prompt, too long, bad id) or
        EngineOverloaded aborts the ones already added and is raised here, before any output."""
        fut = self._submit(lambda: self._add_all(specs))
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            # The caller went away while the add was in flight: whatever got added has no
            # consumer now, so abort it once the add completes, or its blocks would stay held.
            fut.add_done_callback(_abort_orphans)
            raise

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       namespace: str = "") -> AsyncGenerator[RequestOutput, None]:
        """Yields outputs as the request progresses, the last one finished. Closing or cancelling
        the consumer aborts the request in the engine, which frees its blocks."""
        (stream,) = await self.add_requests([RequestSpec(prompt, params, request_id, namespace)])
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    async def pin(self, segments: Sequence[Segment], namespace: str = "") -> RequestStream:
        """Queue the encoding and pinning of plus segments (LLMEngine.pin); the stream's one
        output arrives when they are cached and pinned (finish_reason "stop"). ValueError (over
        the pin budget, bad segment) and EngineOverloaded are raised here."""
        segs: list[Segment | str] = list(segments)
        fut = self._submit(lambda: self._pin(segs, namespace))
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(_abort_orphan)
            raise

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self._submit(lambda: self._abort(request_id)))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps (inspection, maintenance)."""
        return await asyncio.wrap_future(self._submit(lambda: fn(self.engine)))

    # ---- handoff --------------------------------------------------------------------------
    def _submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self.is_alive:
            fut.set_exception(EngineDeadError("the engine is not running"))
            return fut
        self._commands.put(_Command(fn, fut))
        return fut

    def _submit_abort(self, request_id: str) -> None:
        if self.is_alive:
            self._commands.put(_Command(lambda: self._abort(request_id), None))

    # ---- engine thread --------------------------------------------------------------------
    def _add_all(self, specs: Sequence[RequestSpec]) -> list[RequestStream]:
        if self.max_pending is not None and self._num_pending + len(specs) > self.max_pending:
            raise EngineOverloaded(
                f"server is at capacity ({self._num_pending} requests in flight, limit {self.max_pending}); "
                "retry later")
        streams: list[RequestStream] = []
        try:
            for spec in specs:
                if spec.request_id in self._streams:
                    raise ValueError(f"request id {spec.request_id!r} is already in use")
                self.engine.add_request(spec.prompt, spec.params, request_id=spec.request_id,
                                        namespace=spec.namespace, policy=spec.policy)
                stream = RequestStream(spec.request_id, self)
                self._streams[spec.request_id] = stream
                self._num_pending += 1
                streams.append(stream)
        except BaseException:
            for s in streams:
                self._abort(s.request_id)
            raise
        return streams

    def _pin(self, segments: list[Segment | str], namespace: str) -> RequestStream:
        if self.max_pending is not None and self._num_pending + 1 > self.max_pending:
            raise EngineOverloaded(
                f"server is at capacity ({self._num_pending} requests in flight, limit {self.max_pending}); "
                "retry later")
        # The engine names pin requests itself; they are tracked like any other request so the
        # finishing step delivers to this stream and the pending count stays right.
        req = self.engine.pin(segments, namespace)
        stream = RequestStream(req.request_id, self)
        self._streams[req.request_id] = stream
        self._num_pending += 1
        return stream

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return  # finished in the meantime: nothing holds blocks any more
        self._num_pending -= 1
        self.engine.abort(request_id)
        if self.observer is not None:
            self.observer.on_abort(request_id)

    def _run(self) -> None:
        try:
            while True:
                # Block only when idle: with work pending, commands are picked up between steps.
                if not self._drain(block=not self.engine.has_unfinished()):
                    break
                if self.engine.has_unfinished():
                    self._step()
        except BaseException:  # a bug in the loop itself: say so rather than hang every client
            log.exception("engine thread crashed")
            raise
        finally:
            self._stopped.set()
            self._fail_all(EngineDeadError("the engine stopped"))
            self._refuse_queued()

    def _drain(self, block: bool) -> bool:
        """Run queued commands; False once shutdown was requested."""
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is None:
                return False
            cmd.run()
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _refuse_queued(self) -> None:
        # Commands that raced with shutdown would otherwise leave their callers waiting forever.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd is not None and cmd.fut is not None and cmd.fut.set_running_or_notify_cancel():
                cmd.fut.set_exception(EngineDeadError("the engine stopped"))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; aborting the %d requests in flight", len(self._streams))
            self._fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        now = time.monotonic()
        if self.observer is not None:
            try:
                self.observer.on_outputs(outputs, now)
            except Exception:  # metrics must never take serving down
                log.exception("engine observer failed")
        batch: list[tuple[RequestStream, RequestOutput]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its consumer while this step ran
            if out.finished:
                del self._streams[out.request_id]
                self._num_pending -= 1
            batch.append((stream, out))
        if batch:
            self._deliver(batch)

    def _deliver(self, batch: list[tuple[RequestStream, Any]]) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(_push_all, batch)
        except RuntimeError:  # the loop closed under us (interpreter shutdown)
            pass

    def _fail_all(self, error: BaseException) -> None:
        streams = list(self._streams.values())
        for s in streams:
            try:
                self._abort(s.request_id)
            except Exception:
                log.exception("abort of %s failed", s.request_id)
        self._deliver([(s, error) for s in streams])


def _push_all(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in batch:
        stream._push(item)


def _abort_orphan(fut: concurrent.futures.Future[RequestStream]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().abort()


def _abort_orphans(fut: concurrent.futures.Future[list[RequestStream]]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        for stream in fut.result():
            stream.abort()
