"""What the engine hands back for a request."""
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
