"""Wall time of decode-only steps by batch size, for comparing with the memory-bandwidth bound.

A decode step reads every weight once plus each row's KV, so its floor is those bytes over the
device's bandwidth; the per-batch totals here (steps, seconds, KV tokens read) are what that
comparison needs. Each update replaces one dict entry with a new tuple, so a reader on another
thread (a metrics scrape) sees every batch size's totals consistent with each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BatchTotals:
    steps: int = 0
    seconds: float = 0.0
    kv_tokens: int = 0  # keys read per layer, summed over the steps' rows


@dataclass
class DecodeStepStats:
    by_batch: dict[int, BatchTotals] = field(default_factory=dict)

    def record(self, batch: int, kv_tokens: int, seconds: float) -> None:
        t = self.by_batch.get(batch, BatchTotals())
        self.by_batch[batch] = BatchTotals(t.steps + 1, t.seconds + seconds, t.kv_tokens + kv_tokens)

    def snapshot(self) -> dict[int, BatchTotals]:
        return dict(self.by_batch)
