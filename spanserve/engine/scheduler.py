"""Continuous batching with a per-step token budget, chunked prefill and preemption by recompute.
A waiting request whose blocks are being loaded from the tiers below the pool keeps its place in
the queue while the requests behind it are admitted. Tenants are admitted in turn
(engine/fairness.py); while several tenants run, decode rows go first and the rest of the
budget is split fairly between tenants' prefills."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from spanserve.cache.claim import Task
from spanserve.cache.manager import CacheManager
from spanserve.cache.tiers.loader import LoadJob
from spanserve.engine.fairness import WaitQueue, fair_shares
from spanserve.engine.request import Request, Status

LOAD_WAIT_S = 0.02  # longest sleep on tier loads before looking at new requests and aborts again
# A full batch admits newcomers in groups of max_num_seqs // ADMIT_GROUPS rows (a step that
# prefills is an eager step, several times a decode step's cost, and ends a chain of decode steps
# on the device: one such step for a group, not one per finished request), or once the first of
# them has waited ADMIT_WAIT_STEPS steps.
ADMIT_GROUPS = 16
ADMIT_WAIT_STEPS = 16


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
        self.waiting = WaitQueue()
        self.running: list[Request] = []
        self._running_tenants: Counter[str] = Counter()  # running requests per tenant
        self.loading: dict[str, LoadJob] = {}  # waiting requests whose tier loads are in flight, by id
        self.blocked: Request | None = None  # the waiting request the last pass could not admit
        self.admit_group = max(1, max_num_seqs // ADMIT_GROUPS)
        self._held = 0  # passes in a row that held back admissions for a group

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admits_now(self) -> bool:
        """Whether the next pass may admit waiting requests: with room for a group of them, with
        nothing running, or after holding them back ADMIT_WAIT_STEPS passes."""
        room = self.max_num_seqs - len(self.running)
        return room > 0 and (room >= self.admit_group or not self.running or self._held >= ADMIT_WAIT_STEPS)

    def schedule(self) -> Schedule:
        out = Schedule()
        newcomers = self._newcomers()
        fair = len(self._running_tenants) > 1 or bool(newcomers)
        budget = self._run_fair(out, newcomers) if fair else self._run_in_order(out)
        self.blocked = None
        room = self.max_num_seqs - len(self.running)
        if self.waiting and 0 < room and not self.admits_now():
            self._held += 1  # held back for a group (room < admit_group)
            return out
        self._held = 0
        for req in self.waiting.walk():  # those waiting on their loads keep their place; the rest go on
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            job = self.loading.get(req.request_id)
            if (job is not None and not job.done) or not self.admit(req):
                if req.request_id in self.loading:
                    continue
                self.blocked = req
                break
            self.waiting.take(req)
            req.status = Status.RUNNING
            self.running.append(req)
            self._running_tenants[req.tenant] += 1
            budget -= self._take(req, budget, out)
        return out

    def _run_in_order(self, out: Schedule) -> int:
        """The running requests' chunks, in the order they were admitted; the budget left."""
        budget = self.max_num_batched_tokens
        for req in list(self.running):
            if budget <= 0:
                break
            if self._grow(req, out):
                budget -= self._take(req, budget, out)
        return budget

    def _newcomers(self) -> dict[str, int]:
        """Tenants with nothing running whose next request could be admitted now, and its prompt
        length: what they would prefill if admitted. Empty with nothing running (the whole
        budget is for admissions) or no room to admit."""
        room = self.max_num_seqs - len(self.running)
        if not self.running or room <= 0 or self.blocked is not None:
            return {}
        out: dict[str, int] = {}
        for tenant, head in self.waiting.heads():
            if tenant not in self._running_tenants and head.request_id not in self.loading:
                out[tenant] = len(head.prompt_token_ids) + len(head.output_token_ids)
                if len(out) == room:
                    break
        return out

    def _run_fair(self, out: Schedule, newcomers: dict[str, int]) -> int:
        """Several tenants have work: decode rows first, then each running tenant's prefills
        within its fair share of what is left; the shares of tenants about to be admitted stay
        in the budget for them, so that one tenant's long prompts starve no other's."""
        budget = self.max_num_batched_tokens
        todo = {id(r): sum(len(t.todo) for t in r.tasks) for r in self.running}
        decoding = [r for r in self.running if todo[id(r)] <= 1]
        prefill = [r for r in self.running if todo[id(r)] > 1]
        for req in decoding:
            if budget <= 0:
                break
            if self._grow(req, out):
                budget -= self._take(req, budget, out)
        demand: Counter[str] = Counter(newcomers)
        for r in prefill:
            demand[r.tenant] += todo[id(r)]
        shares = fair_shares(dict(demand), budget)
        for req in prefill:
            share = min(shares[req.tenant], budget)
            if share <= 0 or not self._grow(req, out):
                continue
            used = self._take(req, share, out)
            shares[req.tenant] -= used
            budget -= used
        return budget

    def _grow(self, req: Request, out: Schedule) -> bool:
        """Room for the request's next tokens, preempting the latest admitted requests (itself,
        at worst) until there is; False when it is not running (now, or since earlier this pass)."""
        if req.status is not Status.RUNNING:
            return False
        while not self.manager.ensure_capacity(req.kv):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

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
        self._leave_running(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self._leave_running(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        job = self.loading.pop(req.request_id, None)
        if job is not None:  # its loads are dropped: nothing was installed for it yet
            self.manager.drop_loads(job)
        self.manager.release(req.kv)
        req.status = Status.FINISHED

    def _leave_running(self, req: Request) -> None:
        self.running.remove(req)
        self._running_tenants[req.tenant] -= 1
        if not self._running_tenants[req.tenant]:
            del self._running_tenants[req.tenant]
