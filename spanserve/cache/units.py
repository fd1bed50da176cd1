"""Units: a request's layout cut into token runs, each cached as one chain of blocks (the
request's own runs, and standalone segments stored at local positions), with their chain keys;
and what an admitted request holds (`Holding`: blocks, units, tasks, counts of reused tokens)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from spanserve.cache import hashing
from spanserve.cache.block_pool import Block
from spanserve.cache.claim import Admission, Task
from spanserve.cache.table import Table, build


@dataclass
class Unit:
    """A token run of the main table cached as one chain. Plus units are standalone segments
    stored at local positions from `local_start`; the others are the request's own runs, stored at
    their logical positions. The final unit is the one generation extends."""

    seed: int
    start: int
    local_start: int
    plus: bool
    final: bool
    tokens: Sequence[int]
    blocks: list[Block] = field(default_factory=list)
    n_valid: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    fresh: list[int] = field(default_factory=list)  # block indices this request publishes
    todo: list[int] = field(default_factory=list)  # unit-relative positions to compute
    task: Task | None = None  # encode task of a plus unit with holes
    source: "Unit | None" = None  # under a selective policy: the shared segment this run recomputes
    packed: bytes | None = field(default=None, repr=False)  # the tokens as int32 LE, if the piece had them
    tail_key: int | None = field(default=None, repr=False)  # key of a partial last block (hashed with the chain)
    owns_tokens: bool = field(default=False, repr=False)  # tokens is this unit's own list (final units)

    @property
    def delta(self) -> int:
        return self.start - self.local_start


def follow(u: Unit, row: list[int]) -> None:
    """Keep a final unit's tokens equal to row[u.start:] as generation appends to the row: copied
    once into a list the unit owns, then extended by the new tokens only, since a copy per decode
    step would cost O(context) per request."""
    have = u.start + len(u.tokens)
    if not u.owns_tokens or have > len(row):
        u.tokens, u.owns_tokens = row[u.start:], True
    elif have < len(row):
        u.tokens.extend(row[have:])  # type: ignore[attr-defined]


def build_units(adm: Admission, block_size: int) -> list[Unit]:
    """One unit per piece, chained: whatever follows a piece depends on its content and place.
    Under a selective policy a plus piece is the request's own run whose `source` is the shared
    segment it recomputes from."""
    ns, pieces = adm.namespace, adm.pieces
    plain = hashing.seed(ns)
    units: list[Unit] = []
    link = plain
    prefix = pieces[0].tokens if pieces[0].kind == "cross" else ()
    selective = adm.policy is not None and adm.policy.selective
    policy_key = adm.policy.key if adm.policy is not None else "none"
    bs = block_size
    for i, p in enumerate(pieces):
        final = i == len(pieces) - 1 and not adm.encode_only
        toks = p.tokens
        seg = None
        if p.kind == "plus":
            # anchor none: exactly a plain causal encoding, so finished generations hit it
            seed = plain if p.anchor_len == 0 else hashing.seed(ns, "anchor", prefix[: p.anchor_len])
            seg = Unit(seed, p.start, p.anchor_len, True, final, toks, packed=p.packed)
            seg.keys, digest, seg.tail_key = hashing.unit_keys(seed, toks, bs, p.packed)
        if seg is not None and not selective:
            u = seg
        else:  # the request's own run; a recomputed segment's KV is request-specific too
            u = Unit(link, p.start, p.start, False, final, toks, source=seg, packed=p.packed)
            u.keys, digest, u.tail_key = hashing.unit_keys(link, toks, bs, p.packed)
        # whatever follows depends on this unit's content and place: chain it into the link
        link = hashing.seed(ns, "span", policy_key, link, digest, p.start, p.anchor_len)
        units.append(u)
    return units


def table(units: list[Unit], local: bool = False) -> Table:
    """The units' key table. `local`: delta 0, how a plus unit's own encoding task reads it."""
    return build([u.blocks for u in units], [0 if local else u.delta for u in units], [u.n_valid for u in units])


def _no_reuse() -> dict[str, int]:
    return {"prefix": 0, "perforated": 0, "segment": 0, "computed": 0}


@dataclass
class Holding:
    """What an admitted request holds, owned by the cache manager until it is released: block
    references, the units of its layout (and the shared segments a policy recomputes from), its
    tasks (the main task last) and how its prompt tokens were served."""

    held: list[Block] = field(default_factory=list)
    units: list[Unit] = field(default_factory=list)
    sources: list[Unit] = field(default_factory=list)
    tasks: list[Task] = field(default_factory=list)
    reuse: dict[str, int] = field(default_factory=_no_reuse)
    publish_mark: tuple[int, int] | None = None  # at CacheManager.publish's last call: row computed to, tasks with work

    @property
    def main(self) -> Task:
        return self.tasks[-1]
