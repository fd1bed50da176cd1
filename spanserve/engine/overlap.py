"""Decode steps chained on the device: the host schedules and launches step k+1 while the GPU still
runs step k, whose picked tokens reach the host only after k+1 is queued behind it.

At batch 1 a decode step's host work (scheduling, the step's host arrays, under tensor parallelism
the step message to the workers, sampling, stop checks, detokenizing) is a tenth to a quarter of the
GPU's time for an 8B model; done between steps, the GPU waits for it every step. Chained, it runs
while the GPU works. Step k+1's input ids are step k's picks, copied on the device (and broadcast
from the driver to every rank under TP); the request holds a placeholder for that token on the
host until the picks arrive.

A request chains only when nothing about its next pick needs this token on the host first: no
penalties (their histories would lack it), no structured output (its grammar must advance), and
its first token already out (that step also snapshots the prompt). Logprobs are computed on the
device with the picks and reach the host with them. A request that a
pick may stop (EOS, a stop string) costs at most one wasted row of one step: its KV slot for the
row is its own, and the step that computed it is ordered before any later user of the slot."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from spanserve.attention.paths import StepPath

if TYPE_CHECKING:
    from spanserve.engine.engine import LLMEngine
    from spanserve.engine.outputs import RequestOutput
    from spanserve.engine.request import Request
    from spanserve.engine.runner import StepInput
    from spanserve.engine.sampling import LogprobTensors
    from spanserve.engine.scheduler import Chunk


class HostTokens:
    """Token ids picked on the device (and any tensors that go with them) on their way to the
    host: the copies are queued behind the step that picks them, and `lists` waits for them only
    when the host needs them."""

    def __init__(self, ids: torch.Tensor, *extra: torch.Tensor):
        self.device_ids = ids
        self._done: torch.cuda.Event | None = None
        self._host = [ids, *extra]
        if ids.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (ids, *extra)]
            for h, t in zip(self._host, (ids, *extra)):
                h.copy_(t, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()

    def lists(self) -> list[list]:
        """The ids, then each extra tensor, as lists."""
        if self._done is not None:
            self._done.synchronize()
        return [t.tolist() for t in self._host]

    def rows(self, index: list[int]) -> torch.Tensor:
        """The picks of these rows, in this order, on the device."""
        if index == list(range(self.device_ids.numel())):
            return self.device_ids
        return self.device_ids[torch.tensor(index, dtype=torch.long, device=self.device_ids.device)]


@dataclass
class Pending:
    """A decode step on the device whose picks the host has not seen."""

    sampled: list[tuple["Request", int]]  # each sampled request and its row in the picks
    picks: HostTokens  # with the logprob tensors, if any row asked for logprobs
    started: float  # perf_counter when the step was scheduled
    keys: int  # keys attended over the batch (decode statistics)
    logprobs: "LogprobTensors | None" = None

    def index_of(self, requests: list["Request"]) -> list[int]:
        row = {id(r): i for r, i in self.sampled}
        return [row[id(r)] for r in requests]


def chains(req: "Request", structured: bool) -> bool:
    """Whether the request's next pick may be made before the host sees its current one."""
    p = req.params
    return (not structured and not req.encode_only and bool(req.output_token_ids)
            and p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1)


def may_continue(req: "Request", max_model_len: int) -> bool:
    """False when the token in flight is the request's last by length: nothing follows it."""
    return (len(req.output_token_ids) + 1 < req.params.max_tokens
            and len(req.main.tokens) + 1 < max_model_len)


def place_holder(req: "Request") -> None:
    """What appending the token in flight does, without its value."""
    main = req.main
    main.tokens.append(0)
    main.todo.append(len(main.tokens) - 1)
    req.token_in_flight = True


def drop_placeholder(req: "Request") -> None:
    """The token in flight will not be the request's (it is aborted): its row ends before it."""
    main = req.main
    main.tokens.pop()
    if main.todo and main.todo[-1] == len(main.tokens):
        main.todo.pop()
    req.token_in_flight = False


