"""Span layouts: a prompt as segments that depend on what precedes them (`cross`) or stand alone
(`plus`), resolved to token pieces at contiguous logical positions."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

KINDS = ("cross", "plus")
ANCHORS = ("none", "prefix")


@dataclass(frozen=True)
class Segment:
    text: str | None = None
    token_ids: Sequence[int] | None = None
    kind: str = "cross"
    anchor: str = "none"  # plus only: "prefix" = encoded after the leading cross segments
    key: str | None = None  # optional name, for pinning and reporting

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("a Segment needs exactly one of text= or token_ids=")
        if self.kind not in KINDS:
            raise ValueError(f"unknown segment kind {self.kind!r}; use one of {KINDS}")
        if self.anchor not in ANCHORS:
            raise ValueError(f"unknown anchor {self.anchor!r}; use one of {ANCHORS} "
                             "(an anchor is the leading cross segments, never arbitrary text)")
        if self.kind == "cross" and self.anchor != "none":
            raise ValueError("anchor applies to plus segments only; drop anchor= from the cross segment")


@dataclass(frozen=True)
class Piece:
    """A resolved segment: its tokens sit at logical positions [start, start + len(tokens));
    a plus piece is encoded at local positions [anchor_len, anchor_len + len) after the first
    anchor_len tokens of the prompt."""

    kind: str
    tokens: tuple[int, ...]
    start: int
    anchor_len: int = 0
    key: str | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def resolve(segments: Sequence[Segment | str], encode: Callable[[str], list[int]], policy: str,
            require_tail: bool = True, check: Callable[[Sequence[int]], list[int]] | None = None) -> list[Piece]:
    """Tokenize and position the segments. `full` reads everything causally: one cross piece."""
    segs = [Segment(text=s) if isinstance(s, str) else s for s in segments]
    if not segs:
        raise ValueError("a layout needs at least one segment")
    toks: list[list[int]] = []
    for i, s in enumerate(segs):
        ids = s.token_ids
        t = encode(s.text) if s.text is not None else (check(ids) if check else [int(x) for x in ids])  # type: ignore[arg-type]
        if not t:
            raise ValueError(f"segment {i} is empty; drop it or give it text")
        toks.append(t)
    if require_tail and segs[-1].kind != "cross":
        raise ValueError("a layout must end with a cross segment (the question or generation prompt), "
                         "which attends to everything before it")
    first_plus = next((i for i, s in enumerate(segs) if s.kind == "plus"), len(segs))
    prefix_len = sum(len(t) for t in toks[:first_plus])
    for i, s in enumerate(segs):
        if s.kind == "plus" and s.anchor == "prefix" and prefix_len == 0:
            raise ValueError(f"segment {i} has anchor='prefix' but the layout has no leading cross "
                             "segment to anchor on; use anchor='none' or put a cross segment first")
    if policy == "full" or first_plus == len(segs):
        flat = tuple(x for t in toks for x in t)
        return [Piece("cross", flat, 0)]
    pieces: list[Piece] = []
    if prefix_len:  # leading cross segments merge: together they are exactly a plain prompt's prefix
        pieces.append(Piece("cross", tuple(x for t in toks[:first_plus] for x in t), 0))
    pos = prefix_len
    for s, t in zip(segs[first_plus:], toks[first_plus:]):
        a = prefix_len if (s.kind == "plus" and s.anchor == "prefix") else 0
        if s.kind == "cross" and pieces and pieces[-1].kind == "cross":
            last = pieces[-1]
            pieces[-1] = Piece("cross", last.tokens + tuple(t), last.start)
        else:
            pieces.append(Piece(s.kind, tuple(t), pos, a, s.key))
        pos += len(t)
    return pieces
