"""Block-table entries: how a request (or a unit being encoded) sees paged KV."""
from __future__ import annotations

import itertools
import operator
from typing import NamedTuple

import numpy as np


class Entry(NamedTuple):
    """One element of a block table. Logical positions run contiguously across entries;
    the first `n_valid` slots of `block` hold keys stored at local positions, and
    `delta = logical - local` is the rotation applied when attention reads them.
    (A tuple: a 90k-token warm prompt has ~6k entries, built per request on the hot path.)"""

    block: int
    delta: int = 0
    n_valid: int = 0


# A block table as numpy columns: [n, 3] int64 of block, delta, n_valid per entry. The cache
# manager builds these in bulk (no Entry tuple per block on the warm path).
Table = np.ndarray


def _columns(entries: "list[Entry] | Table") -> Table:
    """[n, 3] int64: block, delta, n_valid (one C-level conversion, no per-entry Python)."""
    if isinstance(entries, np.ndarray):
        return entries
    n = len(entries)
    return np.fromiter(itertools.chain.from_iterable(entries), np.int64, 3 * n).reshape(n, 3)


def build(blocks: "list[list]", deltas: list[int], n_valid: "list[list[int]]") -> Table:
    """The table of runs of blocks (objects with an `id`), run i read at delta deltas[i], in
    bulk (~6k blocks for a warm 90k-token layout)."""
    lens = [len(b) for b in blocks]
    n = sum(lens)
    table = np.empty((n, 3), np.int64)
    table[:, 0] = np.fromiter(map(_ID, itertools.chain.from_iterable(blocks)), np.int64, n)
    table[:, 1] = np.repeat(deltas, lens)
    table[:, 2] = np.fromiter(itertools.chain.from_iterable(n_valid), np.int64, n)
    return table


def grown(table: Table, grow: int, blocks: list, delta: int, n_valid: list[int]) -> Table:
    """`table` with its last entry `grow` slots longer, then `blocks` appended (decode growth)."""
    out = np.empty((len(table) + len(blocks), 3), np.int64)
    out[:len(table)] = table
    out[len(table) - 1, 2] += grow
    out[len(table):, 0] = [b.id for b in blocks]
    out[len(table):, 1] = delta
    out[len(table):, 2] = n_valid
    return out


_ID = operator.attrgetter("id")


def truncate(table: Table, n: int) -> Table:
    """The entries covering the first n positions, the last one cut to fit."""
    nv = table[:, 2]
    starts = np.cumsum(nv) - nv
    keep = starts < n
    out = table[keep].copy()
    out[:, 2] = np.minimum(out[:, 2], n - starts[keep])
    return out


def slot_array(entries: "list[Entry] | Table", block_size: int) -> np.ndarray:
    """Flat slot index (block * block_size + offset) of every key, in logical order."""
    cols = _columns(entries)
    n, base = cols[:, 2], cols[:, 0] * block_size
    # key j of entry i sits at base_i + (j - start_i): one repeat and one arange, no Python loop
    return np.repeat(base - (np.cumsum(n) - n), n) + np.arange(int(n.sum()), dtype=np.int64)


def tail_slots(table: Table, n: int, block_size: int) -> np.ndarray:
    """slot_array(table)[-n:] from the few last entries that hold those n keys (decode growth:
    usually one entry, so plain ints beat the few numpy calls of slot_array)."""
    out: list[int] = []
    i = len(table) - 1
    while len(out) < n and i >= 0:
        block, _, n_valid = table[i].tolist()
        out[:0] = range(block * block_size, block * block_size + n_valid)
        i -= 1
    return np.array(out[len(out) - n:] if n > 0 else [], np.int64)


def delta_array(entries: "list[Entry] | Table") -> np.ndarray | None:
    """Per-key delta, or None when every entry has delta 0 (plain prompts pay nothing)."""
    cols = _columns(entries)
    if not cols[:, 1].any():
        return None
    return np.repeat(cols[:, 1], cols[:, 2])


def key_slots(entries: list[Entry], block_size: int) -> list[int]:
    return slot_array(entries, block_size).tolist()


def key_deltas(entries: list[Entry]) -> list[int] | None:
    d = delta_array(entries)
    return None if d is None else d.tolist()
