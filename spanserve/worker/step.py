"""A step as the engine hands it to an executor (`StepInput`: host data only, so that it crosses
a process boundary as it is) and what comes back (`StepOutput`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from spanserve.attention.decode import DecodeRows
from spanserve.attention.host_plan import HostPlan
from spanserve.attention.paths import StepPath
from spanserve.reuse.recompute import RecomputeSpec


@dataclass
class StepInput:
    """One step as host data: its path, a decode-only step's rows (for the decode graphs) or the
    general plan, the selective rows (chunk index, spec, per-token reused flags), and, per chunk,
    the index of its sampled position in the flat batch (-1: none)."""

    sample_at: list[int]
    path: StepPath
    decode: DecodeRows | None = None
    host: HostPlan | None = None
    recompute: list[tuple[int, RecomputeSpec, list[bool]]] = field(default_factory=list)
    # A decode step chained on the device: its input ids are the tokens the driver picked last
    # step, still on the device (the host has not seen them), broadcast to every rank under TP.
    chained: bool = False


@dataclass
class StepOutput:
    """Float32 logits of the sampled positions, each chunk's row in them (-1: none), the hidden
    states of every position (eager steps; graph steps return their fixed buffer's), and the
    recompute statistics of each of the step's selective rows, in `StepInput.recompute` order."""

    logits: torch.Tensor
    rows: list[int]
    hidden: torch.Tensor
    recompute_stats: list[dict[str, Any]] = field(default_factory=list)
