"""attention/paths.py, the one place that decides a step's path and each row's launch, against the
rules written out case by case."""
from __future__ import annotations

import itertools

from spanserve.attention.paths import GraphLimits, RowPath, StepPath, StepShape, row_path, step_path


def expected_step(rows: int, tokens: int, decode_only: bool, recompute: bool, limits: GraphLimits | None) -> StepPath:
    if limits is None:
        return StepPath.EAGER
    if decode_only and 1 <= rows <= limits.decode_batch:
        return StepPath.DECODE_GRAPH
    if not recompute and tokens <= limits.step_tokens:
        return StepPath.STEP_GRAPH
    return StepPath.EAGER


def test_step_path_every_combination() -> None:
    limits = [None, GraphLimits(2, 64), GraphLimits(64, 256), GraphLimits(0, 0)]
    for rows, tokens, decode_only, recompute, lim in itertools.product(
            [0, 1, 2, 3, 64, 65], [1, 3, 64, 65, 256, 257], [False, True], [False, True], limits):
        if decode_only and (recompute or tokens != rows):
            continue  # a decode-only step has one query per row and recomputes nothing
        got = step_path(StepShape(rows, tokens, decode_only, recompute), lim)
        assert got is expected_step(rows, tokens, decode_only, recompute, lim), (rows, tokens, decode_only, lim)


def test_decode_batch_over_the_limit_falls_to_a_step_graph_then_eager() -> None:
    lim = GraphLimits(decode_batch=2, step_tokens=4)
    assert step_path(StepShape(2, 2, True, False), lim) is StepPath.DECODE_GRAPH
    assert step_path(StepShape(3, 3, True, False), lim) is StepPath.STEP_GRAPH
    assert step_path(StepShape(5, 5, True, False), lim) is StepPath.EAGER
    assert step_path(StepShape(1, 4, False, True), lim) is StepPath.EAGER  # recomputation never replays


def test_row_path() -> None:
    for nq, fresh, small_q, dense_min in itertools.product([1, 4, 5, 1023, 1024, 5000], [False, True],
                                                           [1, 4, 32], [0, 1024]):
        got = row_path(nq, fresh, small_q, dense_min)
        if nq <= small_q:
            assert got is RowPath.DECODE_LAUNCH
        elif fresh and dense_min and nq >= dense_min:
            assert got is RowPath.DENSE
        else:
            assert got is RowPath.PREFILL_LAUNCH
