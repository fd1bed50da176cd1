"""Pieces shared by the GPU tests: the Llama-3-8B shape, span layouts of random tokens, a cold
then warm run of them, and the teardown that gives an engine's device memory back before the
next one is built."""
from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from spanserve import LLM, SamplingParams, Segment
from spanserve.model.shapes import llama3_8b

LLAMA3_8B = llama3_8b()  # weights are random in these tests


def release() -> None:
    """Give the device memory of engines already shut down and dropped back to the driver, so the
    next engine's KV sizing sees it free: `llm.shutdown(); del llm; release()`."""
    gc.collect()
    torch.cuda.empty_cache()


def span_layouts(gen: torch.Generator, vocab: int, doc: list[int]) -> list[list[Segment] | list[int]]:
    """Two span layouts that place `doc` at different positions (non-zero deltas once cached),
    one with an anchored plus segment, and a plain prompt."""
    def t(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    return [
        [Segment(token_ids=t(11)), Segment(token_ids=doc, kind="plus"), Segment(token_ids=t(30), kind="plus"),
         Segment(token_ids=t(7))],
        [Segment(token_ids=t(29)), Segment(token_ids=t(13), kind="plus", anchor="prefix"),
         Segment(token_ids=doc, kind="plus"), Segment(token_ids=t(5))],
        t(50),
    ]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def cold_then_warm(make: Callable[[], LLM], lays: list, params: SamplingParams,
                   check: Callable[[LLM], None] | None = None, **kw: Any) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of `lays` cold, then warm in the other order (each back in `lays`' order),
    from the engine `make` builds (after `check` looks at it); it is shut down and its memory
    released before this returns, so the caller holds no engine when it builds the next."""
    llm = make()
    try:
        if check is not None:
            check(llm)
        cold = [o.token_ids for o in llm.generate(lays, params, **kw)]
        warm = [o.token_ids for o in llm.generate(lays[::-1], params, **kw)][::-1]
    finally:
        llm.shutdown()
        del llm
        release()
    return cold, warm
