"""Span layouts: a prompt as segments that depend on what precedes them (`cross`) or stand alone
(`plus`), resolved to token pieces at contiguous logical positions."""
from __future__ import annotations

import itertools
import marshal
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from spanserve.cache.claim import Piece

KINDS = ("cross", "plus")
ANCHORS = ("none", "prefix", "sink")


@dataclass(frozen=True)
class Segment:
    text: str | None = None
    token_ids: Sequence[int] | None = None
    kind: str = "cross"
    # plus only: "prefix" = encoded after the leading cross segments; "sink" = encoded after the
    # model's sink prefix (BOS + chat template opening), which the prompt must begin with
    anchor: str = "none"
    key: str | None = None  # optional name, for pinning and reporting

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("a Segment needs exactly one of text= or token_ids=")
        if self.kind not in KINDS:
            raise ValueError(f"unknown segment kind {self.kind!r}; use one of {KINDS}")
        if self.anchor not in ANCHORS:
            raise ValueError(f"unknown anchor {self.anchor!r}; use one of {ANCHORS} "
                             "(an anchor is the leading cross segments or the model's sink prefix, never arbitrary text)")
        if self.kind == "cross" and self.anchor != "none":
            raise ValueError("anchor applies to plus segments only; drop anchor= from the cross segment")


Checked = tuple[Sequence[int], "bytes | None"]  # (ids as exact ints, the same as int32 LE bytes)


def _exact_int32(ids: list) -> np.ndarray | None:
    """`ids` as int32 if every one is an exact int that fits, else None: one C pass that both
    converts and checks types (numpy's conversion would need a second pass over the types).
    marshal (format 2) writes a list as 5 header bytes then, for each exact int that fits in
    32 bits, b"i" + 4 bytes LE; anything else takes another code or length (a bool is one byte,
    a float nine, a numpy scalar a byte string, a bigger int b"l"...) or fails. So a dump of
    exactly 5 + 5n bytes with b"i" at every 5th byte holds n such ints, by induction."""
    body = _int_rows(ids)
    if body is None:
        return None
    rows = np.frombuffer(body, _MARSHAL_INT)
    if not (rows["code"] == ord("i")).all():
        return None
    return rows["value"].copy()


def _int_rows(ids: list) -> bytes | None:
    """The marshal dump of `ids` less its header, when it has one 5-byte row per element (the
    rows still need their b"i" codes checked); None otherwise."""
    try:
        dump = marshal.dumps(ids, 2)
    except (ValueError, RecursionError):
        return None
    return dump[5:] if len(dump) == 5 + 5 * len(ids) else None


_MARSHAL_INT = np.dtype([("code", "u1"), ("value", "<i4")])  # packed: 5 bytes


def checked_tokens(ids: Sequence[int], vocab_size: int, pack: bool = True) -> tuple[tuple[int, ...], bytes | None]:
    """Token ids as a tuple of ints, each in [0, vocab_size), and (if `pack`) the same as int32
    LE bytes. Vectorized (layouts are long); a list of exact ints is copied, not rebuilt."""
    arr = _exact_int32(ids) if type(ids) is list else None
    exact = arr is not None
    if arr is None:
        try:
            arr = np.asarray(ids, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise ValueError("token ids must be integers") from None
        if arr.ndim != 1:
            raise ValueError("token ids must be a flat list of integers")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = arr[(arr < 0) | (arr >= vocab_size)]
        raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5].tolist()}")
    # exact ints are what tolist() would make of them; floats, bools, numpy scalars are not
    out = tuple(ids) if exact else tuple(arr.tolist())
    return out, arr.astype("<i4", copy=False).tobytes() if pack else None


def checked_many(idss: Sequence[Sequence[int]], vocab_size: int) -> list[tuple[tuple[int, ...], bytes]] | None:
    """checked_tokens(ids, vocab_size) of each of several lists of exact ints, with one numpy
    pass over all of them (a judge layout is ~25 segments); None when any is not such a list
    or any id is out of range: the caller then checks one by one, for the same errors."""
    if not all(type(ids) is list for ids in idss):
        return None
    bodies = [_int_rows(ids) for ids in idss]
    if None in bodies:
        return None
    rows = np.frombuffer(b"".join(bodies), _MARSHAL_INT)  # type: ignore[arg-type]
    if not (rows["code"] == ord("i")).all():
        return None
    vals = rows["value"]
    if vals.size and (vals.min() < 0 or vals.max() >= vocab_size):
        return None
    packed = vals.tobytes()
    out, at = [], 0
    for ids in idss:
        out.append((tuple(ids), packed[4 * at:4 * (at + len(ids))]))
        at += len(ids)
    return out


def sink_prefix(tokenizer: object) -> tuple[int, ...]:
    """The model's universal opening: BOS (when the tokenizer adds one) and the chat template's
    text before the first message's content. Every chat prompt of the model begins with it, so
    segments encoded after it see a real sink at position 0 yet are reusable by every request."""
    if tokenizer is None:
        return ()
    bos = list(tokenizer.encode("", add_special_tokens=True))  # what the tokenizer prepends, if anything
    if not getattr(tokenizer, "chat_template", None):
        return tuple(bos)
    mark = "\x00sink\x00"
    try:
        text = tokenizer.apply_chat_template([{"role": "system", "content": mark}], tokenize=False)
    except Exception:  # templates that reject a system message: open on a user message instead
        text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    opening = text[:text.index(mark)] if mark in text else ""
    ids = list(tokenizer.encode(opening, add_special_tokens=False)) if opening else []
    return tuple(ids if bos and ids[:len(bos)] == bos else bos + ids)


