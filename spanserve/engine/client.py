"""The API server's side of the engine core: requests are checked and prepared here, sent to the
core (engine/core.py) through a transport (a thread of this process, or a process of its own),
and each step's deltas come back to be detokenized, cut at stop strings and streamed.

Everything here runs on the event loop's thread except what is handed to executors (grammar
compilation); the transport calls `_on_output` on that thread too, so no state here needs a lock.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from spanserve.engine.core import EngineInfo
from spanserve.engine.detokenize import make_decoder
from spanserve.engine.layout import Segment
from spanserve.engine.outputs import RequestOutput
from spanserve.engine.params import SamplingParams
from spanserve.engine.prepare import Limits, Prepared, check_prompt
from spanserve.engine.sampling import TokenLogprobs
from spanserve.engine.stops import OutputText, Stop
from spanserve.engine.wire import Abort, Add, Beat, Call, Delta, Input, Output, Reply, StepOutputs
from spanserve.reuse.policies import resolve_policy

log = logging.getLogger("spanserve.client")


class EngineObserver(Protocol):
    """Sees every output the client delivers, in step order, on the event loop's thread."""

    def on_outputs(self, outputs: Sequence[RequestOutput], now: float) -> None: ...

    def on_abort(self, request_id: str) -> None: ...


class EngineOverloaded(RuntimeError):
    """More requests are in flight than the configured limit; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine core is gone (shut down, crashed, or never started)."""


class EngineStepError(RuntimeError):
    """A model step raised; every request in flight at that moment was aborted."""


class EngineTimeout(TimeoutError):
    """The engine core did not answer a named call in time (it is stopped, or wedged in a step)."""


@dataclass
class RequestSpec:
    prompt: str | list[int] | list[Segment]  # a list of Segments is a span layout
    params: SamplingParams
    request_id: str
    namespace: str = ""
    policy: str | None = None  # None = the engine's default policy
    tenant: str = ""  # who sent it: fair admission across tenants


class RequestStream:
    """Consumer side of one request: async-iterates the latest RequestOutput per step.

    Outputs carry cumulative text/tokens/logprobs, so when the consumer falls behind it skips
    to the newest one instead of replaying every step: a slow client costs no memory growth."""

    def __init__(self, request_id: str, owner: "EngineClient"):
        self.request_id = request_id
        self._owner = owner
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _push(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
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
            self._owner.abort(self.request_id)


@dataclass
class _Track:
    """A request's output as the client builds it from the core's deltas."""

    stream: RequestStream
    prompt: list[int]
    params: SamplingParams
    text: OutputText
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)

    def apply(self, d: Delta) -> tuple[RequestOutput, bool]:
        """The output after delta d, and whether it ended here though the core goes on (a stop
        string: the core must be told to abort it)."""
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.metrics:
            self.metrics.update(d.metrics)
        if self.token_ids == [] and d.token_ids:
            self.metrics["ttft"] = time.monotonic() - self.arrival
        lps = d.logprobs or []
        stop: Stop | None = None
        for i, tok in enumerate(d.token_ids):
            self.token_ids.append(tok)
            if self.params.logprobs is not None:
                self.logprobs.append(lps[i] if i < len(lps) else None)
            last = d.finish_reason is not None and i == len(d.token_ids) - 1
            core_stop = Stop(d.finish_reason, d.stop_reason, d.by or "") if last else None
            stop = self.text.add(self.token_ids, core_stop)
            if stop is not None:
                break
        if stop is None and d.finish_reason is not None:  # an abort, or finished without a new token
            stop = Stop(d.finish_reason, d.stop_reason, d.by or "")
        ended_here = stop is not None and stop.by == "string" and d.finish_reason is None
        return self._output(stop), ended_here

    def _output(self, stop: Stop | None) -> RequestOutput:
        return RequestOutput(
            request_id=self.stream.request_id, prompt_token_ids=self.prompt, text=self.text.text,
            token_ids=list(self.token_ids), finished=stop is not None,
            finish_reason=None if stop is None else stop.reason, stop_reason=None if stop is None else stop.stop_reason,
            logprobs=list(self.logprobs) if self.params.logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs, metrics=dict(self.metrics))


