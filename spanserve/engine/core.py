"""The engine core: an LLMEngine behind a message boundary (engine/wire.py), stepping in a busy
loop. Its clients (engine/client.py) tokenize, check, detokenize and stream; the core only
queues checked requests, steps, and sends what each step gave. It runs on a thread of the API
server's process (`InprocTransport`: the structs are handed over as they are) or in a process of
its own (`engine/core_process.py`: the same structs as msgpack over ZeroMQ)."""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import asdict
from typing import Any, Callable

import msgspec

from spanserve.engine.engine import LLMEngine
from spanserve.engine.request import Request
from spanserve.engine.wire import Abort, Add, Beat, Call, Delta, Input, Output, Reply, Shutdown, StepOutputs

log = logging.getLogger("spanserve.core")

Sent = list[tuple[int, Output]]  # (client, message) pairs


class EngineInfo(msgspec.Struct):
    """What a client needs to know of the engine to check requests for it."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    sink_prefix: list[int]
    default_policy: str
    eos_token_ids: list[int]


def metrics_of(req: Request, last: bool) -> dict[str, Any]:
    m: dict[str, Any] = {"prompt_tokens": len(req.prompt_token_ids), "cached_tokens": req.num_cached_tokens,
                         "reuse": dict(req.reuse)}
    if last:
        m.update(preemptions=req.num_preemptions, recompute=dict(req.recompute_stats))
    return m


class EngineCore:
    def __init__(self, engine: LLMEngine):
        engine.detokenize = False  # the clients detokenize and check stop strings
        self.engine = engine
        self.steps = 0
        self.clients: set[int] = set()
        self._sent: dict[str, int] = {}  # request id -> output tokens already sent
        self._owner: dict[str, int] = {}  # request id -> the client its outputs go to

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def info(self) -> EngineInfo:
        e = self.engine
        return EngineInfo(e.config.vocab_size, e.max_model_len, e.block_size, e.pool.num_blocks, list(e.sink_prefix),
                          e.default_policy.name, sorted(e.eos_token_ids))

    # ---- inputs ---------------------------------------------------------------------------
    def handle(self, msg: Input) -> Sent:
        """What to send in answer to one input. An input the core cannot take is refused (and
        logged), never raised: a client's bug must not stop the core that every client shares."""
        if isinstance(msg, Add):
            return self._add(msg)
        if isinstance(msg, Abort):
            for rid in msg.request_ids:
                self._forget(rid)
                self._abort(rid)
            return []
        if isinstance(msg, Call):
            self.clients.add(msg.client)
            return [(msg.client, self._call(msg))]
        log.error("dropped an input that is not an engine core input: %r", msg)
        return []

    def _add(self, msg: Add) -> Sent:
        self.clients.add(msg.client)
        failed = []
        for p in msg.requests:
            try:
                self.engine.add_prepared(p)
            except Exception as e:  # ValueError: checked by the client, a race (a full pin budget, say)
                refused = isinstance(e, ValueError)
                if not refused:  # a bug: the client hears of it as a failed step
                    log.exception("request %r could not be queued", p.request_id)
                    self._abort(p.request_id)  # whatever of it was queued
                failed.append(Delta(p.request_id, finish_reason="abort", by="error" if refused else "failed",
                                    error=_message(e)))
                continue
            self._owner[p.request_id] = msg.client
        return [(msg.client, StepOutputs(failed, self.steps))] if failed else []

    def _abort(self, rid: str) -> None:
        try:
            self.engine.abort(rid)
        except Exception:
            log.exception("aborting request %r failed", rid)

    def _call(self, msg: Call) -> Reply:
        fn = CALLS.get(msg.method)
        if fn is None:
            return Reply(msg.call_id, error=f"the engine core has no call {msg.method!r}; it has {sorted(CALLS)}")
        try:
            return Reply(msg.call_id, fn(self, *msg.args))
        except Exception as e:  # ValueError/TypeError: bad arguments; anything else is a bug, logged
            if not isinstance(e, (ValueError, TypeError)):
                log.exception("engine core call %r failed", msg.method)
            return Reply(msg.call_id, error=_message(e))

    # ---- steps ----------------------------------------------------------------------------
    def step(self) -> Sent:
        reqs = self.engine.advance()
        self.steps += 1
        by_client: dict[int, list[Delta]] = defaultdict(list)
        for req in reqs:
            client = self._owner.get(req.request_id)
            if client is not None and (req.finished or len(req.output_token_ids) > self._sent.get(req.request_id, 0)):
                by_client[client].append(self._delta(req))  # not a prefill chunk that sampled nothing
        # every client hears of every step (with nothing, when none of its requests gained a
        # token): its heartbeat while long prefills run
        return [(c, StepOutputs(by_client.get(c, []), self.steps)) for c in self.clients]

    def _delta(self, req: Request) -> Delta:
        rid = req.request_id
        sent = self._sent.get(rid, 0)
        new = req.output_token_ids[sent:]
        d = Delta(rid, new)
        if req.params.logprobs is not None:
            d.logprobs = req.logprobs[sent:]
        first = rid not in self._sent
        if first:
            d.prompt_logprobs = req.prompt_logprobs
        if req.finished:
            d.finish_reason, d.stop_reason, d.by = req.finish_reason, req.stop_reason, req.stopped_by
            self._forget(rid)
        else:
            self._sent[rid] = sent + len(new)
        if first or req.finished:
            d.metrics = metrics_of(req, req.finished)
        return d

    def _forget(self, rid: str) -> None:
        self._sent.pop(rid, None)
        self._owner.pop(rid, None)

    def fail_all(self, error: str) -> Sent:
        """A step raised: every request in flight is aborted, and its client told why."""
        by_client: dict[int, list[Delta]] = defaultdict(list)
        for rid, client in list(self._owner.items()):
            self.engine.abort(rid)
            self._forget(rid)
            by_client[client].append(Delta(rid, finish_reason="abort", by="failed", error=error))
        return [(c, StepOutputs(d, self.steps)) for c, d in by_client.items()]

    def beats(self) -> Sent:
        return [(c, Beat(self.steps)) for c in self.clients]


