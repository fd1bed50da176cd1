"""When a request stops, and its text as its tokens arrive.

A stop is decided per token in this order (vLLM's): a stop token id, the end-of-sequence token,
a stop string, the grammar's end, the length limit. Everything but the stop string is decided
from the token alone (`token_stop`), where the engine steps; the stop string needs the text
(`OutputText`), which is built wherever the tokens are detokenized: in the engine for the Python
API, in the API server when the engine core runs in a process of its own. Both apply the same
order, so a request's text, tokens and finish reason are the same either way."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from spanserve.engine.detokenize import IncrementalText

# How a request stopped: a stop token id, the EOS token, a stop string, the grammar's end, length.
BEFORE_STRINGS = ("token", "eos")  # token stops that win over a stop string ending at the same token


@dataclass(frozen=True)
class Stop:
    reason: str  # the finish reason: "stop" or "length"
    stop_reason: str | int | None  # the stop string or stop token id, if one ended it
    by: str  # "token" | "eos" | "string" | "grammar" | "length"


def token_stop(tok: int, p: Any, eos: set[int], grammar_done: bool, n_out: int, at_max_len: bool) -> Stop | None:
    """The stop `tok` makes, short of a stop string. `p`: the SamplingParams."""
    if tok in p.stop_token_ids:
        return Stop("stop", tok, "token")
    if not p.ignore_eos and tok in eos:
        return Stop("stop", None, "eos")
    if grammar_done:
        return Stop("stop", None, "grammar")
    if n_out >= p.max_tokens or at_max_len:
        return Stop("length", None, "length")
    return None


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string that starts at or after search_from (text already emitted before
    that point was checked in earlier steps)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


@dataclass
class OutputText:
    """A request's text, grown by incremental detokenization and cut at its first stop string."""

    decode: Callable[[list[int]], str]
    params: Any  # SamplingParams: stop, include_stop_str_in_output
    text: str = ""
    _inc: IncrementalText | None = field(default=None, repr=False)

    def add(self, ids: list[int], stop: Stop | None) -> Stop | None:
        """`ids`: every output token so far, the newest just appended; `stop`: what the token
        decided (token_stop). Returns the request's stop, if this token ends it."""
        if self._inc is None:
            self._inc = IncrementalText(self.decode)
        prev = len(self.text)
        self.text = self._inc.update(ids)
        p = self.params
        if (stop is None or stop.by not in BEFORE_STRINGS) and p.stop:
            hit = find_stop(self.text, p.stop, prev)
            if hit is not None:
                i, s = hit
                self.text = self.text[: i + (len(s) if p.include_stop_str_in_output else 0)]
                return Stop("stop", s, "string")
        if stop is not None:  # not cut at a stop string: all of the text
            self.text = self._inc.update(ids, final=True)
        return stop
