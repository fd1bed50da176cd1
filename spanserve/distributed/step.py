"""The one message a step sends from the driver to the workers: the storage operations since the
last step and the step's host data, with its long per-key arrays run-length coded (a row's key
slots are runs of consecutive slots, one per block; its deltas are runs of one value per span)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from spanserve.attention.decode import DecodeRows
from spanserve.attention.host_plan import HostPlan
from spanserve.attention.plan import HostRow
from spanserve.distributed.storage_log import Op
from spanserve.worker.step import StepInput


@dataclass
class Runs:
    """An int64 array as runs: run i is starts[i] + step * [0, lengths[i])."""

    starts: np.ndarray
    lengths: np.ndarray
    step: int  # 1: consecutive values (slots); 0: repeated values (deltas)

    @classmethod
    def of(cls, a: np.ndarray, step: int) -> "Runs":
        a = np.asarray(a, dtype=np.int64)
        if a.size == 0:
            return cls(a, a, step)
        breaks = np.flatnonzero(np.diff(a) != step) + 1
        heads = np.concatenate([[0], breaks])
        lengths = np.diff(np.concatenate([heads, [a.size]]))
        return cls(a[heads], lengths, step)

    def array(self) -> np.ndarray:
        n = int(self.lengths.sum())
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        offset = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(self.lengths) - self.lengths, self.lengths)
        return np.repeat(self.starts, self.lengths) + self.step * offset


@dataclass
class StepMessage:
    ops: list[Op]  # storage operations since the last step, in order
    step: StepInput | None  # None: the engine is shutting down


@dataclass
class ScoreRows:
    """Workers: the LM head over these rows of the last step's hidden states (prompt logprobs:
    its vocabulary gather is a collective every rank joins)."""

    ops: list[Op]
    rows: list[int]


def _pack_opt(a: np.ndarray | None, step: int) -> Runs | None:
    return None if a is None else Runs.of(a, step)


def _unpack_opt(r: Runs | None) -> np.ndarray | None:
    return None if r is None else r.array()


def pack(step: StepInput) -> StepInput:
    """`step` with its per-key arrays as Runs (a copy; the driver's own step is left as is)."""
    if step.decode is not None:
        d = step.decode
        dec = DecodeRows(list(d.ids), list(d.pos), [Runs.of(s[:p + 1], 1) for s, p in zip(d.slots, d.pos)],
                         [None if x is None else Runs.of(x[:p + 1], 0) for x, p in zip(d.deltas, d.pos)], d.repairs)
        return dataclasses.replace(step, decode=dec)
    hp = step.host
    assert hp is not None
    rows = [HostRow(r.q_pos, Runs.of(r.key_slots, 1), _pack_opt(r.key_delta, 0), r.anchor_end, r.seg_start, r.repair)
            for r in hp.rows]
    return dataclasses.replace(step, host=HostPlan(hp.ids, hp.positions, hp.write_slots, rows))


def unpack(step: StepInput) -> StepInput:
    if step.decode is not None:
        d = step.decode
        return dataclasses.replace(step, decode=DecodeRows(d.ids, d.pos, [s.array() for s in d.slots],
                                                           [_unpack_opt(x) for x in d.deltas], d.repairs))
    hp = step.host
    assert hp is not None
    rows = [HostRow(r.q_pos, r.key_slots.array(), _unpack_opt(r.key_delta), r.anchor_end, r.seg_start, r.repair)
            for r in hp.rows]
    return dataclasses.replace(step, host=HostPlan(hp.ids, hp.positions, hp.write_slots, rows))
