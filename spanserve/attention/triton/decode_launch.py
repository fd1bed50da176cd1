"""Launch description of decode-only steps, used by decode graphs: written with numpy straight
from host arrays into a packed host buffer.

A step whose rows are all single-query causal decodes needs none of the general description
(`launch.build_layout` + `launch._describe`, per-row device tensors): each row's descriptor and
tiles follow from its position, slot list and per-key deltas. They are written here into a host
buffer laid out byte for byte like the device buffer a captured graph reads (`graph_decode`), so
the whole step input is one host-to-device copy. The contents equal what the general description
gives for the same rows (tests/test_decode_graphs.py checks it): spans of equal delta, tiles of at
most BLOCK_N keys that never cross a span, longest programs first.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from spanserve.attention.decode import DecodeRows
from spanserve.attention.plan import key_ends_of
from spanserve.attention.triton.descriptors import (
    F_INV_T,
    F_KEY_BASE,
    F_LOC0,
    F_LOG_S,
    F_MIN_T,
    F_PART0,
    F_TOK0,
    F_TOK1,
    NUM_FIELDS,
    repair_fields,
    shares_in_order,
)


@dataclass
class DecodeSpans:
    """Each row's keys cut into spans of equal delta (a row without deltas is one span); a span of
    L keys gets ceil(L / BLOCK_N) tiles, the last one partial. Plain lists: a decode step has a
    handful of rows and spans, where Python arithmetic costs less than numpy calls."""

    n_keys: list[int]  # per row
    start: list[int]  # per span: first key, in its row (rows' spans are consecutive, in row order)
    end: list[int]
    delta: list[int]
    tiles: list[int]
    row_tiles: list[int]  # per row

    @property
    def total_keys(self) -> int:
        return sum(self.n_keys)

    @property
    def total_tiles(self) -> int:
        return sum(self.row_tiles)

    @property
    def max_row_tiles(self) -> int:
        return max(self.row_tiles)


@dataclass
class PlainSpans:
    """Rows without deltas (a plain decode step, the common case at large batch): one span of
    every key per row, as arrays, so that a step of hundreds of rows is a few numpy calls."""

    n_keys: np.ndarray  # int64 per row
    row_tiles: np.ndarray

    @classmethod
    def of(cls, rows: DecodeRows, block_n: int) -> "PlainSpans":
        n = np.asarray(rows.pos, dtype=np.int64) + 1
        return cls(n, (n + block_n - 1) // block_n)

    @property
    def total_keys(self) -> int:
        return int(self.n_keys.sum())

    @property
    def total_tiles(self) -> int:
        return int(self.row_tiles.sum())

    @property
    def max_row_tiles(self) -> int:
        return int(self.row_tiles.max())


def spans_of(rows: DecodeRows, block_n: int) -> "DecodeSpans | PlainSpans":
    if all(d is None for d in rows.deltas):
        return PlainSpans.of(rows, block_n)
    return decode_spans(rows, block_n)


def decode_spans(rows: DecodeRows, block_n: int) -> DecodeSpans:
    out = DecodeSpans([], [], [], [], [], [])
    for p, d in zip(rows.pos, rows.deltas):
        n = p + 1
        if d is None:
            start, end, delta = [0], [n], [0]
        else:
            d = d[:n]
            cut = (np.flatnonzero(d[1:] != d[:-1]) + 1).tolist()
            start, end = [0, *cut], [*cut, n]
            delta = d[start].tolist()
        tiles = [(e - s + block_n - 1) // block_n for s, e in zip(start, end)]
        out.n_keys.append(n)
        out.start += start
        out.end += end
        out.delta += delta
        out.tiles += tiles
        out.row_tiles.append(sum(tiles))
    return out


def descriptors(spans: DecodeSpans, pos: list[int], ways: int = 1,
                repairs: list | None = None) -> list[list[int]] | np.ndarray:
    """The launch's descriptors (NUM_FIELDS ints each), longest first: one per row (part 0, the
    anchor prefix, is empty for causal rows; part 1 is all the row's keys and tiles), each cut
    into `ways` shares along its tiles when > 1."""
    out = []
    key_base = t0 = 0
    for b, (n, nt) in enumerate(zip(spans.n_keys, spans.row_tiles)):
        d = [0] * NUM_FIELDS
        d[F_TOK0], d[F_TOK1], d[F_KEY_BASE], d[F_MIN_T], d[F_LOC0] = b, b + 1, key_base, pos[b], b
        d[F_PART0 + 2] = d[F_PART0 + 3] = d[F_PART0 + 6] = t0
        d[F_PART0 + 5], d[F_PART0 + 7] = n, t0 + nt
        if repairs is not None:
            d[F_INV_T], d[F_LOG_S] = repair_fields(repairs[b])
        out.append(d)
        key_base += n
        t0 += nt
    if ways > 1:
        return shares_in_order(np.array(out, dtype=np.int64), ways)
    out.sort(key=lambda d: d[F_PART0 + 6] - d[F_PART0 + 7])  # stable, as shares_in_order sorts
    return out


@dataclass
class HostArrays:
    """numpy views of a host buffer (`graph_decode.Packed`): writing through numpy costs no torch
    dispatch."""

    ids: np.ndarray
    positions: np.ndarray
    write_slots: np.ndarray
    q_pos: np.ndarray
    desc: np.ndarray
    tile_start: np.ndarray
    tile_end: np.ndarray
    tile_delta: np.ndarray
    key_slots: np.ndarray
    key_end: np.ndarray

    @classmethod
    def of(cls, p: Any) -> "HostArrays":
        return cls(**{f: getattr(p, f).numpy() for f in cls.__dataclass_fields__})


def write_step(host: HostArrays, rows: DecodeRows, spans: "DecodeSpans | PlainSpans", block_n: int,
               index: np.ndarray, ways: int = 1) -> bool:
    """Fill a host buffer with one step, each row's tiles shared among `ways` programs; returns
    whether some tile rotates (fused delta). `index`: arange of at least the longest row's keys
    (int32), which tile starts are slices of. Rows with a repair also fill `key_end`."""
    if rows.repairs is not None:
        ends = key_ends_of(rows.repairs, [p + 1 for p in rows.pos])
        if ends is not None:
            host.key_end[:len(ends)] = ends
    if isinstance(spans, PlainSpans):
        write_plain(host, rows, spans, block_n, ways)
        return False
    return write_rows(host, rows, spans, block_n, index, ways)


def write_plain(host: HostArrays, rows: DecodeRows, spans: PlainSpans, block_n: int, ways: int = 1) -> None:
    """`write_rows` for rows without deltas, over arrays (the same bytes: tests/test_decode_graphs.py)."""
    n, tiles = spans.n_keys, spans.row_tiles
    B, T, K = len(n), int(tiles.sum()), int(n.sum())
    key_base, t0 = np.cumsum(n) - n, np.cumsum(tiles) - tiles
    pos = n - 1
    host.ids[:] = rows.ids
    host.positions[:] = pos
    host.q_pos[:] = pos
    np.concatenate([s[:k] for s, k in zip(rows.slots, n.tolist())], out=host.key_slots[:K], casting="unsafe")
    host.write_slots[:] = host.key_slots[key_base + pos]
    desc = np.zeros((B, NUM_FIELDS), dtype=np.int64)
    b = np.arange(B)
    desc[:, F_TOK0], desc[:, F_TOK1], desc[:, F_LOC0] = b, b + 1, b
    desc[:, F_KEY_BASE], desc[:, F_MIN_T] = key_base, pos
    desc[:, F_PART0 + 2] = desc[:, F_PART0 + 3] = desc[:, F_PART0 + 6] = t0
    desc[:, F_PART0 + 5], desc[:, F_PART0 + 7] = n, t0 + tiles
    if rows.repairs is not None:
        desc[:, [F_INV_T, F_LOG_S]] = [repair_fields(r) for r in rows.repairs]
    desc = shares_in_order(desc, ways)  # longest first (stable), as the per-row path orders them
    host.desc[:len(desc)] = desc
    ts, te = host.tile_start[:T], host.tile_end[:T]
    ts[:] = (np.arange(T) - np.repeat(t0, tiles)) * block_n  # tile k of a row starts k * BLOCK_N in
    np.add(ts, block_n, out=te)
    te[t0 + tiles - 1] = n
    host.tile_delta[:T] = 0


def write_rows(host: HostArrays, rows: DecodeRows, spans: DecodeSpans, block_n: int, index: np.ndarray,
               ways: int = 1) -> bool:
    """`write_step` row by row, for rows with deltas (spans of equal delta)."""
    host.ids[:] = rows.ids
    host.positions[:] = rows.pos
    host.q_pos[:] = rows.pos
    host.write_slots[:] = [int(s[p]) for s, p in zip(rows.slots, rows.pos)]
    desc = descriptors(spans, rows.pos, ways, rows.repairs)
    host.desc[:len(desc)] = desc
    # tile k of a span starts at span start + k * BLOCK_N; all but a span's last end BLOCK_N later
    n = spans.total_tiles
    ts, te = host.tile_start[:n], host.tile_end[:n]
    np.concatenate([index[s:e:block_n] for s, e in zip(spans.start, spans.end)], out=ts)
    np.add(ts, block_n, out=te)
    te[list(itertools.accumulate(spans.tiles, initial=-1))[1:]] = spans.end
    fused = any(spans.delta)
    host.tile_delta[:n] = np.repeat(spans.delta, spans.tiles) if fused else 0
    base = 0
    for s, k in zip(rows.slots, spans.n_keys):
        host.key_slots[base:base + k] = s[:k]
        base += k
    return fused
