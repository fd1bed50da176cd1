"""Shared helpers for span-layout tests: capture the engine's prompt logits per request."""
from __future__ import annotations

import torch

from spanserve.engine.engine import LLMEngine
from spanserve.engine.params import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def capture_logits(engine: LLMEngine) -> dict[str, torch.Tensor]:
    """request id -> logits of its first sampled position (the end of the prompt)."""
    seen: dict[str, torch.Tensor] = {}
    run_step = engine._run

    def wrapped(schedule, t0):
        chunks, outs, execute = list(schedule.chunks), [], engine.executor.run

        def run(*args, **kwargs):
            outs.append(execute(*args, **kwargs))
            return outs[-1]
        engine.executor.run = run  # type: ignore[method-assign]
        try:
            result = run_step(schedule, t0)
        finally:
            engine.executor.run = execute  # type: ignore[method-assign]
        for c, r in zip(chunks, outs[0].rows):
            if r >= 0 and c.request.request_id not in seen:
                seen[c.request.request_id] = outs[0].logits[r].clone()
        return result

    engine._run = wrapped  # type: ignore[method-assign]
    return seen


def run_all(engine: LLMEngine, prompts, params=ONE, namespace="", policy=None) -> list[str]:
    ids = [engine.add_request(p, params, namespace=namespace, policy=policy).request_id for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return ids


def assert_cold_and_warm(engine: LLMEngine, segs, ref: torch.Tensor, policy=None) -> None:
    """The layout's prompt-end logits equal `ref` when it runs cold and again warm, and every block
    is free afterwards."""
    seen = capture_logits(engine)
    cold, warm = run_all(engine, [segs], policy=policy) + run_all(engine, [segs], policy=policy)
    for rid in (cold, warm):
        torch.testing.assert_close(seen[rid].double(), ref, rtol=0, atol=1e-4)
    assert engine.pool.num_free == engine.pool.num_blocks
