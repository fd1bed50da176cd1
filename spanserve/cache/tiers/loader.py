"""Loads from the tiers below the pool, off the engine thread. The engine thread finds which of a
layout's blocks the pool lacks (a `LoadJob`), one of a few background threads asks the tiers for
them, nearest first, and the engine thread later copies what came back into free pool blocks.
Only the tier I/O runs here: the pool and the device are touched by the engine thread alone."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from spanserve.cache.tiers.base import Tier
from spanserve.cache.tiers.payload import BlockKV

log = logging.getLogger("spanserve.tiers")

# a unit as the tiers see it: (seed, full-block keys, tokens, partial tail's key, extended)
Chain = tuple[int, Sequence[int], Sequence[int], int | None, bool]
# what a missing block must be: its tokens and, for a partial tail block, the key it extends
Want = tuple[tuple[int, ...], int | None]


@dataclass(eq=False)
class LoadJob:
    """A layout's blocks missing from the pool when it was looked up, and what the tiers gave.
    `done` is set by the loader once `found` is final; `dropped` by the engine thread when the
    request went away (the loader then skips it, and nothing is installed)."""

    chains: list[Chain] = field(repr=False)
    want: dict[int, Want] = field(repr=False)  # key -> the block it must be
    serves: dict[int, int] = field(repr=False)  # key -> prompt tokens the block serves
    room: int  # free pool blocks at lookup: no point loading more
    found: list[tuple[str, BlockKV]] = field(default_factory=list, repr=False)  # (tier name, block)
    done: bool = False
    dropped: bool = False


def load_nearest(tiers: Sequence[Tier], want: dict[int, Want], room: int) -> list[tuple[str, BlockKV]]:
    """Ask each tier, nearest first, for the keys the tiers above it did not have; at most `room`
    blocks. A block whose tokens or parent differ from what is wanted is a miss (a key collision),
    as a pool hit compares them; a tier that raises is a miss for every key it was asked."""
    found: list[tuple[str, BlockKV]] = []
    left = list(want)
    for tier in tiers:
        if not left or len(found) >= room:
            break
        try:
            got = tier.load_many(left)
        except Exception:  # a tier must not raise; if one does, its blocks are holes
            log.exception("KV tier %s failed to load %d blocks; computing them", tier.name, len(left))
            tier.stats.add(errors=1)
            continue
        rest = []
        for k, b in zip(left, got):
            if b is not None and (b.tokens, b.parent) == want[k]:
                found.append((tier.name, b))
            else:
                rest.append(k)
        left = rest
    return found[:room]


class Loader:
    """A few background threads running load jobs, taken in submission order: one slow load (a
    store at its timeout, a long disk read) does not hold up the requests behind it."""

    def __init__(self, tiers: Sequence[Tier], threads: int = 4):
        self.tiers = list(tiers)
        self._jobs: queue.SimpleQueue[LoadJob | None] = queue.SimpleQueue()
        self._landed = threading.Condition()
        self._threads = [threading.Thread(target=self._run, name=f"spanserve-kv-load-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, job: LoadJob) -> None:
        self._jobs.put(job)

    def wait_any(self, jobs: Sequence[LoadJob], timeout: float) -> bool:
        """Sleep until one of `jobs` is done (True) or `timeout` seconds pass (False)."""
        with self._landed:
            return self._landed.wait_for(lambda: any(j.done for j in jobs), timeout)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            found: list[tuple[str, BlockKV]] = []
            if not job.dropped:
                try:
                    found = load_nearest(self.tiers, job.want, job.room)
                except Exception:  # never leave a request waiting on a job that died
                    log.exception("KV tier load failed; computing %d blocks", len(job.want))
            with self._landed:
                job.found, job.done = found, True
                self._landed.notify_all()

    def close(self, timeout: float = 30.0) -> None:
        """Stop after the jobs queued so far (a tier's loads are bounded by its own timeouts)."""
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
