"""A request and the work still owed on it."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from spanserve.cache.block_pool import Block
from spanserve.cache.table import Entry, Table, delta_array, slot_array
from spanserve.engine.detokenize import IncrementalText
from spanserve.engine.layout import Piece
from spanserve.engine.sampling import SamplingParams, TokenLogprobs


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Task:
    """Positions still to compute over one key table (one attention row).

    The main task is the request's own sequence in logical positions; a standalone segment being
    encoded is a task of its own in local positions. `todo` is sorted and consumed from the front,
    so everything before todo[0] already has KV: perforated holes are just gaps in `todo`."""

    tokens: list[int]
    entries: "list[Entry] | Table"  # the cache manager passes a Table (columns, built in bulk)
    todo: list[int]
    block_size: int
    sample: bool = False  # sample from the logits of the last position of `tokens`
    main: bool = False  # a task on the request's own (main) row
    recompute: Any = None  # reuse.recompute.RecomputeSpec: a policy recomputes reused tokens
    anchor_end: int | None = None  # plus-segment mask form; None = causal
    seg_start: int | None = None
    _slots: Any = field(default=None, repr=False)
    _deltas: Any = field(default=False, repr=False)  # False: not computed yet (None is a value)

    @property
    def slots(self) -> Any:
        """numpy int64 array: the flat slot of every position of this task's row."""
        if self._slots is None:
            self._slots = slot_array(self.entries, self.block_size)
        return self._slots

    @property
    def deltas(self) -> Any:
        """numpy int64 array: every key's delta, or None when all are zero."""
        if self._deltas is False:
            self._deltas = delta_array(self.entries)
        return self._deltas

    def set_entries(self, entries: "list[Entry] | Table") -> None:
        self.entries = entries
        self._slots = None
        self._deltas = False


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
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token; [0] is None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    detok: IncrementalText | None = None  # the engine's incremental decoding of the output
    first_token_time: float | None = None
    # cache state, owned by the cache manager while the request holds blocks
    tasks: list[Task] = field(default_factory=list)
    units: list[Any] = field(default_factory=list)  # cache.manager.Unit, owned by the cache manager
    sources: list[Any] = field(default_factory=list)  # shared segment units a policy recomputes from
    recompute_stats: dict[str, int] = field(default_factory=dict)
    held: list[Block] = field(default_factory=list)
    reuse: dict[str, int] = field(default_factory=lambda: {"prefix": 0, "perforated": 0, "segment": 0, "computed": 0})
    num_preemptions: int = 0

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
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def main(self) -> Task:
        return self.tasks[-1]

    @property
    def num_cached_tokens(self) -> int:
        r = self.reuse
        return r["prefix"] + r["perforated"] + r["segment"]
