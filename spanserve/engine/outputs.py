"""What the engine hands back for a request, and how text and stop strings are tracked."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spanserve.engine.sampling import TokenLogprobs

if TYPE_CHECKING:
    from spanserve.engine.request import Request


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


def stop_check(text: str, prev_len: int, tok: int, p: Any, eos: set[int], grammar_done: bool, n_out: int,
               at_max_len: bool) -> tuple[str | None, str | int | None, str]:
    """After appending `tok` (the text grew from prev_len characters): (finish reason or None,
    stop reason, the text cut at a stop string if one ended it). `p`: the SamplingParams."""
    if tok in p.stop_token_ids:
        return "stop", tok, text
    if not p.ignore_eos and tok in eos:
        return "stop", None, text
    if p.stop and (hit := find_stop(text, p.stop, prev_len)) is not None:
        i, s = hit
        return "stop", s, text[: i + (len(s) if p.include_stop_str_in_output else 0)]
    if grammar_done:
        return "stop", None, text
    if n_out >= p.max_tokens or at_max_len:
        return "length", None, text
    return None, None, text


def output_of(req: "Request") -> RequestOutput:
    """The request as it stands, for the caller (cumulative text, tokens and logprobs)."""
    ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
    metrics = {"ttft": ttft, "prompt_tokens": len(req.prompt_token_ids),
               "cached_tokens": req.num_cached_tokens, "reuse": dict(req.reuse),
               "preemptions": req.num_preemptions, "recompute": dict(req.recompute_stats)}
    return RequestOutput(
        request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, text=req.text,
        token_ids=list(req.output_token_ids), finished=req.finished, finish_reason=req.finish_reason,
        stop_reason=req.stop_reason, logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
        prompt_logprobs=None if req.prompt_logprobs is None else list(req.prompt_logprobs),
        metrics=metrics,
    )
