"""Which replica serves a request: the decision shared by the Ray Serve router and the simulation.

A request is described to the router by its route keys: one per plus segment (the key its cache
unit ends on, so two requests holding one document share it in any order and at any position)
and one for its leading cross run (a prefix of the chain a plain prompt's cache walks). Each
key has an owner among the replicas by rendezvous hashing, so a document is computed where it
was computed before, and a replica leaving or joining moves only the keys it owned or now owns.

A request goes to the replica that would hit the most of its tokens: a key counts for the
replicas the router sent it to lately (a per-replica LRU of keys as large as a replica's pool),
or, held nowhere yet, for its owner, where it will be computed. From that is taken what the
request costs each replica: its misses push the replica's least recent keys out, and a key
pushed out that is requested often will be recomputed soon (how often: a count-min sketch of
the keys requests carried). Left out, a replica holding a request's hot documents takes its
cold ones too and evicts the warm documents it serves well. A replica whose queue is at
the bound is skipped for the next best; when every replica is at it, the least loaded one
takes the request. The router holds no copy of any cache: a wrong guess costs a miss, never a
wrong answer.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from spanserve.cache import hashing
from spanserve.cache.claim import Piece

# Blocks of a plain prompt's chain that name it for routing: long enough to tell system
# prompts apart, short enough that prompts sharing them share a replica.
PREFIX_BLOCKS = 4
# Requests ahead over which a key a request would push out of a replica is charged its expected
# recomputation: fitted on the Zipf RAG simulation (benchmarks/routing_sim.py, 8 replicas),
# where 3, 5 and 8 are within a point of hit ratio and 0 (no charge) is 1-2 points below.
HORIZON = 5.0


@dataclass(frozen=True)
class RouteKey:
    key: int  # a cache key: a plus unit's last block key, or a prompt prefix's chain key
    tokens: int  # tokens its holder would not recompute


def plus_key(piece: Piece, lead: Sequence[int], namespace: str, block_size: int) -> RouteKey:
    """The key a plus piece's cache unit ends on, seeded exactly as the cache manager seeds it."""
    plain = hashing.seed(namespace)
    seed = plain if piece.anchor_len == 0 else hashing.seed(namespace, "anchor", tuple(lead[: piece.anchor_len]))
    _, digest, _ = hashing.unit_keys(seed, piece.tokens, block_size, piece.packed)
    return RouteKey(digest, len(piece.tokens))


def prefix_key(tokens: Sequence[int], namespace: str, block_size: int,
               depth: int = PREFIX_BLOCKS) -> RouteKey:
    """Chain key of the first `depth` blocks of a plain prompt (all of a shorter one)."""
    head = list(tokens[: depth * block_size])
    keys = hashing.chain_keys(hashing.seed(namespace), head, block_size, include_partial=True)
    return RouteKey(keys[-1] if keys else hashing.seed(namespace), len(head))


def layout_keys(pieces: Sequence[Piece], namespace: str, block_size: int,
                depth: int = PREFIX_BLOCKS) -> list[RouteKey]:
    """Route keys of a resolved layout: every plus piece's, and the leading cross run's prefix."""
    if not pieces:
        return []
    lead = pieces[0].tokens if pieces[0].kind == "cross" else ()
    keys = [plus_key(p, lead, namespace, block_size) for p in pieces if p.kind == "plus"]
    if lead:
        keys.append(prefix_key(lead, namespace, block_size, depth))
    return keys


# ---- rendezvous hashing ----------------------------------------------------------------------
def score(key: int, replica: str) -> int:
    """Rendezvous weight of `replica` for `key`: the highest wins."""
    return xxhash.xxh3_64_intdigest(key.to_bytes(16, "little") + replica.encode("utf-8"))


def owner(key: int, replicas: Iterable[str]) -> str:
    """The replica that holds `key` when every replica is free to take it."""
    return max(replicas, key=lambda r: (score(key, r), r))


