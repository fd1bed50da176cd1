"""Launch description of general steps, used by eager steps (prefill, mixed, decode) and, on the
host, by step graphs (`graph_step`): a step's plan turned into the flat arrays the kernels read.

The kernels never see per-key deltas. A row's keys are cut into *spans*, maximal runs of equal
delta. Keys are gathered through a per-key slot list, which makes partial entries in the middle of
a row free: they only shift which slots a tile gathers. Two ways to apply a span's rotation:

- *fused* (decode launches, optionally prefill): tiles of at most BLOCK_N keys never cross a span,
  each carries its span's delta, and a program rotates its queries when the delta changes
  (q . R(d) k = R(-d) q . k), walking all its tiles in one flat, software-pipelined loop;
- *prerotated* (prefill launches by default): before attention, each layer's keys of the launch
  are copied once, rotated by their span's delta, into a contiguous scratch, and the kernel reads
  K from there by position; tiles then ignore spans. Rotating Q inside a 128-row program costs
  more than this one memory pass, and contiguous K costs less than K gathered through slots.

A launch with too few programs to fill the GPU (a short chunk over a long context, a few decodes
over long contexts) is *split*: each query block's tiles are shared among several programs that
write partial outputs and their log-sum-exp, merged afterwards by a combine pass. For decodes this
also hides the fused rotation: at one program per SM a rotating decode loop costs +6.5% over a
plain one (16 rows x 16k keys, H100), at two or more per SM +0.4% (docs/gpu.md).

Each program owns up to BLOCK_Q query tokens of one row and one KV head. Its descriptor carries
the tile ranges it must visit, computed here once per step (not once per layer). The visible set
of a block of queries is `[0, max anchor_end) U [min seg_start, max t]`; these two *parts* are
disjoint once the second starts at `max(min seg_start, max anchor_end)`, and each part maps to a
range of tiles by binary search.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from spanserve.attention.paths import RowPath, row_path
from spanserve.attention.plan import AttentionPlan, HostRow, Repair, key_ends_of
from spanserve.attention.triton.descriptors import (F_INV_T, F_KEY_BASE, F_LOC0, F_LOG_S, F_MAX_SEG, F_MIN_ANCHOR,
                                                    F_MIN_T, F_PART0, F_SCRATCH_BASE, F_TOK0, F_TOK1, NUM_FIELDS,
                                                    describe_decodes, repair_fields, shares_in_order, simple_decodes)
from spanserve.attention.triton.descriptors import tile_counts as _tile_counts
from spanserve.attention.triton.split import SplitPolicy, decode_split

# Descriptor fields (int32, one row per program); the kernel reads them by these offsets.


@dataclass
class _RowHost:
    q_start: int
    q_end: int
    key_base: int
    n_keys: int
    span_starts: np.ndarray  # [S_row] key index where each span begins
    span_ends: np.ndarray
    span_delta: np.ndarray
    q_pos: np.ndarray  # [nq]
    anchor: np.ndarray
    seg: np.ndarray
    repair: Repair | None = None


@dataclass
class Prerotation:
    """Keys of one launch to copy into a scratch each layer, in row order: scratch row i holds
    R(delta[i]) k[src_slots[i]] (zero spans copied as they are), so the kernel reads K at its
    row's F_SCRATCH_BASE + key index, contiguous and without a slot list."""

    src_slots: torch.Tensor  # [n] int32
    delta: torch.Tensor  # [n] int32
    count: torch.Tensor | None = None  # [1] int32: keys in use of a fixed-size (graph) buffer


@dataclass
class Launch:
    desc: torch.Tensor  # [P, NUM_FIELDS] int32, longest programs first
    tile_start: torch.Tensor  # [n_tiles] int32 key index in the row
    tile_end: torch.Tensor
    tile_delta: torch.Tensor  # the tile's span delta (all zero unless fused)
    fused_delta: bool  # some tile rotates: compile the rotating kernel
    prerotation: Prerotation | None
    # split > 1: every query block's tiles are cut into `split` programs that write partial
    # results for the launch's tokens (`tokens`, flat indices), merged by a combine pass
    split: int = 1
    tokens: torch.Tensor | None = None