def _joined(parts: Sequence[Checked]) -> tuple[tuple[int, ...], bytes | None]:
    packs = [p for _, p in parts]
    packed = b"".join(packs) if None not in packs else None  # type: ignore[arg-type]
    return tuple(itertools.chain.from_iterable(t for t, _ in parts)), packed


def resolve(segments: Sequence[Segment | str], encode: Callable[[str], list[int]], policy: str,
            require_tail: bool = True, check: Callable[[Sequence[int]], Checked] | None = None,
            check_all: Callable[[list[Sequence[int]]], "Sequence[Checked] | None"] | None = None,
            sink: Sequence[int] = ()) -> list[Piece]:
    """Tokenize and position the segments. `full` reads everything causally: one cross piece.
    `sink`: the model's sink prefix, the anchor of anchor="sink" segments (the prompt must
    begin with it).
    `check` validates token ids (see checked_tokens); without it they are only made ints.
    `check_all`: the same for every token-id segment at once (see checked_many), or None to
    fall back to `check`."""
    segs = [Segment(text=s) if isinstance(s, str) else s for s in segments]
    if not segs:
        raise ValueError("a layout needs at least one segment")
    toks = _tokenized(segs, encode, check, check_all)
    if require_tail and segs[-1].kind != "cross":
        raise ValueError("a layout must end with a cross segment (the question or generation prompt), "
                         "which attends to everything before it")
    first_plus = next((i for i, s in enumerate(segs) if s.kind == "plus"), len(segs))
    _check_anchors(segs, toks[:first_plus], sink)
    if policy == "full" or first_plus == len(segs):
        flat, packed = _joined(toks)
        return [Piece("cross", flat, 0, packed=packed)]
    return _positioned(segs, toks, first_plus, len(sink))


def _tokenized(segs: list[Segment], encode: Callable[[str], list[int]],
               check: Callable[[Sequence[int]], Checked] | None,
               check_all: Callable[[list[Sequence[int]]], "Sequence[Checked] | None"] | None) -> list[Checked]:
    """Each segment's token ids: text encoded, ids checked (all at once where `check_all` can)."""
    toks: list[Checked] = []
    pre = check_all([s.token_ids for s in segs if s.text is None]) if check_all else None  # type: ignore[misc]
    checked = iter(pre) if pre is not None else None
    for i, s in enumerate(segs):
        ids = s.token_ids
        if s.text is not None:
            t: Checked = (encode(s.text), None)
        elif checked is not None:
            t = next(checked)
        else:
            t = check(ids) if check else ([int(x) for x in ids], None)  # type: ignore[union-attr]
        if not t[0]:
            raise ValueError(f"segment {i} is empty; drop it or give it text")
        toks.append(t)
    return toks


def _check_anchors(segs: list[Segment], leading: list[Checked], sink: Sequence[int]) -> None:
    """Every plus segment's anchor exists: `leading` holds the tokens of the leading cross segments."""
    prefix_len = sum(len(t) for t, _ in leading)
    lead = tuple(itertools.chain.from_iterable(t for t, _ in leading))
    for i, s in enumerate(segs):
        if s.kind == "plus" and s.anchor == "prefix" and prefix_len == 0:
            raise ValueError(f"segment {i} has anchor='prefix' but the layout has no leading cross "
                             "segment to anchor on; use anchor='none' or put a cross segment first")
        if s.kind == "plus" and s.anchor == "sink" and (not sink or lead[:len(sink)] != tuple(sink)):
            raise ValueError(f"segment {i} has anchor='sink' but the layout does not begin with the model's "
                             f"sink prefix {list(sink)} (BOS + chat template opening)"
                             if sink else f"segment {i} has anchor='sink' but this model has no sink prefix "
                             "(no BOS and no chat template); use anchor='none' or 'prefix'")


def _positioned(segs: list[Segment], toks: list[Checked], first_plus: int, sink_len: int) -> list[Piece]:
    """The pieces of a layout with plus segments, at contiguous positions; consecutive cross
    segments merge into one piece."""
    prefix_len = sum(len(t) for t, _ in toks[:first_plus])
    anchor_len = {"none": 0, "prefix": prefix_len, "sink": sink_len}
    pieces: list[Piece] = []
    if prefix_len:  # leading cross segments merge: together they are exactly a plain prompt's prefix
        flat, packed = _joined(toks[:first_plus])
        pieces.append(Piece("cross", flat, 0, packed=packed))
    pos = prefix_len
    for s, t in zip(segs[first_plus:], toks[first_plus:]):
        a = anchor_len[s.anchor] if s.kind == "plus" else 0
        if s.kind == "cross" and pieces and pieces[-1].kind == "cross":
            last = pieces[-1]
            flat, packed = _joined([(last.tokens, last.packed), t])
            pieces[-1] = Piece("cross", flat, last.start, packed=packed)
        else:
            pieces.append(Piece(s.kind, tuple(t[0]), pos, a, s.key, packed=t[1]))  # no copy of a tuple
        pos += len(t[0])
    return pieces
