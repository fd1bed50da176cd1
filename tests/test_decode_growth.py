"""Decode growth kept incremental, against dense rebuilds on random inputs.

The final unit's tokens follow the request's main row as generation appends to it: extended
in place after one copy, never the piece's own token list, equal to row[start:] at every step
(the dense reference) and re-copied when the row no longer extends what the unit holds.
A task's cached slots and deltas, extended as its table grows, equal slot_array / delta_array of
the whole table."""
from __future__ import annotations

import random

import numpy as np

from spanserve.cache.claim import Task
from spanserve.cache.manager import Unit, _follow
from spanserve.cache.table import delta_array, grown, slot_array


def test_follow_matches_row_slice_and_leaves_piece_tokens_alone() -> None:
    rng = random.Random(0)
    for _ in range(50):
        start = rng.randrange(0, 20)
        piece = [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
        row = [rng.randrange(1000) for _ in range(start)] + list(piece)
        frozen = list(piece)
        u = Unit(seed=1, start=start, local_start=start, plus=False, final=True, tokens=piece)
        _follow(u, row)
        for _ in range(rng.randrange(0, 40)):
            for _ in range(rng.randrange(0, 3)):  # steps that append nothing happen too
                row.append(rng.randrange(1000))
            _follow(u, row)
            assert list(u.tokens) == row[start:]
        assert piece == frozen and u.tokens is not piece


def test_follow_recopies_a_row_shorter_than_the_unit() -> None:
    row = list(range(10))
    u = Unit(seed=1, start=2, local_start=2, plus=False, final=True, tokens=row[2:])
    _follow(u, row)
    row.extend([50, 51])
    _follow(u, row)
    shorter = list(range(100, 105))
    _follow(u, shorter)
    assert u.tokens == shorter[2:]


class _Block:
    def __init__(self, id: int) -> None:
        self.id = id


def test_extended_slots_and_deltas_equal_a_rebuild() -> None:
    rng = random.Random(0)
    bs = 4
    for trial in range(60):
        n = rng.randrange(1, 6)
        delta = rng.choice([0, 0, 5])
        table = np.array([[rng.randrange(100), rng.choice([0, delta]), bs] for _ in range(n)], np.int64)
        table[-1, 2] = rng.randrange(1, bs + 1)
        task = Task(list(range(int(table[:, 2].sum()))), table, [], bs)
        if trial % 3:  # cached before growing (the usual case), or computed only afterwards
            task.slots, task.deltas
        next_id = 100
        for _ in range(rng.randrange(1, 30)):
            old = task.entries
            room = bs - int(old[-1, 2])
            added = rng.randrange(1, 2 * bs)
            grow = min(room, added)
            rest, new = added - grow, []
            while rest > 0:
                new.append(min(bs, rest))
                rest -= new[-1]
            blocks = [_Block(next_id + i) for i in range(len(new))]
            next_id += len(new)
            task.extend_entries(grown(old, grow, blocks, int(old[-1, 1]), new), added)
            assert np.array_equal(task.slots, slot_array(task.entries, bs))
            want = delta_array(task.entries)
            assert (task.deltas is None) == (want is None)
            if want is not None:
                assert np.array_equal(task.deltas, want)
