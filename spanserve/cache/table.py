"""Block-table entries: how a request (or a unit being encoded) sees paged KV."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """One element of a block table. Logical positions run contiguously across entries;
    the first `n_valid` slots of `block` hold keys stored at local positions, and
    `delta = logical - local` is the rotation applied when attention reads them."""

    block: int
    delta: int = 0
    n_valid: int = 0


def key_slots(entries: list[Entry], block_size: int) -> list[int]:
    """Flat slot index (block * block_size + offset) of every key, in logical order."""
    out: list[int] = []
    for e in entries:
        base = e.block * block_size
        out.extend(range(base, base + e.n_valid))
    return out


def key_deltas(entries: list[Entry]) -> list[int] | None:
    """Per-key delta, or None when every entry has delta 0 (plain prompts pay nothing)."""
    if all(e.delta == 0 for e in entries):
        return None
    out: list[int] = []
    for e in entries:
        out.extend([e.delta] * e.n_valid)
    return out