@dataclass
class StepLayout:
    """Everything `forward` needs that does not depend on the layer; built once per step."""

    write_slots: torch.Tensor  # [T] long
    key_slots: torch.Tensor  # [sum keys] int32, each row's slots in position order
    q_pos: torch.Tensor  # [T] int32, indexed by flat token
    anchor: torch.Tensor  # [T] int32 (0 for causal rows)
    seg: torch.Tensor  # [T] int32 (0 for causal rows)
    inv_freq: torch.Tensor  # [D/2] float32, the RoPE frequencies the kernels rotate with
    has_delta: bool
    has_plus: bool
    rows: list[_RowHost]
    fixed: tuple[Launch, Launch] | None = None  # set by a static (graph) layout: its launches
    # [sum keys] int32 beside key_slots: each key's plus-segment end for repaired rows (NEVER
    # elsewhere); None when no row of the step is repaired
    key_end: torch.Tensor | None = None
    _launches: dict[tuple, tuple[Launch, Launch]] = field(default_factory=dict)
    _dense: dict[int, list[_RowHost]] = field(default_factory=dict)

    def launches(self, small_q: int, small_n: int, big_q: int, big_n: int, prerotate_big: bool,
                 split: "SplitPolicy | None" = None, dense_min: int = 0,
                 stage_big: bool = False) -> tuple[Launch, Launch]:
        """The two launches: rows of at most `small_q` queries (decodes) get programs of `small_q`
        tokens and tiles of `small_n` keys, fused rotation; the rest `big_q` and `big_n`, with
        their rotation done beforehand when `prerotate_big` (always with `stage_big`: an 8-bit
        cache's prefill launch reads bfloat16 copies). Both are split along keys per `split`.
        Rows of `dense_rows(dense_min)` are in neither (0: none are left out)."""
        if self.fixed is not None:
            return self.fixed
        key = (small_q, small_n, big_q, big_n, prerotate_big, split, dense_min, stage_big)
        if key not in self._launches:
            paths = [_row_path(r, small_q, dense_min) for r in self.rows]
            small = [r for r, p in zip(self.rows, paths) if p is RowPath.DECODE_LAUNCH]
            big = [r for r, p in zip(self.rows, paths) if p is RowPath.PREFILL_LAUNCH]
            pre = copies_keys(big, prerotate_big, stage_big)
            self._launches[key] = (_describe(small, small_q, small_n, self, False, decode_split(split)),
                                   _describe(big, big_q, big_n, self, pre, split))
        return self._launches[key]

    def dense_rows(self, min_q: int) -> list[_RowHost]:
        """Rows of at least `min_q` queries that are the last of their keys, seen causally from
        position 0, unrotated: a fresh prompt's prefill or a later chunk of it, which a dense
        attention kernel can take as is (`paths.row_path`). Asked once per layer: kept with the
        launches."""
        if not min_q or self.fixed is not None:
            return []
        if min_q not in self._dense:
            # a dense row has more queries than any decode program holds
            self._dense[min_q] = [r for r in self.rows if _row_path(r, 0, min_q) is RowPath.DENSE]
        return self._dense[min_q]


def copies_keys(big: list[_RowHost], prerotate: bool, stage: bool) -> bool:
    """Whether the prefill launch over rows `big` copies its keys into scratch first: rotated
    when some span turns and `prerotate` is on, and always to stage an 8-bit cache's rows."""
    return bool(big) and ((prerotate and any(bool(r.span_delta.any()) for r in big)) or stage)


def _row_path(r: _RowHost, small_q: int, dense_min: int) -> RowPath:
    nq = r.q_end - r.q_start
    return row_path(nq, bool(dense_min) and _fresh(r), small_q, dense_min)


