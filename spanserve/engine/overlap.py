"""Decode steps chained on the device: the host schedules and launches step k+1 while the GPU still
runs step k, whose picked tokens reach the host only after k+1 is queued behind it.

At batch 1 a decode step's host work (scheduling, the step's host arrays, under tensor parallelism
the step message to the workers, sampling, stop checks, detokenizing) is a tenth to a quarter of the
GPU's time for an 8B model; done between steps, the GPU waits for it every step. Chained, it runs
while the GPU works. Step k+1's input ids are step k's picks, copied on the device (and broadcast
from the driver to every rank under TP); the request holds a placeholder for that token on the
host until the picks arrive.

A request chains only when nothing about its next pick needs this token on the host first: no
logprobs, no penalties (their histories would lack it), no structured output (its grammar must
advance), and its first token already out (that step also snapshots the prompt). A request that a
pick may stop (EOS, a stop string) costs at most one wasted row of one step: its KV slot for the
row is its own, and the step that computed it is ordered before any later user of the slot."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from spanserve.engine.request import Request


class HostTokens:
    """Token ids picked on the device on their way to the host: the copy is queued behind the step
    that picks them, and `get` waits for it only when the host needs them."""

    def __init__(self, ids: torch.Tensor):
        self.device_ids = ids
        self._done: torch.cuda.Event | None = None
        if ids.is_cuda:
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = ids

    def get(self) -> list[int]:
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()

    def rows(self, index: list[int]) -> torch.Tensor:
        """The picks of these rows, in this order, on the device."""
        if index == list(range(self.device_ids.numel())):
            return self.device_ids
        return self.device_ids[torch.tensor(index, dtype=torch.long, device=self.device_ids.device)]


@dataclass
class Pending:
    """A decode step on the device whose picks the host has not seen."""

    sampled: list[tuple["Request", int]]  # each sampled request and its row in the picks
    picks: HostTokens
    started: float  # perf_counter when the step was scheduled
    keys: int  # keys attended over the batch (decode statistics)

    def index_of(self, requests: list["Request"]) -> list[int]:
        row = {id(r): i for r, i in self.sampled}
        return [row[id(r)] for r in requests]


def chains(req: "Request", structured: bool) -> bool:
    """Whether the request's next pick may be made before the host sees its current one."""
    p = req.params
    return (not structured and not req.encode_only and bool(req.output_token_ids) and p.logprobs is None
            and p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1)


def may_continue(req: "Request", max_model_len: int) -> bool:
    """False when the token in flight is the request's last by length: nothing follows it."""
    return (len(req.output_token_ids) + 1 < req.params.max_tokens
            and len(req.main.tokens) + 1 < max_model_len)
