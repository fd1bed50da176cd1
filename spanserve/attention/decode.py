"""A decode-only step as plain host arrays: what the model runner hands a backend's fixed-address
(CUDA-graph) layout when every row of the step is one causal query, instead of a general plan."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spanserve.attention.plan import Repair


@dataclass
class DecodeRows:
    """Row b's one query is token ids[b] at position pos[b]: it writes its K/V to slots[b][pos[b]]
    and sees keys [0, pos[b]], stored at slots[b][:pos[b] + 1] and rotated by deltas[b] (None: all
    zero)."""

    ids: list[int]
    pos: list[int]
    slots: list[np.ndarray]  # int64, at least pos[b] + 1 each
    deltas: list[np.ndarray | None]
    repairs: list[Repair | None] | None = None  # None: no row has one

    def __len__(self) -> int:
        return len(self.pos)