def _fresh(r: _RowHost) -> bool:
    """The row's queries are the last of its keys, which it sees causally from position 0,
    unrotated: a fresh prompt, or a later chunk of one (or of a prompt whose cached prefix sits
    where it was computed)."""
    nq = r.q_end - r.q_start
    return (r.n_keys >= nq and len(r.span_delta) == 1 and r.span_delta[0] == 0 and r.repair is None
            and bool((r.q_pos == np.arange(r.n_keys - nq, r.n_keys)).all()) and not r.anchor.any()
            and not r.seg.any())


def _cat_host(parts: list[torch.Tensor]) -> np.ndarray:
    # One device->host copy for all rows rather than one sync per row.
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return torch.cat([p.reshape(-1).long() for p in parts]).cpu().numpy()


def _spans(delta: np.ndarray | None, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A row's keys cut into maximal runs of equal delta: (starts, ends, deltas)."""
    if delta is None:
        return np.array([0]), np.array([n]), np.zeros(1, dtype=np.int64)
    d = delta[:n]
    cut = np.flatnonzero(np.diff(d)) + 1
    starts = np.concatenate(([0], cut)).astype(np.int64)
    return starts, np.concatenate((cut, [n])).astype(np.int64), d[starts].astype(np.int64)


def host_rows(rows: Sequence[HostRow]) -> list[_RowHost]:
    """The layout's rows straight from host arrays; rows take consecutive query ranges and
    consecutive ranges of the step's key list, in order."""
    out: list[_RowHost] = []
    q0 = key_base = 0
    for h in rows:
        nq, n = len(h.q_pos), len(h.key_slots)
        zeros = None if h.anchor_end is not None and h.seg_start is not None else np.zeros(nq, dtype=np.int64)
        out.append(_RowHost(q0, q0 + nq, key_base, n, *_spans(h.key_delta, n), h.q_pos,
                            zeros if h.anchor_end is None else h.anchor_end,
                            zeros if h.seg_start is None else h.seg_start, h.repair))
        q0 += nq
        key_base += n
    return out


def build_layout(plan: AttentionPlan, inv_freq: torch.Tensor) -> StepLayout:
    rows = plan.rows
    dev = plan.write_slots.device
    T = int(plan.positions.numel())
    has_plus = any(r.anchor_end is not None or r.seg_start is not None for r in rows)
    if all(r.host is not None for r in rows) and _consecutive(rows):
        host_rows_ = host_rows([r.host for r in rows])  # built on the host: no device round trip
    else:
        q_pos = _cat_host([r.q_pos for r in rows])
        anchor = _cat_host([r.anchor_end if r.anchor_end is not None else torch.zeros_like(r.q_pos) for r in rows])
        seg = _cat_host([r.seg_start if r.seg_start is not None else torch.zeros_like(r.q_pos) for r in rows])
        deltas = _cat_host([r.key_delta for r in rows if r.key_delta is not None])
        host_rows_ = []
        q_off = d_off = key_base = 0
        for r in rows:
            nq, n = r.num_queries, r.num_keys
            sl = slice(q_off, q_off + nq)
            d = None
            if r.key_delta is not None:
                d = deltas[d_off:d_off + n]
                d_off += n
            host_rows_.append(_RowHost(r.q_start, r.q_end, key_base, n, *_spans(d, n), q_pos[sl], anchor[sl], seg[sl],
                                       r.repair))
            q_off += nq
            key_base += n
    tok = np.zeros((3, T), dtype=np.int64)
    for r in host_rows_:
        tok[:, r.q_start:r.q_end] = r.q_pos, r.anchor, r.seg
    key_slots = torch.cat([r.key_slots for r in rows]) if rows else torch.zeros(0, dtype=torch.long, device=dev)
    return StepLayout(
        write_slots=plan.write_slots.to(device=dev, dtype=torch.long),
        key_slots=key_slots.to(torch.int32),
        q_pos=_dev32(tok[0], dev), anchor=_dev32(tok[1], dev), seg=_dev32(tok[2], dev),
        inv_freq=inv_freq.to(device=dev, dtype=torch.float32).contiguous(),
        has_delta=any(bool((r.span_delta != 0).any()) for r in host_rows_),
        has_plus=has_plus, rows=host_rows_, key_end=key_ends(host_rows_, dev),
    )


def key_ends(rows: list[_RowHost], dev: torch.device) -> torch.Tensor | None:
    a = key_ends_of([r.repair for r in rows], [r.n_keys for r in rows])
    return None if a is None else torch.from_numpy(a).to(dev)


def _consecutive(rows: list) -> bool:
    """Rows take the step's tokens from 0 in order (what `host_rows` assumes)."""
    q = 0
    for r in rows:
        if r.q_start != q:
            return False
        q = r.q_end
    return True


def _dev32(a: np.ndarray, dev: torch.device) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.int32)).to(dev)


