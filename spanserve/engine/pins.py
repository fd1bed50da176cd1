"""Pinned segments: which blocks each pin holds, who owns it, and the two limits on pinning (the
pin budget, a share of the KV pool for all pins together, and the pin quota, a share for each
owner). A pin request reserves its blocks when it is queued, so that pin requests in flight
together cannot overrun either limit; the reservation ends when the request finishes.

Only bookkeeping lives here: the engine acquires and releases the pool's blocks."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

PinKey = tuple[str, str]  # (namespace, key)


@dataclass
class Pin:
    blocks: list[Any]  # cache.block_pool.Block, held (acquired) once more for the pin
    owner: str


class PinTable:
    def __init__(self, num_blocks: int, fraction: float, quota: float | None = None):
        self.budget = int(fraction * num_blocks)  # blocks all pins together may hold
        self.quota = int((fraction if quota is None else quota) * num_blocks)  # blocks one owner's pins may hold
        self.fraction, self.quota_fraction, self.num_blocks = fraction, fraction if quota is None else quota, num_blocks
        self.pins: dict[PinKey, Pin] = {}
        self._held: Counter[str] = Counter()  # owner -> blocks its pins hold
        self._reserved: dict[str, tuple[str, int]] = {}  # pin request id -> (owner, blocks promised)
        self._reserved_by: Counter[str] = Counter()

    @property
    def num_segments(self) -> int:
        return len(self.pins)

    @property
    def num_blocks_held(self) -> int:
        return sum(self._held.values())

    def held_by(self, owner: str) -> int:
        """Blocks the owner's pins hold, and those its queued pin requests were promised."""
        return self._held[owner] + self._reserved_by[owner]

    def reserve(self, request_id: str, owner: str, need: int) -> None:
        """Promise `need` blocks to a pin request, or ValueError (nothing changed) when that would
        overrun the owner's quota or the pin budget."""
        total = self.num_blocks_held + sum(self._reserved_by.values())
        if total + need > self.budget:
            raise ValueError(f"pinning needs {need} blocks but only {max(0, self.budget - total)} of the pin budget "
                             f"({self.fraction:.0%} of {self.num_blocks}) are left; unpin something or raise "
                             "pin_fraction")
        mine = self.held_by(owner)
        if mine + need > self.quota:
            raise ValueError(f"pinning needs {need} blocks but only {max(0, self.quota - mine)} of this tenant's pin "
                             f"quota ({self.quota_fraction:.0%} of {self.num_blocks}) are left; unpin something or "
                             "raise pin_quota")
        self._reserved[request_id] = (owner, need)
        self._reserved_by[owner] += need

    def release_reservation(self, request_id: str) -> None:
        """The pin request finished (its pins are in the table) or was aborted."""
        entry = self._reserved.pop(request_id, None)
        if entry is not None:
            owner, need = entry
            self._reserved_by[owner] -= need
            if not self._reserved_by[owner]:
                del self._reserved_by[owner]

    def put(self, key: PinKey, owner: str, blocks: list[Any]) -> list[Any]:
        """Pin `blocks` under `key`; the blocks of the pin it replaces (the same key: the same
        owner, since keys carry the owner's namespace), for the caller to release."""
        old = self.pop(key)
        self.pins[key] = Pin(list(blocks), owner)
        self._held[owner] += len(blocks)
        return old or []

    def pop(self, key: PinKey) -> list[Any] | None:
        """Unpin `key`: its blocks, for the caller to release, or None when nothing is pinned there."""
        pin = self.pins.pop(key, None)
        if pin is None:
            return None
        self._held[pin.owner] -= len(pin.blocks)
        if not self._held[pin.owner]:
            del self._held[pin.owner]
        return pin.blocks
