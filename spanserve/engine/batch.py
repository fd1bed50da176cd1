"""A step's chunks as one flat batch of host data (`StepInput`): what the engine hands its
executor. Decode-only steps that a decode graph replays skip the general plan: their rows are
written as plain arrays (on a GPU the host work is what such a step waits for)."""
from __future__ import annotations

import numpy as np

from spanserve.attention.decode import DecodeRows
from spanserve.attention.host_plan import HostPlan
from spanserve.attention.paths import GraphLimits, StepPath, StepShape, step_path
from spanserve.attention.plan import HostRow
from spanserve.engine.scheduler import Chunk
from spanserve.worker.step import StepInput


def host_plan(chunks: list[Chunk]) -> tuple[HostPlan, list[int]]:
    """The step as host arrays, and the index into the flat batch of each chunk's sampled position
    (-1: none)."""
    ids, positions, writes = [], [], []
    rows: list[HostRow] = []
    sample_at: list[int] = []
    start = 0
    for c in chunks:
        t = c.task
        pos = np.asarray(c.positions, dtype=np.int64)
        slots = t.slots
        n_keys = int(pos[-1]) + 1
        deltas = t.deltas
        nq = len(pos)
        ids.append(np.asarray(t.tokens, dtype=np.int64)[pos] if nq > 64 else [t.tokens[p] for p in c.positions])
        positions.append(pos)
        writes.append(slots[pos])
        rows.append(HostRow(pos, slots[:n_keys], None if deltas is None else deltas[:n_keys],
                            None if t.anchor_end is None else np.full(nq, t.anchor_end, dtype=np.int64),
                            None if t.seg_start is None else np.full(nq, t.seg_start, dtype=np.int64), t.repair))
        sample_at.append(start + nq - 1 if t.sample and c.positions[-1] == len(t.tokens) - 1 else -1)
        start += nq
    flat_ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in ids])
    return HostPlan(flat_ids, np.concatenate(positions), np.concatenate(writes), rows), sample_at


def decode_rows(chunks: list[Chunk]) -> tuple[DecodeRows, list[int]] | None:
    """The step as host arrays when every chunk is one causal query with nothing to recompute
    (what a decode graph replays), with host_plan's sample_at; None for any other step."""
    ids, pos, slots, deltas, sample_at, repairs = [], [], [], [], [], []
    for b, c in enumerate(chunks):
        t = c.task
        if len(c.positions) != 1 or c.recompute is not None or t.anchor_end is not None or t.seg_start is not None:
            return None
        p = c.positions[0]
        ids.append(t.tokens[p])
        pos.append(p)
        slots.append(t.slots)
        deltas.append(t.deltas)
        repairs.append(t.repair)
        sample_at.append(b if t.sample and p == len(t.tokens) - 1 else -1)
    return DecodeRows(ids, pos, slots, deltas, repairs if any(r is not None for r in repairs) else None), sample_at


def prepare(chunks: list[Chunk], graphs: GraphLimits | None, eager: bool = False) -> StepInput:
    """The step as host data only: what an executor runs (on this process or, under tensor
    parallelism, on every rank). `graphs`: the executor's graph limits (None: it has none);
    eager: the general plan, launched from Python (every position's hidden state comes back)."""
    dec = decode_rows(chunks) if graphs is not None and not eager else None
    if eager:
        path = StepPath.EAGER
    else:
        shape = StepShape(len(chunks), sum(len(c.positions) for c in chunks), dec is not None,
                          any(c.recompute is not None for c in chunks))
        path = step_path(shape, graphs)
    if path is StepPath.DECODE_GRAPH:
        assert dec is not None
        return StepInput(dec[1], path, decode=dec[0])
    hp, sample_at = host_plan(chunks)
    recompute = []
    for r, c in enumerate(chunks):
        if c.recompute is not None:
            reused = set(c.recompute.reused)
            recompute.append((r, c.recompute, [p in reused for p in c.positions]))
    return StepInput(sample_at, path, host=hp, recompute=recompute)
