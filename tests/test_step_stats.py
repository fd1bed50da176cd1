"""Decode-step totals by batch size: counted by the engine, exposed on /metrics."""
from __future__ import annotations

from pathlib import Path

import pytest

from spanserve import LLM, SamplingParams
from spanserve.engine.step_stats import BatchTotals, DecodeStepStats


def test_record_accumulates_per_batch() -> None:
    s = DecodeStepStats()
    s.record(3, 30, 0.5)
    s.record(3, 33, 0.25)
    s.record(1, 7, 0.125)
    assert s.snapshot() == {3: BatchTotals(2, 0.75, 63), 1: BatchTotals(1, 0.125, 7)}


def test_engine_counts_decode_steps_and_keys(tmp_path: Path) -> None:
    """Two prompts of 5 and 9 tokens, 4 and 2 new tokens: the first token comes from the prefill
    step (not counted), then decode steps hold both rows until the shorter one finishes."""
    from tiny_models import make_tiny_model

    llm = LLM(str(make_tiny_model("llama", tmp_path)[0]), num_blocks=32)
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)]
    llm.generate([list(range(10, 15)), list(range(20, 29))], params)
    got = llm.engine.decode_stats.snapshot()
    # Dense count: a decode step for a row at position p reads p + 1 keys.
    # step 1: rows at 5 and 9; then only the first row, at 6 and 7.
    assert {b: (t.steps, t.kv_tokens) for b, t in got.items()} == {2: (1, 6 + 10), 1: (2, 7 + 8)}
    assert all(t.seconds > 0 for t in got.values())


def test_metrics_expose_decode_steps(tmp_path: Path) -> None:
    from tiny_models import make_tiny_model

    from spanserve.engine.core import CALLS, EngineCore
    from spanserve.server.metrics import ServerMetrics

    llm = LLM(str(make_tiny_model("llama", tmp_path)[0]), num_blocks=32)
    llm.generate([list(range(10, 15))], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    stats = CALLS["stats"](EngineCore(llm.engine))  # what the /metrics route asks the engine core for
    text = ServerMetrics().render(stats).decode()
    assert 'spanserve_decode_steps_total{batch="1"} 2.0' in text
    assert 'spanserve_decode_kv_tokens_total{batch="1"} 13.0' in text  # 6 + 7 keys
    line = next(ln for ln in text.splitlines() if ln.startswith('spanserve_decode_step_seconds_total{batch="1"}'))
    assert float(line.split()[1]) == pytest.approx(llm.engine.decode_stats.snapshot()[1].seconds)
