"""Block tables as numpy columns [block, delta, n_valid] (cache/table.py) against lists of
Entry on random tables: slots, deltas and truncation."""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from spanserve.cache.table import Entry, delta_array, slot_array, truncate


def reference_truncate(entries: list[Entry], n: int) -> list[Entry]:
    out = []
    for e in entries:
        if n <= 0:
            break
        out.append(Entry(e.block, e.delta, min(e.n_valid, n)))
        n -= e.n_valid
    return out


@given(st.lists(st.tuples(st.integers(0, 99), st.integers(-20, 20), st.integers(0, 4)), max_size=20),
       st.integers(0, 90))
def test_table_columns_match_entries(rows, n):
    entries = [Entry(*r) for r in rows]
    table = np.array(rows, dtype=np.int64).reshape(-1, 3)
    assert slot_array(table, 4).tolist() == slot_array(entries, 4).tolist()
    want_d, got_d = delta_array(entries), delta_array(table)
    assert (want_d is None) == (got_d is None) and (want_d is None or want_d.tolist() == got_d.tolist())
    assert [Entry(*r) for r in truncate(table, n).tolist()] == reference_truncate(entries, n)
