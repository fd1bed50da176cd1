"""The launch descriptor: one row of NUM_FIELDS int32 per program of the attention kernel (its
query tokens, its key range in two parts, their tiles), and the ways a launch's rows are cut
into shares and ordered. Shared by the general description (launch.py) and the packed one of
decode graphs (decode_launch.py)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

F_TOK0, F_TOK1, F_KEY_BASE = 0, 1, 2
F_PART0 = 3  # klo, khi, tile_lo, tile_hi of part 0 (anchor prefix); part 1 follows at +4
F_MIN_ANCHOR, F_MAX_SEG, F_MIN_T = 11, 12, 13
F_SPLIT, F_LOC0 = 14, 15  # split launches: which split of its query block, launch-local index of tok0
F_SCRATCH_BASE = 16  # prerotated launches: the row's first key in the launch's K scratch
# repaired rows (plan.Repair): 1 / temperature and log_scale * log2(e), float32 bits
F_INV_T, F_LOG_S = 17, 18
NUM_FIELDS = 32  # a descriptor row is 128 bytes
_LOG2E = 1.4426950408889634


def repair_fields(repair: Any) -> tuple[int, int]:
    """(F_INV_T, F_LOG_S) of a row: its repair's values as float32 bits (1 and 0 without one);
    the kernel's scores are in base 2, so the log scale is too."""
    if repair is None:
        inv_t, log_s = 1.0, 0.0
    else:
        inv_t, log_s = 1.0 / repair.temperature, repair.log_scale * _LOG2E
    return tuple(int(x) for x in np.array([inv_t, log_s], dtype=np.float32).view(np.int32))  # type: ignore[return-value]


def tile_counts(desc: np.ndarray) -> np.ndarray:
    """Tiles each descriptor visits, both parts."""
    return (desc[:, F_PART0 + 3] - desc[:, F_PART0 + 2]) + (desc[:, F_PART0 + 7] - desc[:, F_PART0 + 6])


def split_shares(desc: np.ndarray, ways: int) -> np.ndarray:
    """Each descriptor becomes `ways` descriptors over consecutive, near-equal shares of its
    tiles (part 0's tiles first, then part 1's); split s of a block has F_SPLIT = s."""
    lo0, lo1 = desc[:, F_PART0 + 2], desc[:, F_PART0 + 6]
    n0 = desc[:, F_PART0 + 3] - lo0
    n = tile_counts(desc)
    out = np.repeat(desc, ways, axis=0)
    s = np.tile(np.arange(ways), len(desc))
    n, n0 = np.repeat(n, ways), np.repeat(n0, ways)
    a, b = n * s // ways, n * (s + 1) // ways
    lo0, lo1 = np.repeat(lo0, ways), np.repeat(lo1, ways)
    out[:, F_PART0 + 2], out[:, F_PART0 + 3] = lo0 + np.minimum(a, n0), lo0 + np.minimum(b, n0)
    out[:, F_PART0 + 6], out[:, F_PART0 + 7] = lo1 + np.maximum(a - n0, 0), lo1 + np.maximum(b - n0, 0)
    out[:, F_SPLIT] = s
    return out


def shares_in_order(desc: np.ndarray, ways: int) -> np.ndarray:
    """The launch's programs: each descriptor cut into `ways` shares (when > 1), longest first, so
    the causal tail does not run alone at the end of the launch."""
    if ways > 1:
        desc = split_shares(desc, ways)
    return desc[np.argsort(-tile_counts(desc), kind="stable")]


def simple_decodes(rows: Sequence[Any]) -> bool:
    """Every row is one causal query at its last key: a decode row (all of a mixed step's decode
    launch, as a rule), which `describe_decodes` describes over arrays."""
    return all(r.q_end - r.q_start == 1 and r.q_pos[0] == r.n_keys - 1 and not r.anchor[0] and not r.seg[0]
               for r in rows)


def describe_decodes(rows: Sequence[Any], bn: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(desc, tile_start, tile_end, tile_delta) of `simple_decodes` rows (launch.py's rows), tiles never crossing a
    span: what the row-by-row loop gives for them (tests/test_triton_attention.py checks it)."""
    B = len(rows)
    n_spans = np.fromiter((len(r.span_starts) for r in rows), np.int64, B)
    s_start = np.concatenate([r.span_starts for r in rows]).astype(np.int64)
    s_end = np.concatenate([r.span_ends for r in rows]).astype(np.int64)
    s_delta = np.concatenate([r.span_delta for r in rows]).astype(np.int64)
    count = -(-(s_end - s_start) // bn)  # tiles per span
    span = np.repeat(np.arange(len(count)), count)
    first = np.repeat(np.cumsum(count) - count, count)
    ts = s_start[span] + (np.arange(int(count.sum())) - first) * bn
    te = np.minimum(ts + bn, s_end[span])
    row_tiles = np.add.reduceat(count, np.cumsum(n_spans) - n_spans)
    t0 = np.cumsum(row_tiles) - row_tiles
    q = np.fromiter((r.q_start for r in rows), np.int64, B)
    n = np.fromiter((r.n_keys for r in rows), np.int64, B)
    d = np.zeros((B, NUM_FIELDS), dtype=np.int64)
    d[:, F_TOK0], d[:, F_TOK1], d[:, F_LOC0] = q, q + 1, np.arange(B)
    d[:, F_KEY_BASE] = np.fromiter((r.key_base for r in rows), np.int64, B)
    d[:, F_PART0 + 2] = d[:, F_PART0 + 3] = d[:, F_PART0 + 6] = t0  # part 0 (no anchor): empty
    d[:, F_PART0 + 5], d[:, F_PART0 + 7] = n, t0 + row_tiles
    d[:, F_MIN_T] = n - 1
    if any(r.repair is not None for r in rows):
        d[:, [F_INV_T, F_LOG_S]] = [repair_fields(r.repair) for r in rows]
    return d, ts, te, s_delta[span]