class Transport(ABC):
    """Carries inputs to an engine core and its outputs back (engine/core.py's `serve` on the
    other side). `start` calls `on_output` on the loop's thread for every output, and `on_dead`
    once if the core stops unasked."""

    @abstractmethod
    def start(self, loop: asyncio.AbstractEventLoop, on_output: Callable[[Output], None],
              on_dead: Callable[[str], None]) -> None: ...

    @abstractmethod
    def send(self, msg: Input) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...


class EngineClient:
    """One API server's handle on the engine core."""

    def __init__(self, transport: Transport, tokenizer: Any, info: EngineInfo, max_pending: int | None = None,
                 client_id: int = 0, compile_grammar: Callable[[dict], Any] | None = None,
                 observer: EngineObserver | None = None):
        self.transport = transport
        self.tokenizer = tokenizer
        self.info = info
        self.limits = Limits(info.vocab_size, info.max_model_len, tuple(info.sink_prefix))
        self.max_pending = max_pending  # requests in flight before new ones get EngineOverloaded
        self.client_id = client_id
        self.compile_grammar = compile_grammar  # response_format -> compiled grammar (off the loop)
        self.observer = observer
        self._decode = make_decoder(tokenizer)
        self._tracks: dict[str, _Track] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._encode_lock = threading.Lock()
        self.dead: str | None = None
        self.on_death: Callable[[str], None] | None = None  # the server's: exit, or start a new core
        self.steps = 0  # the core's step count, as last heard
        self.last_heard = time.monotonic()
        self._started = False

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._started:
            raise RuntimeError("EngineClient already started")
        self._started = True
        self.transport.start(asyncio.get_running_loop(), self._on_output, self._on_dead)
        self._hello()

    def _hello(self) -> None:
        """Any call makes the core count this client among those it sends every step and every
        heartbeat to; from then on its silence means a stalled core, not an idle one."""
        self.last_heard = time.monotonic()
        self.transport.send(Call(next(self._call_ids), "info", [], self.client_id))

    async def shutdown(self) -> None:
        if self.dead is None:
            self.dead = "the engine was shut down"
        await self.transport.close()
        self._fail_all(EngineDeadError(self.dead))

    @property
    def is_alive(self) -> bool:
        return self._started and self.dead is None

    @property
    def num_pending(self) -> int:
        return len(self._tracks)

    def stalled_for(self) -> float:
        """Seconds since the core last finished a step, while requests wait on it (0 when idle)."""
        return time.monotonic() - self.last_heard if self._tracks else 0.0

    # ---- requests -------------------------------------------------------------------------
    async def add_requests(self, specs: Sequence[RequestSpec]) -> list[RequestStream]:
        """Add all of `specs` or none: a ValueError from any (bad prompt, too long, bad schema) or
        EngineOverloaded is raised here, before anything reaches the core."""
        self._check_room(len(specs))
        prepared = [self._prepare(s) for s in specs]
        await self._compile_grammars(prepared)
        self._check_room(len(specs))  # the core may have died, or others taken the room, meanwhile
        return self._send([(p, s.prompt) for p, s in zip(prepared, specs)])

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

    async def pin(self, segments: Sequence[Segment], namespace: str = "", request_id: str = "",
                  tenant: str = "") -> RequestStream:
        """Queue the encoding and pinning of plus segments, owned by `tenant`; the stream's one
        output arrives when they are cached and pinned (finish_reason "stop"), or carries the
        core's refusal (over the pin budget or the tenant's quota)."""
        if any(s.kind != "plus" for s in segments):
            raise ValueError("only plus (standalone) segments can be pinned")
        self._check_room(1)
        params = SamplingParams(max_tokens=1)
        ids, pieces = check_prompt(list(segments), params, resolve_policy("none"), self.limits, self._encode, True)
        rid = request_id or f"pin-{self.client_id}-{next(self._call_ids)}"
        (stream,) = self._send([(Prepared(rid, ids, pieces, params, namespace, "none", True, tenant=tenant), ids)])
        return stream

    def abort(self, request_id: str) -> None:
        if self._tracks.pop(request_id, None) is None:
            return
        if self.observer is not None:
            self.observer.on_abort(request_id)
        if self.is_alive:
            self.transport.send(Abort([request_id]))

    async def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """A named request to the core, answered between its steps; EngineTimeout after `timeout`
        seconds without an answer (None: wait as long as the core lives)."""
        if not self.is_alive:
            raise EngineDeadError(self.dead or "the engine is not running")
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            self.transport.send(Call(call_id, method, list(args), self.client_id))
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise EngineTimeout(f"the engine core did not answer {method!r} in {timeout} s") from None
        finally:  # answered, timed out or cancelled: a late answer finds nothing to resolve
            self._calls.pop(call_id, None)

    def _check_room(self, n: int) -> None:
        if not self.is_alive:
            raise EngineDeadError(self.dead or "the engine is not running")
        if self.max_pending is not None and len(self._tracks) + n > self.max_pending:
            raise EngineOverloaded(f"server is at capacity ({len(self._tracks)} requests in flight, limit "
                                   f"{self.max_pending}); retry later")

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; send token ids")
        with self._encode_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prepare(self, spec: RequestSpec) -> Prepared:
        policy = resolve_policy(spec.policy, resolve_policy(self.info.default_policy))
        ids, pieces = check_prompt(spec.prompt, spec.params, policy, self.limits, self._encode)
        if spec.request_id in self._tracks:
            raise ValueError(f"request id {spec.request_id!r} is already in use")
        return Prepared(spec.request_id, ids, pieces, spec.params, spec.namespace, policy.name,
                        arrival_time=time.monotonic(), tenant=spec.tenant)

    async def _compile_grammars(self, prepared: list[Prepared]) -> None:
        compiled: dict[int, Any] = {}  # the choices of a request share its format object: one compile
        for p in prepared:
            fmt = p.params.response_format
            if fmt is None:
                continue
            if self.compile_grammar is None:
                raise ValueError("response_format is not supported by this server")
            key = id(fmt)
            if key not in compiled:
                compiled[key] = await self.compile_grammar(fmt)
            p.grammar = compiled[key]

    def _send(self, items: list[tuple[Prepared, Any]]) -> list[RequestStream]:
        streams = []
        for p, _ in items:
            stream = RequestStream(p.request_id, self)
            self._tracks[p.request_id] = _Track(stream, p.token_ids, p.params, OutputText(self._decode, p.params))
            streams.append(stream)
        self.transport.send(Add([p for p, _ in items], self.client_id))
        return streams

    # ---- outputs (loop thread) ------------------------------------------------------------
    def _on_output(self, msg: Output) -> None:
        self.last_heard = time.monotonic()
        if isinstance(msg, StepOutputs):
            self.steps = msg.steps
            outs = [o for o in map(self._deliver, msg.deltas) if o is not None]
            if outs and self.observer is not None:
                try:
                    self.observer.on_outputs(outs, self.last_heard)
                except Exception:  # metrics must never take serving down
                    log.exception("engine observer failed")
        elif isinstance(msg, Reply):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(ValueError(msg.error)) if msg.error is not None else fut.set_result(msg.value)
        elif isinstance(msg, Beat):
            self.steps = msg.steps

    def _deliver(self, d: Delta) -> RequestOutput | None:
        track = self._tracks.get(d.request_id)
        if track is None:
            return None  # aborted by its consumer while the step ran
        if d.error is not None:
            del self._tracks[d.request_id]
            track.stream._push(EngineStepError(d.error) if d.by == "failed" else ValueError(d.error))
            return None
        out, ended_here = track.apply(d)
        if out.finished:
            del self._tracks[d.request_id]
            if ended_here and self.is_alive:  # a stop string: the core would go on
                self.transport.send(Abort([d.request_id]))
        track.stream._push(out)
        return out

    def _on_dead(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        log.error("engine core: %s", reason)
        self._fail_all(EngineDeadError(reason))
        if self.on_death is not None:
            self.on_death(reason)

    async def reconnect(self, transport: Transport, info: EngineInfo) -> None:
        """Continue with a new core (the old one died): requests are taken again."""
        await self.transport.close()
        self.transport, self.info = transport, info
        self.limits = Limits(info.vocab_size, info.max_model_len, tuple(info.sink_prefix))
        transport.start(asyncio.get_running_loop(), self._on_output, self._on_dead)
        self._hello()
        self.dead = None

    def _fail_all(self, error: BaseException) -> None:
        tracks, self._tracks = self._tracks, {}
        for t in tracks.values():
            t.stream._push(error)
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(error)
