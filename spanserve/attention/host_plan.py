"""A step's plan as host arrays only: what a fixed-address (CUDA-graph) layout is filled from, and
what the general plan's device tensors are made of."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from spanserve.attention.plan import HostRow


@dataclass
class HostPlan:
    """Token i of the step is ids[i] at RoPE position positions[i], writing its K/V to flat slot
    write_slots[i]. Rows take consecutive ranges of tokens, in order (row r has len(rows[r].q_pos)
    queries)."""

    ids: np.ndarray  # [T] int64
    positions: np.ndarray
    write_slots: np.ndarray
    rows: list[HostRow]
