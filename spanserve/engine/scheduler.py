"""Continuous batching with a per-step token budget, chunked prefill and preemption by recompute.
A waiting request whose blocks are being loaded from the tiers below the pool keeps its place in
the queue while the requests behind it are admitted."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from spanserve.cache.claim import Task
from spanserve.cache.manager import CacheManager
from spanserve.cache.tiers.loader import LoadJob
from spanserve.engine.request import Request, Status

LOAD_WAIT_S = 0.02  # longest sleep on tier loads before looking at new requests and aborts again


@dataclass
class Chunk:
    request: Request
    task: Task
    positions: list[int]  # row-space positions computed this step, ascending
    recompute: Any = None  # reuse.recompute.RecomputeSpec for the one forward that recomputes


@dataclass
class Schedule:
    chunks: list[Chunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, manager: CacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, LoadJob] = {}  # waiting requests whose tier loads are in flight, by id
        self.blocked: Request | None = None  # the waiting request the last pass could not admit

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Schedule:
        out = Schedule()
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this pass
            while not self.manager.ensure_capacity(req.kv):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                budget -= self._take(req, budget, out)
        self.blocked = None
        i = 0  # requests before it wait on their loads: they keep their place, the rest go on
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[i]
            job = self.loading.get(req.request_id)
            if (job is not None and not job.done) or not self.admit(req):
                if req.request_id in self.loading:
                    i += 1
                    continue
                self.blocked = req
                break
            del self.waiting[i]
            req.status = Status.RUNNING
            self.running.append(req)
            budget -= self._take(req, budget, out)
        return out

    def admit(self, req: Request) -> bool:
        """Admit a waiting request into the cache; False (nothing changed) when it does not fit,
        or when its missing blocks are now being loaded from the tiers below the pool (it is then
        in `loading` until they land, and is admitted with them)."""
        job = self.loading.pop(req.request_id, None)
        adm = req.admission()
        kv = self.manager.admit(adm) if job is None else self.manager.admit(adm, job)
        if isinstance(kv, LoadJob):
            self.loading[req.request_id] = kv
            return False
        if kv is None:
            return False
        req.hold(kv)
        return True

    def stuck(self) -> Request | None:
        """With nothing running, the waiting request that cannot be admitted even so (the pool is
        as free as it gets): the engine fails it rather than hang."""
        if self.running or not self.waiting:
            return None
        if self.blocked is not None:
            return self.blocked
        return None if self.loading else self.waiting[0]

    def wait_for_loads(self, timeout: float = LOAD_WAIT_S) -> None:
        """Nothing to run but requests waiting on tier loads: sleep until one lands (or briefly,
        so new requests and aborts are seen), rather than spin."""
        if self.loading:
            self.manager.wait_loads(list(self.loading.values()), timeout)

    def _take(self, req: Request, budget: int, out: Schedule) -> int:
        used = 0
        for task in req.tasks:
            if not task.todo:  # done (a decoding request's segment tasks all are)
                continue
            if used >= budget:
                break
            n = min(len(task.todo), budget - used)
            if task.recompute is not None and task.todo:
                # a policy decides from the whole prompt at once: never split its forward
                if n < len(task.todo) and used:
                    break
                n = len(task.todo)
            if n:
                positions, spec = task.take(n)
                out.chunks.append(Chunk(req, task, positions, spec))
                used += n
        return used

    def _preempt(self, req: Request, out: Schedule) -> None:
        self.manager.release(req.kv)
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        job = self.loading.pop(req.request_id, None)
        if job is not None:  # its loads are dropped: nothing was installed for it yet
            self.manager.drop_loads(job)
        self.manager.release(req.kv)
        req.status = Status.FINISHED
