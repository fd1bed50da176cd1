"""The interface every tier below the block pool speaks: batched, by chain key, never raising
on a miss or a fault (a block a tier cannot give back is a hole the engine computes)."""
from __future__ import annotations

import bisect
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from spanserve.cache.tiers.payload import BlockKV

LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class TierStats:
    """Cumulative counters of one tier. Written under `lock` by the engine thread (loads) and the
    write-back thread (stores); read whole by a metrics scrape."""

    hits: int = 0  # blocks found by load_many
    misses: int = 0  # blocks asked for and not found (bad payloads included)
    bytes_in: int = 0  # stored into the tier
    bytes_out: int = 0  # loaded from the tier
    bad_payloads: int = 0  # truncated, failed checksum, shape, model or key checks: treated as misses
    auth_failures: int = 0  # failed the MAC (forged, altered, another secret's or key's): misses too
    errors: int = 0  # batches that failed (store unreachable, timed out)
    evictions: int = 0  # blocks the tier dropped to stay within its size
    load_buckets: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    load_sum: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def loaded(self, hits: int, misses: int, nbytes: int, seconds: float) -> None:
        with self.lock:
            self.hits += hits
            self.misses += misses
            self.bytes_out += nbytes
            self.load_buckets[bisect.bisect_left(LOAD_BUCKETS, seconds)] += 1
            self.load_sum += seconds

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict:
        with self.lock:
            return {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items() if k != "lock"}


class Tier(ABC):
    """A store of full KV blocks keyed by their chain keys (which already cover namespace and
    everything that shapes a block's KV; the model's identity is in each tier's key space)."""

    name: str
    # contains_many is a network round trip: never asked on the engine thread (a local tier's
    # index is in memory, so the engine asks it whether a load is worth starting at all)
    remote: bool = False

    def __init__(self) -> None:
        self.stats = TierStats()

    @abstractmethod
    def contains_many(self, keys: Sequence[int]) -> np.ndarray:
        """bool per key: the tier holds a block under it (a later load may still miss)."""

    @abstractmethod
    def load_many(self, keys: Sequence[int]) -> list[BlockKV | None]:
        """The blocks under `keys`, None where absent, unreadable or bad."""

    @abstractmethod
    def store_many(self, blocks: Sequence[BlockKV]) -> list[BlockKV]:
        """Keep `blocks` (best effort); returns the blocks evicted to make room, for a lower tier."""

    def close(self) -> None:
        """Release what the tier holds open (connections, files)."""
