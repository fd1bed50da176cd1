"""The final unit's tokens follow the request's main row as generation appends to it: extended
in place after one copy, never the piece's own token list, equal to row[start:] at every step
(the dense reference) and re-copied when the row no longer extends what the unit holds."""
from __future__ import annotations

import random

from spanserve.cache.manager import Unit, _follow


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
