"""What crosses between the engine core and its clients: plain structs, the same objects in one
process and msgpack (msgspec) between processes. A client sends checked requests, aborts and
named calls; the core answers each step with one `StepOutputs` holding what every request it
advanced gained (new tokens, their logprobs, how it finished), and each call with a `Reply`."""
from __future__ import annotations

from typing import Any

import msgspec

from spanserve.engine.prepare import Prepared
from spanserve.engine.sampling import TokenLogprobs


class Add(msgspec.Struct, tag="add"):
    requests: list[Prepared]
    client: int = 0  # which client (API server) the outputs go to


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Call(msgspec.Struct, tag="call"):
    """A named request to the core (`EngineCore.calls`): its reply carries `call_id`."""

    call_id: int
    method: str
    args: list[Any] = []
    client: int = 0


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


Input = Add | Abort | Call | Shutdown


class Delta(msgspec.Struct, omit_defaults=True):
    """What one request gained in one step. `finish_reason` is set on its last delta; `by` says
    how it stopped (engine/stops.py's Stop.by, or "abort"/"error"); `metrics` (cached tokens,
    reuse counts, preemptions, recompute statistics) come with its first and last deltas."""

    request_id: str
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    by: str | None = None
    metrics: dict[str, Any] | None = None
    error: str | None = None


class StepOutputs(msgspec.Struct, tag="step"):
    deltas: list[Delta]
    steps: int  # steps the core has taken: its heartbeat


class Reply(msgspec.Struct, tag="reply"):
    call_id: int
    value: Any = None
    error: str | None = None


class Beat(msgspec.Struct, tag="beat"):
    """Sent while the core has nothing to do, so that a client can tell idle from dead."""

    steps: int


Output = StepOutputs | Reply | Beat
INPUTS = msgspec.msgpack.Decoder(Input)
OUTPUTS = msgspec.msgpack.Decoder(Output)
ENCODER = msgspec.msgpack.Encoder()
