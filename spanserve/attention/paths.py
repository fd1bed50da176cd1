"""Which path a step, and each row of it, takes through attention: the one place that decides.

A step (the model runner, `worker/runner.py`) takes one of three paths:
- *decode graph*: every row is one causal query with nothing to recompute and the batch size has
  a graph (`engine/cuda_graphs.DecodeGraphs`; its inputs are described by
  `attention/triton/decode_launch.py` into the buffers of `attention/triton/graph_decode.py`);
- *step graph*: no row recomputes and the step has few enough tokens (`StepGraphs`; padded shapes
  and buffers in `attention/triton/graph_step.py`, described by `attention/triton/launch.py`);
- *eager*: anything else, launched from Python (`TritonBackend.attend`, described by `launch.py`).
Graphs exist only where the runner made them (a CUDA device and a backend with fixed-address
layouts); elsewhere every step is eager.

Inside a step each attention row (one request's queries over its keys) goes to one launch:
- the *decode launch*: rows of at most a decode program's queries (programs of BLOCK_M / G tokens,
  16-row tiles, fused rotation of Q);
- *dense*: a fresh prompt's row, or a later chunk of one (its queries the last of its keys, seen
  causally from position 0, unrotated), of at least `dense_min` queries, through torch's fused
  attention (`attention/triton/dense.py`); eager only;
- the *prefill launch*: every other row (wide tiles, keys prerotated into a scratch).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class StepPath(enum.Enum):
    DECODE_GRAPH = "decode graph"
    STEP_GRAPH = "step graph"
    EAGER = "eager"


class RowPath(enum.Enum):
    DECODE_LAUNCH = "decode launch"
    PREFILL_LAUNCH = "prefill launch"
    DENSE = "dense"


@dataclass(frozen=True)
class StepShape:
    rows: int
    tokens: int
    decode_only: bool  # every row is one causal query with nothing to recompute
    recompute: bool  # some row recomputes reused tokens (a policy's forward)


@dataclass(frozen=True)
class GraphLimits:
    decode_batch: int  # decode-only steps of 1..decode_batch rows replay a decode graph
    step_tokens: int  # other steps of up to step_tokens tokens, nothing recomputed, a step graph


def step_path(step: StepShape, graphs: GraphLimits | None) -> StepPath:
    """`graphs`: None when the runner has no graphs (CPU, a backend without fixed layouts, or
    graphs turned off)."""
    if graphs is not None:
        if step.decode_only and 0 < step.rows <= graphs.decode_batch:
            return StepPath.DECODE_GRAPH
        if not step.recompute and step.tokens <= graphs.step_tokens:
            return StepPath.STEP_GRAPH
    return StepPath.EAGER


def row_path(n_queries: int, fresh: bool, decode_queries: int, dense_min: int) -> RowPath:
    """`fresh`: the row's queries are the last of its keys, seen causally from position 0, unrotated;
    `decode_queries`: the decode launch's tokens per program; `dense_min`: 0 = no dense rows."""
    if n_queries <= decode_queries:
        return RowPath.DECODE_LAUNCH
    if fresh and 0 < dense_min <= n_queries:
        return RowPath.DENSE
    return RowPath.PREFILL_LAUNCH
