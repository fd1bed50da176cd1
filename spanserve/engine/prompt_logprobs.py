"""Logprobs of a request's prompt tokens (vLLM's `prompt_logprobs`, and `echo` with logprobs).

Token i of the prompt is scored by the logits at position i - 1, so these come from the hidden
states of prefill chunks, which a normal step throws away after the last position. Only steps
holding such a request keep them (the runner's eager path), and such a request is admitted with
no cache hits (cache/manager.py), because a position served from the cache has no hidden state.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spanserve.engine.sampling import TokenLogprobs

# Rows of logits materialised at once: [rows, vocab] float32 stays small for long prompts.
SLICE_ROWS = 256


def wants_prompt_logprobs(chunk: Any) -> bool:
    return chunk.task.main and chunk.request.params.prompt_logprobs is not None


def score_positions(logits_at: Any, rows: Sequence[int], targets: Sequence[int], n_top: int) -> list[TokenLogprobs]:
    """For rows of the step's flat batch and the token each one predicts, the target's logprob and
    rank and the top n_top alternatives; logits_at maps a list of rows to their float32 logits (a
    runner's `logits_at`: under tensor parallelism every rank takes part, slice by slice)."""
    out: list[TokenLogprobs] = []
    for lo in range(0, len(targets), SLICE_ROWS):
        lp = torch.log_softmax(logits_at(list(rows[lo:lo + SLICE_ROWS])).float(), dim=-1)
        tgt = torch.tensor(targets[lo:lo + SLICE_ROWS], dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, tgt[:, None])
        # rank 1 = the most likely token; ties count in the target's favour
        ranks = (lp > chosen).sum(dim=-1).add_(1).tolist()
        vals = chosen[:, 0].tolist()
        top_v: list[list[float]] = [[] for _ in vals]
        top_i: list[list[int]] = [[] for _ in vals]
        if n_top > 0:
            top = torch.topk(lp, min(n_top, lp.shape[-1]), dim=-1)
            top_v, top_i = top.values.tolist(), top.indices.tolist()
        for k, t in enumerate(targets[lo:lo + SLICE_ROWS]):
            out.append(TokenLogprobs(token_id=t, logprob=vals[k], top=dict(zip(top_i[k], top_v[k])), rank=ranks[k]))
    return out


def record_prompt_logprobs(logits_at: Any, chunks: Sequence[Any]) -> None:
    """Fill request.prompt_logprobs from the step just run (chunks in batch order; logits_at maps
    rows of its flat batch to logits)."""
    start = 0
    for c in chunks:
        n = len(c.positions)
        if wants_prompt_logprobs(c):
            req = c.request
            prompt_len = len(req.prompt_token_ids)
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None] * prompt_len
            # position p predicts token p + 1; positions past the prompt (a resumed request
            # recomputing its output) score generated tokens, which the sampler reports
            keep = [k for k, p in enumerate(c.positions) if p + 1 < prompt_len]
            if keep:
                targets = [req.prompt_token_ids[c.positions[k] + 1] for k in keep]
                scored = score_positions(logits_at, [start + k for k in keep], targets, req.params.prompt_logprobs)
                for k, entry in zip(keep, scored):
                    req.prompt_logprobs[c.positions[k] + 1] = entry
        start += n
