"""Host-memory tier: blocks as tensors (pinned on CUDA, so a load is a plain async copy), LRU
within a byte budget; what it evicts goes to the tier below."""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
import threading

import numpy as np

from spanserve.cache.tiers.base import Tier
from spanserve.cache.tiers.payload import BlockKV, BlockShape


class HostTier(Tier):
    name = "host"

    def __init__(self, capacity_bytes: int, shape: BlockShape):
        super().__init__()
        if capacity_bytes < shape.kv_bytes:
            raise ValueError(f"host KV tier of {capacity_bytes} bytes cannot hold one block ({shape.kv_bytes} bytes)")
        self.capacity = capacity_bytes // shape.kv_bytes  # in blocks: every block is the same size
        self.shape = shape
        self._blocks: OrderedDict[int, BlockKV] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def contains_many(self, keys: Sequence[int]) -> np.ndarray:
        with self._lock:
            return np.fromiter((k in self._blocks for k in keys), bool, len(keys))

    def load_many(self, keys: Sequence[int]) -> list[BlockKV | None]:
        t0 = time.perf_counter()
        out: list[BlockKV | None] = []
        with self._lock:
            for k in keys:
                b = self._blocks.get(k)
                if b is not None:
                    self._blocks.move_to_end(k)
                out.append(b)
        hits = sum(b is not None for b in out)
        self.stats.loaded(hits, len(keys) - hits, hits * self.shape.kv_bytes, time.perf_counter() - t0)
        return out

    def store_many(self, blocks: Sequence[BlockKV]) -> list[BlockKV]:
        evicted: list[BlockKV] = []
        with self._lock:
            for b in blocks:
                if b.key in self._blocks:
                    self._blocks.move_to_end(b.key)
                    continue
                self._blocks[b.key] = b
                if len(self._blocks) > self.capacity:
                    evicted.append(self._blocks.popitem(last=False)[1])
        self.stats.add(bytes_in=len(blocks) * self.shape.kv_bytes, evictions=len(evicted))
        return evicted

    def drain(self) -> list[BlockKV]:
        """Everything held, oldest first, and the tier emptied (a shutdown spills it to disk)."""
        with self._lock:
            out = list(self._blocks.values())
            self._blocks.clear()
        return out
