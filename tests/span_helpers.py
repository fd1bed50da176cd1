"""Shared helpers for span-layout tests: capture the engine's prompt logits per request."""
from __future__ import annotations

import torch

from spanserve.engine.engine import LLMEngine
from spanserve.engine.sampling import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def capture_logits(engine: LLMEngine) -> dict[str, torch.Tensor]:
    """request id -> logits of its first sampled position (the end of the prompt)."""
    seen: dict[str, torch.Tensor] = {}
    run = engine.runner.run

    def wrapped(chunks, *args):
        logits, rows = run(chunks, *args)
        for c, r in zip(chunks, rows):
            if r >= 0 and c.request.request_id not in seen:
                seen[c.request.request_id] = logits[r].clone()
        return logits, rows

    engine.runner.run = wrapped  # type: ignore[method-assign]
    return seen


def run_all(engine: LLMEngine, prompts, params=ONE, namespace="", policy=None) -> list[str]:
    ids = [engine.add_request(p, params, namespace=namespace, policy=policy).request_id for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return ids