class DecodeChain:
    """The engine's decode steps chained on the device: at most one step in flight (`pending`).
    The engine supplies its scheduler, runner and sampler, and takes the picks in (`take`)."""

    def __init__(self, engine: "LLMEngine"):
        self.engine = engine
        self.pending: Pending | None = None
        self.steps = 0  # steps launched before the host saw the previous one's picks
        self._settled_at = 0.0

    def chainable(self, chunks: list["Chunk"], prepared: "StepInput") -> bool:
        """Whether this step's picks may stay on the device for the next step to read."""
        eng = self.engine
        return (prepared.path is StepPath.DECODE_GRAPH and all(i >= 0 for i in prepared.sample_at)
                and all(chains(c.request, eng.structured(c.request)) for c in chunks)
                and any(may_continue(c.request, eng.max_model_len) for c in chunks))

    def launch(self, chunks: list["Chunk"], logits: torch.Tensor, rows: list[int], t0: float,
               settle: Pending | None = None) -> list["RequestOutput"]:
        """Picks this step's tokens on the device, settles the step before it (if any) while this
        one runs, then gives every request that goes on a placeholder for its pick."""
        eng = self.engine
        sampled = [(c.request, r) for c, r in zip(chunks, rows)]
        params = [q.params for q, _ in sampled]
        picks = eng.sampler.pick(logits, params, [q.generator for q, _ in sampled])
        lt = eng.sampler.logprob_tensors(logits, params, picks)
        pending = Pending(sampled, HostTokens(picks, *(lt.tensors() if lt is not None else ())), t0,
                          sum(c.positions[0] + 1 for c in chunks), lt)
        outputs = self.settle(settle) if settle is not None else []
        for req, _ in sampled:
            if not req.finished and may_continue(req, eng.max_model_len):
                place_holder(req)
        self.pending = pending
        return outputs

    def _next_is_chained(self) -> bool:
        """The next step is exactly the placeholders' decode rows: nothing waits to be admitted,
        every running request with work has a placeholder, and no one can be preempted (each
        needs one block at most)."""
        sched = self.engine.scheduler
        running = sched.running
        return (not sched.waiting and self.engine.pool.num_free >= len(running)
                and any(r.token_in_flight for r in running)
                and all(r.token_in_flight or not any(t.todo for t in r.tasks) for r in running))

    def step(self) -> list["RequestOutput"]:
        """The engine's step while a step is in flight: the next one chained behind it, or (when
        the batch changes) the host catching up first."""
        pending, self.pending = self.pending, None
        assert pending is not None
        eng = self.engine
        if not self._next_is_chained():
            return self.settle(pending)
        t0 = time.perf_counter()
        sched = eng.scheduler.schedule()
        chunks = sched.chunks
        prepared = eng.runner.prepare(chunks) if chunks else None
        if (prepared is None or sched.preempted or prepared.path is not StepPath.DECODE_GRAPH
                or not all(c.request.token_in_flight and i >= 0 for c, i in zip(chunks, prepared.sample_at))):
            outputs = self.settle(pending)  # not one chained step after all: the host goes first
            sched.chunks = [c for c in chunks if not c.request.finished]
            return outputs + (eng.run_schedule(sched, t0) if sched.chunks else [])
        prepared.chained = True
        self.steps += 1
        ids = pending.picks.rows(pending.index_of([c.request for c in chunks]))
        logits, rows = eng.runner.run_chained(chunks, prepared, ids)
        return self.launch(chunks, logits, rows, t0, settle=pending)

    def settle(self, pending: Pending) -> list["RequestOutput"]:
        """The host takes in a chained step's picks: each becomes its request's token."""
        eng = self.engine
        tokens, *extra = eng.runner.fetch(pending.picks)
        now = time.perf_counter()
        eng.decode_stats.record(len(pending.sampled), pending.keys, now - max(pending.started, self._settled_at))
        self._settled_at = now
        lps: list = [None] * len(tokens)
        if pending.logprobs is not None:
            lps = pending.logprobs.build([q.params for q, _ in pending.sampled], tokens, *extra)
        return eng.take([(req, tokens[i], lps[i]) for req, i in pending.sampled if not req.finished])  # not aborted
