"""Decode steps chained on the device: the host schedules and launches step k+1 while the GPU still
runs step k, whose picked tokens reach the host only after k+1 is queued behind it.

At batch 1 a decode step's host work (scheduling, the step's host arrays, under tensor parallelism
the step message to the workers, sampling, stop checks, detokenizing) is a tenth to a quarter of the
GPU's time for an 8B model; done between steps, the GPU waits for it every step. Chained, it runs
while the GPU works. Step k+1's input ids are step k's picks, copied on the device (and broadcast
from the driver to every rank under TP); the request holds a placeholder for that token on the
host until the picks arrive. The engine's step loop drives this (`LLMEngine.step`); this module
holds the rules and the data of a step in flight.

A request chains only when nothing about its next pick needs this token on the host first: no
penalties (their histories would lack it), no structured output (its grammar must advance), and
its first token already out (that step also snapshots the prompt). Logprobs are computed on the
device with the picks and reach the host with them. A request that a
pick may stop (EOS, a stop string) costs at most one wasted row of one step: its KV slot for the
row is its own, and the step that computed it is ordered before any later user of the slot."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from spanserve.attention.paths import StepPath
from spanserve.worker.host_tokens import HostTokens
from spanserve.worker.step import StepInput

if TYPE_CHECKING:
    from spanserve.engine.request import Request
    from spanserve.engine.sampling import LogprobTensors
    from spanserve.engine.scheduler import Chunk


@dataclass
class Pending:
    """A decode step on the device whose picks the host has not seen."""

    sampled: list[tuple["Request", int]]  # each sampled request and its row in the picks
    picks: HostTokens  # with the logprob tensors, if any row asked for logprobs
    started: float  # perf_counter when the step was scheduled
    keys: int  # keys attended over the batch (decode statistics)
    logprobs: "LogprobTensors | None" = None

    def index_of(self, requests: list["Request"]) -> list[int]:
        row = {id(r): i for r, i in self.sampled}
        return [row[id(r)] for r in requests]


def chains(req: "Request", structured: bool) -> bool:
    """Whether the request's next pick may be made before the host sees its current one."""
    p = req.params
    return (not structured and not req.encode_only and bool(req.output_token_ids)
            and p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1)


def may_continue(req: "Request", max_model_len: int) -> bool:
    """False when the token in flight is the request's last by length: nothing follows it."""
    return (len(req.output_token_ids) + 1 < req.params.max_tokens
            and len(req.main.tokens) + 1 < max_model_len)


def chainable(chunks: list["Chunk"], step: StepInput, structured: list[bool], max_model_len: int) -> bool:
    """Whether this step's picks may stay on the device for the next step to read."""
    return (step.path is StepPath.DECODE_GRAPH and all(i >= 0 for i in step.sample_at)
            and all(chains(c.request, s) for c, s in zip(chunks, structured))
            and any(may_continue(c.request, max_model_len) for c in chunks))


def next_is_chained(running: list["Request"], admissible: bool, free_blocks: int) -> bool:
    """The next step is exactly the placeholders' decode rows: nothing that waits can be
    admitted (none waits, or the batch is full), every running request with work has a
    placeholder, and no one can be preempted (each needs one block at most)."""
    return (not admissible and free_blocks >= len(running)
            and any(r.token_in_flight for r in running)
            and all(r.token_in_flight or r.computed for r in running))


def continues(chunks: list["Chunk"], step: StepInput | None, preempted: bool) -> bool:
    """Whether a scheduled step is the chained step the placeholders promised."""
    return (step is not None and not preempted and step.path is StepPath.DECODE_GRAPH
            and all(c.request.token_in_flight and i >= 0 for c, i in zip(chunks, step.sample_at)))