def _message(e: Exception) -> str:
    return str(e) if isinstance(e, (ValueError, TypeError)) else f"{type(e).__name__}: {e}"


def _unpin(core: EngineCore, key: str, namespace: str = "") -> bool:
    return core.engine.unpin(key, namespace)


def _stats(core: EngineCore) -> dict[str, Any]:
    """Plain numbers for the metrics page: pool, queues, pins, counters, decode steps, tiers."""
    e = core.engine
    pool = e.pool
    return {"blocks_total": pool.num_blocks, "blocks_free": pool.num_free, "blocks_cached": pool.num_cached,
            "block_size": e.block_size, "running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
            "max_num_seqs": e.scheduler.max_num_seqs,
            "pinned_segments": e.pins.num_segments, "pinned_blocks": e.pins.num_blocks_held,
            "counters": dict(e.counters), "steps": core.steps,
            "decode": {b: asdict(t) for b, t in e.decode_stats.snapshot().items()},
            "tiers": e.tiers.stats() if e.tiers is not None else None}


CALLS: dict[str, Callable[..., Any]] = {
    "info": EngineCore.info,
    "unpin": _unpin,
    "stats": _stats,
}


def serve(core: EngineCore, receive: Callable[[float | None], list[Input]], send: Callable[[int, Output], None],
          beat_s: float = 0.5) -> None:
    """The busy loop: take every waiting input, step while there is work, send each step's
    outputs; idle, wait for input (sending a heartbeat every beat_s). Returns on Shutdown."""
    while True:
        msgs = receive(0.0 if core.busy else beat_s)
        for msg in msgs:
            if isinstance(msg, Shutdown):
                return
            for client, out in core.handle(msg):
                send(client, out)
        if core.busy:
            try:
                sent = core.step()
            except Exception as e:  # the step's requests cannot go on; serving can
                log.exception("engine step failed; aborting the requests in flight")
                sent = core.fail_all(f"engine step failed: {type(e).__name__}: {e}")
            for client, out in sent:
                send(client, out)
        elif not msgs:
            for client, out in core.beats():
                send(client, out)
