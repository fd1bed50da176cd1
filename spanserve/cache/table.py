"""Block-table entries: how a request (or a unit being encoded) sees paged KV."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Entry:
    """One element of a block table. Logical positions run contiguously across entries;
    the first `n_valid` slots of `block` hold keys stored at local positions, and
    `delta = logical - local` is the rotation applied when attention reads them."""

    block: int
    delta: int = 0
    n_valid: int = 0


def slot_array(entries: list[Entry], block_size: int) -> np.ndarray:
    """Flat slot index (block * block_size + offset) of every key, in logical order."""
    n = np.fromiter((e.n_valid for e in entries), np.int64, len(entries))
    base = np.fromiter((e.block for e in entries), np.int64, len(entries)) * block_size
    # key j of entry i sits at base_i + (j - start_i): one repeat and one arange, no Python loop
    return np.repeat(base - (np.cumsum(n) - n), n) + np.arange(int(n.sum()), dtype=np.int64)


def delta_array(entries: list[Entry]) -> np.ndarray | None:
    """Per-key delta, or None when every entry has delta 0 (plain prompts pay nothing)."""
    if all(e.delta == 0 for e in entries):
        return None
    n = np.fromiter((e.n_valid for e in entries), np.int64, len(entries))
    return np.repeat(np.fromiter((e.delta for e in entries), np.int64, len(entries)), n)


def key_slots(entries: list[Entry], block_size: int) -> list[int]:
    return slot_array(entries, block_size).tolist()


def key_deltas(entries: list[Entry]) -> list[int] | None:
    d = delta_array(entries)
    return None if d is None else d.tolist()
