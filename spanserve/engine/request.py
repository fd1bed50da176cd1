"""A request: its prompt, layout, sampling parameters, output so far, and what it holds in the cache."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from spanserve.cache.block_pool import Block
from spanserve.cache.claim import Admission, Piece, Task
from spanserve.cache.units import Holding, Unit
from spanserve.engine.params import SamplingParams
from spanserve.engine.sampling import TokenLogprobs
from spanserve.engine.stops import OutputText


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: str = ""
    generator: torch.Generator | None = None
    pieces: list[Piece] = field(default_factory=list)  # resolved layout; empty = one plain prompt
    policy: Any = None  # reuse.policies.Policy; None = pure span semantics
    encode_only: bool = False  # pin requests: encode the plus units, sample nothing
    tenant: str = ""  # whose request: admission is fair across tenants, a pin is owned by its tenant
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token; [0] is None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    stopped_by: str | None = None  # engine/stops.py's Stop.by
    output: OutputText | None = None  # the text, where the engine detokenizes
    first_token_time: float | None = None
    # what the request holds in the cache, owned by the cache manager while the request is admitted
    kv: Holding = field(default_factory=Holding)
    recompute_stats: dict[str, int] = field(default_factory=dict)
    # how the prompt was first served (a resumed request keeps reporting its first admission)
    reuse: dict[str, int] = field(default_factory=lambda: {"prefix": 0, "perforated": 0, "segment": 0, "computed": 0})
    num_preemptions: int = 0
    # its main task ends in a placeholder for a token still on the device (engine/overlap.py)
    token_in_flight: bool = False

    def admission(self) -> Admission:
        """The request as the cache manager admits it."""
        return Admission(self.current_pieces(), self.all_token_ids, self.namespace, self.policy, self.encode_only,
                         compute_all=self.params.prompt_logprobs is not None)

    def hold(self, kv: Holding) -> None:
        """Carry what admission gave."""
        self.kv = kv
        if self.num_preemptions == 0:
            self.reuse = kv.reuse

    def current_pieces(self) -> list[Piece]:
        """The layout as it stands: generated tokens extend the final cross piece (a preempted
        request is readmitted with its output as part of the prompt)."""
        pieces = self.pieces or [Piece("cross", tuple(self.prompt_token_ids), 0)]
        if not self.output_token_ids:
            return list(pieces)
        last = pieces[-1]
        return list(pieces[:-1]) + [Piece(last.kind, last.tokens + tuple(self.output_token_ids), last.start)]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def text(self) -> str:
        return "" if self.output is None else self.output.text

    @property
    def computed(self) -> bool:
        """Every position of every task has its KV: nothing left to run but a next token."""
        return not any(t.todo for t in self.kv.tasks)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def tasks(self) -> list[Task]:
        return self.kv.tasks

    @property
    def units(self) -> list[Unit]:
        return self.kv.units

    @property
    def sources(self) -> list[Unit]:
        return self.kv.sources

    @property
    def held(self) -> list[Block]:
        return self.kv.held

    @property
    def main(self) -> Task:
        return self.kv.main

    @property
    def num_cached_tokens(self) -> int:
        r = self.reuse
        return r["prefix"] + r["perforated"] + r["segment"]
