"""Fairness across tenants: the waiting requests as one line per tenant, admitted in turn, and
the split of a step's token budget between tenants' prefills.

Tenants take turns in a ring. A pass of the scheduler offers, round by round, the next request
of each tenant in ring order (round r: the r-th request of each line as the pass began), so
one tenant's thousand queued requests put at most one of theirs before another tenant's first.
A tenant whose request is admitted goes to the back of the ring: the next pass starts with
those not served since. A tenant whose line was empty joins at the back; a preempted request
goes first in its tenant's line, and a tenant that had no line joins the ring at the front (it
had been admitted already). With one tenant this is exactly first-in first-out."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spanserve.engine.request import Request


class WaitQueue:
    def __init__(self) -> None:
        self._lines: dict[str, deque[Request]] = {}
        self._ring: deque[str] = deque()  # tenants with waiting requests, the next to serve first
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __contains__(self, req: object) -> bool:
        line = self._lines.get(getattr(req, "tenant", ""))
        return line is not None and any(r is req for r in line)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in the order the next pass would offer them."""
        lines = [self._lines[t] for t in self._ring]
        for r in range(max(map(len, lines), default=0)):
            for line in lines:
                if r < len(line):
                    yield line[r]

    def __getitem__(self, i: int) -> Request:
        for k, req in enumerate(self):
            if k == i:
                return req
        raise IndexError(i)

    def heads(self) -> Iterator[tuple[str, Request]]:
        """Each tenant with waiting requests and its first, in ring order."""
        for t in self._ring:
            yield t, self._lines[t][0]

    def append(self, req: Request) -> None:
        self._line(req.tenant, front=False).append(req)
        self._n += 1

    def appendleft(self, req: Request) -> None:
        """A preempted request: first in its tenant's line."""
        self._line(req.tenant, front=True).appendleft(req)
        self._n += 1

    def remove(self, req: Request) -> None:
        line = self._lines[req.tenant]
        del line[_index(line, req)]
        self._n -= 1
        if not line:
            del self._lines[req.tenant]
            self._ring.remove(req.tenant)

    def take(self, req: Request) -> None:
        """`req` is admitted: it leaves its line, and its tenant goes to the back of the ring."""
        self.remove(req)
        if req.tenant in self._lines:
            self._ring.remove(req.tenant)
            self._ring.append(req.tenant)

    def walk(self) -> Iterator[Request]:
        """One pass: requests in turn. A request the consumer passes over (does not `take`)
        keeps its place; the walk goes on with its tenant's next one in the next round."""
        skipped: dict[str, int] = {}  # per tenant: requests passed over this pass (kept at the front)
        active = list(self._ring)
        while active:
            again = []
            for t in active:
                line = self._lines.get(t)
                i = skipped.get(t, 0)
                if line is None or i >= len(line):
                    continue
                req = line[i]
                yield req
                if i < len(line) and line[i] is req:  # not taken
                    skipped[t] = i + 1
                again.append(t)
            active = again

    def _line(self, tenant: str, front: bool) -> deque[Request]:
        line = self._lines.get(tenant)
        if line is None:
            line = self._lines[tenant] = deque()
            if front:
                self._ring.appendleft(tenant)
            else:
                self._ring.append(tenant)
        return line


def _index(line: deque[Request], req: Request) -> int:
    for i, r in enumerate(line):  # by identity: the scan stops early (taken requests sit near the front)
        if r is req:
            return i
    raise ValueError(f"request {req.request_id!r} is not waiting")


def fair_shares(demands: dict[str, int], budget: int) -> dict[str, int]:
    """Max-min fair split of `budget` tokens: no tenant gets more than it asks, and none that
    asks for more gets less than any other; left-over single tokens go to the first tenants
    (in the dict's order) that still want more."""
    alloc = dict.fromkeys(demands, 0)
    active = [t for t, d in demands.items() if d > 0]
    left = max(budget, 0)
    while left > 0 and active:
        share = left // len(active)
        if share == 0:
            for t in active[:left]:
                alloc[t] += 1
            break
        for t in active:
            give = min(share, demands[t] - alloc[t])
            alloc[t] += give
            left -= give
        active = [t for t in active if alloc[t] < demands[t]]
    return alloc
