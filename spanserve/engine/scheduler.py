"""Continuous batching with a per-step token budget, chunked prefill and preemption by recompute."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from spanserve.cache.claim import Task
from spanserve.cache.manager import CacheManager
from spanserve.engine.request import Request, Status


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
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.admit(req):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            budget -= self._take(req, budget, out)
        return out

    def admit(self, req: Request) -> bool:
        """Admit a waiting request into the cache; False (nothing changed) when it does not fit."""
        kv = self.manager.admit(req.admission())
        if kv is None:
            return False
        req.hold(kv)
        return True

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
                out.chunks.append(Chunk(req, task, task.todo[:n], task.recompute))
                task.recompute = None  # decodes that follow read the private KV as it is
                del task.todo[:n]
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
        self.manager.release(req.kv)
        req.status = Status.FINISHED