class Placement:
    """Where the router sent each key lately: per replica, an LRU of keys holding at most
    `capacity` tokens (the replica's KV pool), which is how its pool evicts too. A guess, never
    a copy of the pool: a replica that evicted early or restarted only turns a hit into a miss."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._held: dict[str, OrderedDict[int, int]] = {}
        self._tokens: dict[str, int] = {}

    def record(self, replica: str, keys: Iterable[RouteKey]) -> None:
        """`replica` now holds `keys` (it computed or read them): most recent last."""
        held = self._held.setdefault(replica, OrderedDict())
        total = self._tokens.get(replica, 0)
        for k in keys:
            total += k.tokens - held.pop(k.key, 0)
            held[k.key] = k.tokens
        while total > self.capacity and held:
            total -= held.popitem(last=False)[1]
        self._tokens[replica] = total

    def evicted(self, replica: str, keys: Iterable[RouteKey]) -> list[RouteKey]:
        """The keys `record(replica, keys)` would push out, least recent first; changes nothing."""
        held = self._held.get(replica, OrderedDict())
        incoming = {k.key: k.tokens for k in keys}
        total = self._tokens.get(replica, 0) + sum(t - held.get(k, 0) for k, t in incoming.items())
        out = []
        for key, tokens in held.items():  # least recent first, as record() evicts
            if total <= self.capacity:
                break
            if key not in incoming:
                out.append(RouteKey(key, tokens))
                total -= tokens
        return out

    def holds(self, replica: str, key: int) -> bool:
        return key in self._held.get(replica, ())

    def forget(self, replica: str) -> None:
        """A replica left or restarted with an empty pool."""
        self._held.pop(replica, None)
        self._tokens.pop(replica, None)


class KeyCounts:
    """How often requests carried each key: a count-min sketch (fixed memory; an estimate is
    never below the true count), halved every `window` requests so that it follows a workload
    whose popular documents change."""

    def __init__(self, width: int = 4096, depth: int = 4, window: int = 100_000):
        if width < 1 or depth < 1 or window < 1:
            raise ValueError("width, depth and window must be positive")
        self.width, self.depth, self.window = width, depth, window
        self._rows = [[0] * width for _ in range(depth)]
        self.requests = 0

    def _cells(self, key: int) -> list[int]:
        raw = key.to_bytes(16, "little")
        return [xxhash.xxh3_64_intdigest(raw, seed=i) % self.width for i in range(self.depth)]

    def add(self, keys: Iterable[RouteKey]) -> None:
        """One request carried `keys` (a key it carries twice counts once)."""
        for key in {k.key for k in keys}:
            for row, cell in zip(self._rows, self._cells(key)):
                row[cell] += 1
        self.requests += 1
        if self.requests >= self.window:
            self._rows = [[c // 2 for c in row] for row in self._rows]
            self.requests //= 2

    def count(self, key: int) -> int:
        return min(row[cell] for row, cell in zip(self._rows, self._cells(key)))

    def rate(self, key: int) -> float:
        """Requests carrying `key` per request, lately."""
        return self.count(key) / self.requests if self.requests else 0.0


def eviction_cost(keys: Sequence[RouteKey], replicas: Sequence[str], placement: Placement,
                  counts: KeyCounts, horizon: float) -> dict[str, float]:
    """Per replica, the tokens it would recompute over the next `horizon` requests (of the whole
    stream) because this request's misses pushed its least recent keys out."""
    return {r: horizon * sum(k.tokens * counts.rate(k.key) for k in placement.evicted(r, keys))
            for r in replicas}


def affinity(keys: Sequence[RouteKey], replicas: Sequence[str],
             placement: Placement | None = None) -> dict[str, float]:
    """Per replica, the tokens of this request it would hit: a key counts for the replicas
    believed to hold it, or (held nowhere) for its rendezvous owner, where it will be computed."""
    out = dict.fromkeys(replicas, 0.0)
    for k in keys:
        holders = [r for r in replicas if placement.holds(r, k.key)] if placement is not None else []
        for r in holders or [owner(k.key, replicas)]:
            out[r] += k.tokens
    return out


def ranked(keys: Sequence[RouteKey], replicas: Sequence[str], placement: Placement | None = None,
           counts: KeyCounts | None = None, horizon: float = 0.0) -> list[str]:
    """Every replica, best first: most affinity less eviction cost (when `counts` is given), then
    (ties, and requests without keys) the rendezvous order of the request's heaviest key, so
    equal requests rank replicas equally."""
    if not replicas:
        return []
    aff = affinity(keys, replicas, placement)
    if placement is not None and counts is not None and horizon > 0:
        cost = eviction_cost(keys, replicas, placement, counts, horizon)
        aff = {r: aff[r] - cost[r] for r in replicas}
    lead = max(keys, key=lambda k: (k.tokens, k.key)).key if keys else 0
    return sorted(replicas, key=lambda r: (-aff[r], -score(lead, r), r))


def load_bound(loads: Mapping[str, int], slack: float = 0.25, floor: int = 1) -> int:
    """Bounded-load hashing's capacity: a replica may hold (1 + slack) times the mean load,
    counting the request being placed (and at least `floor`)."""
    if not loads:
        return floor
    mean = (sum(loads.values()) + 1) / len(loads)
    return max(floor, math.ceil((1 + slack) * mean))


def choose(order: Sequence[str], loads: Mapping[str, int], bound: int) -> str:
    """The first replica in `order` whose load is under `bound`; else the least loaded (the
    earliest in `order` among equals), so a hot key never queues past the bound."""
    if not order:
        raise ValueError("no replicas to route to")
    for r in order:
        if loads.get(r, 0) < bound:
            return r
    return min(order, key=lambda r: loads.get(r, 0))


@dataclass
class SegmentRouter:
    """The router's state between requests: where it sent keys lately and how often requests
    carried them (hints both)."""

    capacity: int  # tokens a replica's KV pool holds
    slack: float = 0.25
    # Requests ahead over which a pushed-out key's expected reuse is charged; 0 turns it off.
    horizon: float = HORIZON

    def __post_init__(self) -> None:
        self.placement = Placement(self.capacity)
        self.counts = KeyCounts()

    def route(self, keys: Sequence[RouteKey], loads: Mapping[str, int], bound: int | None = None) -> str:
        """The replica for a request with these keys, given every replica's current load."""
        replicas = sorted(loads)
        cap = load_bound(loads, self.slack) if bound is None else bound
        chosen = choose(ranked(keys, replicas, self.placement, self.counts, self.horizon), loads, cap)
        self.placement.record(chosen, keys)
        self.counts.add(keys)
        return chosen
