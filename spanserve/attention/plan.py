"""Per-step attention metadata: plain data handed from the model runner to a backend."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch


NEVER = 2**31 - 1  # a key end no query position reaches: the key is read as it is


class Repair(NamedTuple):
    """How a row's later tokens read the reused segments it holds (parallel encoding repaired in
    attention, after APE, arXiv 2502.05431). A key in [starts[i], ends[i]) (a plus segment, in the
    row's positions) read by a query at position t >= ends[i] is a *context* key of that query;
    queries inside the segment read it as it is. A query reads its context keys as one group:
    weights softmax(s / temperature) within it, and the group weighs as one key of logit
    temperature * logsumexp(s / temperature) + log_scale beside its other keys (s = q.k / sqrt(D);
    `attention.reference.repaired_softmax`). temperature 1 and log_scale 0 change nothing."""

    starts: np.ndarray  # int64
    ends: np.ndarray
    temperature: float
    log_scale: float

    def key_ends(self, n: int) -> np.ndarray:
        """int32 [n]: each key's segment end, NEVER for keys in no segment."""
        out = np.full(n, NEVER, dtype=np.int32)
        for s, e in zip(self.starts.tolist(), self.ends.tolist()):
            out[s:min(e, n)] = e
        return out

    def applies(self, q_pos: torch.Tensor, n: int) -> torch.Tensor:
        """Boolean [nq, n]: which (query, key) scores the repair changes."""
        ends = torch.from_numpy(self.key_ends(n).astype(np.int64)).to(q_pos.device)
        return q_pos[:, None] >= ends[None, :]


def key_ends_of(repairs: "Sequence[Repair | None]", n_keys: "Sequence[int]") -> np.ndarray | None:
    """The step's per-key segment ends (int32), rows' keys in order: each row's `Repair.key_ends`,
    NEVER for a row without one; None when no row has one."""
    if all(r is None for r in repairs):
        return None
    return np.concatenate([np.full(n, NEVER, dtype=np.int32) if r is None else r.key_ends(n)
                           for r, n in zip(repairs, n_keys)])


class HostRow(NamedTuple):
    """A row's arrays as numpy, when the plan was built on the host: a backend that preprocesses
    on the host reads these rather than copying the device tensors back (a sync per step)."""

    q_pos: np.ndarray
    key_slots: np.ndarray
    key_delta: np.ndarray | None
    anchor_end: np.ndarray | None
    seg_start: np.ndarray | None
    repair: Repair | None = None


@dataclass
class Row:
    """One attention problem: a contiguous slice of the step's tokens (the queries) over one
    key table. A request's main sequence is a row; so is each standalone segment being encoded.

    Positions are in the row's own space (logical positions for a request, local positions for a
    segment unit). A query at position t sees key k when `k < anchor_end or seg_start <= k <= t`;
    causal rows leave both None (anchor_end = seg_start = 0)."""

    q_start: int
    q_end: int
    q_pos: torch.Tensor  # [nq] long
    key_slots: torch.Tensor  # [N] long, flat slot of each key in position order
    key_delta: torch.Tensor | None = None  # [N] long; None when all zero
    anchor_end: torch.Tensor | None = None  # [nq] long
    seg_start: torch.Tensor | None = None  # [nq] long
    host: HostRow | None = None  # the same arrays on the host, if the plan has them
    repair: Repair | None = None  # how its later tokens read its plus segments (None: as they are)

    @property
    def num_queries(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_keys(self) -> int:
        return int(self.key_slots.numel())


@dataclass
class AttentionPlan:
    rows: list[Row]
    positions: torch.Tensor  # [T] long: RoPE position of each token (its local position where its KV is stored)
    write_slots: torch.Tensor  # [T] long: flat slot each token's K/V is written to

    def visible(self, row: Row) -> torch.Tensor:
        """Boolean [nq, N] mask of which keys each query of `row` sees."""
        k = torch.arange(row.num_keys, device=row.q_pos.device)[None, :]
        t = row.q_pos[:, None]
        mask = k <= t
        if row.seg_start is not None:
            mask &= k >= row.seg_start[:, None]
        if row.anchor_end is not None:
            mask |= k < row.anchor_end[:, None]
        return mask

    def select(self, idx: torch.Tensor) -> "AttentionPlan":
        """The plan restricted to the tokens at sorted flat indices `idx` (a per-layer active
        set). Rows keep their key tables; rows left without queries are dropped."""
        rows = []
        for r in self.rows:
            a = int(torch.searchsorted(idx, r.q_start))
            b = int(torch.searchsorted(idx, r.q_end))
            if a == b:
                continue
            local = idx[a:b] - r.q_start
            rows.append(Row(a, b, r.q_pos[local], r.key_slots, r.key_delta,
                            None if r.anchor_end is None else r.anchor_end[local],
                            None if r.seg_start is None else r.seg_start[local], repair=r.repair))
        return AttentionPlan(rows, self.positions[idx], self.write_slots[idx])