def _tiles(r: _RowHost, bn: int, split: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tiles of at most bn keys, (start, end, delta); with `split` they never cross a span."""
    s_start, s_end, s_delta = (r.span_starts, r.span_ends, r.span_delta) if split else (
        np.array([0]), np.array([r.n_keys]), np.zeros(1, dtype=np.int64))
    count = -(-(s_end - s_start) // bn)
    span = np.repeat(np.arange(len(count)), count)
    first = np.repeat(np.cumsum(count) - count, count)
    start = s_start[span] + (np.arange(int(count.sum())) - first) * bn
    return start, np.minimum(start + bn, s_end[span]), s_delta[span]


_EMPTY: dict[torch.device, Launch] = {}


def empty_launch(dev: torch.device) -> Launch:
    """The launch with no programs (every step of pure decodes has no prefill launch)."""
    if dev not in _EMPTY:
        z = torch.zeros(0, dtype=torch.int32, device=dev)
        _EMPTY[dev] = Launch(z.view(0, NUM_FIELDS), z, z, z, False, None)
    return _EMPTY[dev]


@dataclass
class HostLaunch:
    """A launch as host arrays (`_describe_host`); `Launch` is the same on the device."""

    desc: np.ndarray  # [P, NUM_FIELDS] int64
    tile_start: np.ndarray
    tile_end: np.ndarray
    tile_delta: np.ndarray
    fused_delta: bool
    split: int
    tokens: np.ndarray | None  # split launches: flat token of each launch-local index
    rot_keys: np.ndarray | None  # prerotated launches: the step's key index of each scratch row
    rot_delta: np.ndarray | None


def _describe_host(rows: list[_RowHost], bq: int, bn: int, prerotate: bool,
                   split: SplitPolicy | None = None, fixed_ways: bool = False) -> HostLaunch:
    if rows and not prerotate and simple_decodes(rows):
        desc, ts, te, td = describe_decodes(rows, bn)
        ways = 1
        if split is not None:
            ways = split.ways(len(desc), None if fixed_ways else int(_tile_counts(desc).max()))
        tokens = np.fromiter((r.q_start for r in rows), np.int64, len(rows)) if ways > 1 else None
        return HostLaunch(shares_in_order(desc, ways), ts, te, td, bool(td.any()), ways, tokens, None, None)
    return _describe_rows(rows, bq, bn, prerotate, split, fixed_ways)


def _describe_rows(rows: list[_RowHost], bq: int, bn: int, prerotate: bool,
                   split: SplitPolicy | None = None, fixed_ways: bool = False) -> HostLaunch:
    """`_describe_host` row by row: any rows (prefills, anchored or segment rows, prerotation)."""
    out: list[np.ndarray] = []
    tiles: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    rot_keys, rot_delta = [], []  # prerotated launches: each scratch row's key, and its delta
    n_tiles = n_tok = n_scratch = 0
    repaired = any(r.repair is not None for r in rows)
    for r in rows:
        ts, te, td = _tiles(r, bn, split=not prerotate)
        tiles.append((ts, te, td))
        if prerotate:
            rot_keys.append(np.arange(r.key_base, r.key_base + r.n_keys))
            rot_delta.append(np.repeat(r.span_delta, r.span_ends - r.span_starts))
        nq = r.q_end - r.q_start
        starts = np.arange(0, nq, bq)
        max_t = np.maximum.reduceat(r.q_pos, starts)
        min_t = np.minimum.reduceat(r.q_pos, starts)
        max_a = np.maximum.reduceat(r.anchor, starts)
        min_a = np.minimum.reduceat(r.anchor, starts)
        max_s = np.maximum.reduceat(r.seg, starts)
        min_s = np.minimum.reduceat(r.seg, starts)
        d = np.zeros((len(starts), NUM_FIELDS), dtype=np.int64)
        d[:, F_TOK0] = r.q_start + starts
        d[:, F_TOK1] = np.minimum(r.q_start + starts + bq, r.q_end)
        d[:, F_KEY_BASE] = r.key_base
        parts = (
            (np.zeros_like(max_a), np.minimum(max_a, r.n_keys)),
            (np.maximum(min_s, max_a), np.minimum(max_t + 1, r.n_keys)),
        )
        for p, (klo, khi) in enumerate(parts):
            khi = np.maximum(khi, klo)
            jlo = np.searchsorted(te, klo, side="right")
            jhi = np.maximum(np.searchsorted(ts, khi, side="left"), jlo)
            jhi = np.where(khi > klo, jhi, jlo)
            base = F_PART0 + 4 * p
            d[:, base], d[:, base + 1] = klo, khi
            d[:, base + 2], d[:, base + 3] = n_tiles + jlo, n_tiles + jhi
        d[:, F_MIN_ANCHOR], d[:, F_MAX_SEG], d[:, F_MIN_T] = min_a, max_s, min_t
        if repaired:  # as describe_decodes writes them: rows without a repair read (1, 0)
            d[:, F_INV_T], d[:, F_LOG_S] = repair_fields(r.repair)
        d[:, F_LOC0] = n_tok + starts
        d[:, F_SCRATCH_BASE] = n_scratch
        n_scratch += r.n_keys if prerotate else 0
        out.append(d)
        n_tiles += len(ts)
        n_tok += nq

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    desc = np.concatenate(out) if out else np.zeros((0, NUM_FIELDS), dtype=np.int64)
    ways = 1
    if split is not None and len(desc):
        ways = split.ways(len(desc), None if fixed_ways else int(_tile_counts(desc).max()))
    tokens = None
    if ways > 1:
        tokens = cat([np.arange(r.q_start, r.q_end) for r in rows])
    desc = shares_in_order(desc, ways)
    tile_delta = cat([t[2] for t in tiles])
    return HostLaunch(desc, cat([t[0] for t in tiles]), cat([t[1] for t in tiles]), tile_delta,
                      bool(tile_delta.any()), ways, tokens,
                      cat(rot_keys) if rot_keys else None, cat(rot_delta) if rot_keys else None)


def _describe(rows: list[_RowHost], bq: int, bn: int, lay: StepLayout, prerotate: bool,
              split: SplitPolicy | None = None) -> Launch:
    dev = lay.key_slots.device
    if not rows:
        return empty_launch(dev)
    h = _describe_host(rows, bq, bn, prerotate, split)
    pre = None
    if h.rot_keys is not None:
        keys = torch.from_numpy(h.rot_keys).to(dev)
        pre = Prerotation(lay.key_slots[keys].contiguous(), _dev32(h.rot_delta, dev))
    return Launch(_dev32(h.desc, dev).view(-1, NUM_FIELDS), _dev32(h.tile_start, dev), _dev32(h.tile_end, dev),
                  _dev32(h.tile_delta, dev), h.fused_delta, pre, h.split,
                  None if h.tokens is None else _dev32(h.tokens, dev))
