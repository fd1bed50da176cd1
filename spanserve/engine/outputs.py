"""What the engine hands back for a request, and how text and stop strings are tracked."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spanserve.engine.sampling import TokenLogprobs


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" while finished, else None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # [0] is None: nothing precedes it
    metrics: dict[str, Any] = field(default_factory=dict)


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string that starts at or after search_from (text already emitted before
    that point was checked in earlier steps)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best
