"""The replica router's decision logic (spanserve.cluster.routing), against a brute-force
reference and the cache manager's own keys."""
from __future__ import annotations

import math

import hypothesis.strategies as st
from hypothesis import given, settings

from spanserve.cache.block_pool import BlockPool
from spanserve.cache.claim import Admission, Piece
from spanserve.cache.manager import CacheManager
from spanserve.cache.units import Holding
from spanserve.cluster import routing
from spanserve.cluster.routing import RouteKey

keys_st = st.lists(st.builds(RouteKey, st.integers(0, 2**128 - 1), st.integers(1, 4096)), max_size=8)
names_st = st.lists(st.text("abcdefgh0123456789-", min_size=1, max_size=12), min_size=1, max_size=12, unique=True)


def brute_owner(key: int, replicas: list[str]) -> str:
    best = None
    for r in replicas:
        w = (routing.score(key, r), r)
        if best is None or w > best[0]:
            best = (w, r)
    assert best is not None
    return best[1]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**128 - 1), names_st)
def test_owner_is_the_highest_rendezvous_score(key: int, names: list[str]) -> None:
    assert routing.owner(key, names) == brute_owner(key, names)
    assert routing.owner(key, list(reversed(names))) == routing.owner(key, names)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**128 - 1), min_size=1, max_size=50), names_st)
def test_removing_a_replica_moves_only_its_keys(keys: list[int], names: list[str]) -> None:
    gone = names[0]
    rest = names[1:]
    for k in keys:
        before = routing.owner(k, names)
        if not rest:
            continue
        after = routing.owner(k, rest)
        if before != gone:
            assert after == before
        # adding it back returns exactly its keys to it
        assert routing.owner(k, rest + [gone]) == before


@settings(max_examples=200, deadline=None)
@given(keys_st, names_st, st.data())
def test_route_is_deterministic_and_never_over_the_bound_when_room_exists(keys: list[RouteKey], names: list[str],
                                                                          data: st.DataObject) -> None:
    loads = {r: data.draw(st.integers(0, 10)) for r in names}
    bound = routing.load_bound(loads)
    a = routing.SegmentRouter(capacity=10_000).route(keys, loads)
    b = routing.SegmentRouter(capacity=10_000).route(keys, dict(reversed(list(loads.items()))))
    assert a == b
    assert a in names
    if any(v < bound for v in loads.values()):
        assert loads[a] < bound
    else:
        assert loads[a] == min(loads.values())


@settings(max_examples=100, deadline=None)
@given(keys_st, names_st, st.data())
def test_ranked_orders_by_tokens_each_replica_would_hit(keys: list[RouteKey], names: list[str],
                                                       data: st.DataObject) -> None:
    placement = routing.Placement(capacity=10**9)
    for r in names:  # some replicas are believed to hold some keys
        held = [k for k in keys if data.draw(st.booleans())]
        placement.record(r, held)
    order = routing.ranked(keys, names, placement)
    assert sorted(order) == sorted(names)

    def hits(r: str) -> int:  # reference: a key counts for its holders, else for its owner
        total = 0
        for k in keys:
            holders = [x for x in names if placement.holds(x, k.key)]
            total += k.tokens if r in (holders or [brute_owner(k.key, names)]) else 0
        return total

    got = [hits(r) for r in order]
    assert got == sorted(got, reverse=True)


def test_load_bound_is_the_bounded_load_capacity() -> None:
    assert routing.load_bound({"a": 0, "b": 0}) == 1
    assert routing.load_bound({"a": 4, "b": 4, "c": 4, "d": 3}, slack=0.25) == math.ceil(1.25 * 16 / 4)
    assert routing.load_bound({}, floor=3) == 3


def test_a_hot_key_spills_to_the_least_loaded_replica_over_the_bound() -> None:
    names = [f"r{i}" for i in range(4)]
    hot = [RouteKey(12345, 512)]
    router = routing.SegmentRouter(capacity=10_000)
    loads = dict.fromkeys(names, 0)
    placed = []
    for _ in range(40):  # nothing finishes: loads only grow
        bound = routing.load_bound(loads)
        r = router.route(hot, loads)
        assert loads[r] < bound  # the mean is under the bound, so some replica always is
        loads[r] += 1
        placed.append(r)
    assert placed[0] == routing.owner(12345, names)
    assert max(loads.values()) <= math.ceil(1.25 * 40 / 4)
    assert min(loads.values()) > 0  # the hot key spilled to every replica


def test_placement_forgets_least_recent_keys_beyond_capacity() -> None:
    p = routing.Placement(capacity=100)
    p.record("a", [RouteKey(1, 60), RouteKey(2, 30)])
    p.record("a", [RouteKey(1, 60)])  # 1 is now the most recent
    p.record("a", [RouteKey(3, 20)])  # 110 > 100: the least recent (2) goes
    assert p.holds("a", 1) and p.holds("a", 3) and not p.holds("a", 2)
    p.forget("a")
    assert not p.holds("a", 1)


class _NoKV:
    def copy_many(self, jobs: list) -> None:
        pass


def _admitted(pieces: list[Piece], namespace: str = "", bs: int = 4) -> Holding:
    mgr = CacheManager(BlockPool(64), storage=_NoKV(), block_size=bs)  # type: ignore[arg-type]
    prompt = [t for p in pieces for t in p.tokens]
    held = mgr.admit(Admission(pieces, prompt, namespace))
    assert held is not None
    return held


def test_plus_keys_are_the_cache_units_own_keys() -> None:
    doc_a, doc_b = tuple(range(10, 23)), tuple(range(40, 49))  # 13 and 9 tokens: partial tails
    lead = (1, 2, 3, 4, 5)
    pieces = [Piece("cross", lead, 0), Piece("plus", doc_a, 5), Piece("plus", doc_b, 18, anchor_len=5),
              Piece("cross", (7, 8), 27)]
    for ns in ("", "salt"):
        req = _admitted(pieces, ns)
        plus_units = [u for u in req.units if u.plus]
        got = routing.layout_keys(pieces, ns, 4)
        # the unit's chain keys end on the digest of its partial tail, which the router uses
        assert [k.key for k in got[:2]] == [u.tail_key for u in plus_units]
        assert [k.tokens for k in got] == [13, 9, 5]


def test_a_document_has_one_key_in_any_order_and_position() -> None:
    doc_a, doc_b = tuple(range(10, 30)), tuple(range(40, 60))
    q = (7, 8, 9)
    one = [Piece("plus", doc_a, 0), Piece("plus", doc_b, 20), Piece("cross", q, 40)]
    two = [Piece("cross", (1, 2), 0), Piece("plus", doc_b, 2), Piece("plus", doc_a, 22), Piece("cross", q, 42)]
    k1 = {k.key for k in routing.layout_keys(one, "", 16)}
    k2 = {k.key for k in routing.layout_keys(two, "", 16)}
    assert len(k1 & k2) == 2
    assert not k1 & {k.key for k in routing.layout_keys(one, "other-salt", 16)}


def test_prefix_key_names_the_first_blocks_of_a_plain_prompt() -> None:
    a = list(range(100, 200))
    b = a[:64] + [5] * 36  # same first 4 blocks of 16
    c = [1] + a[1:]
    assert routing.prefix_key(a, "", 16) == routing.prefix_key(b, "", 16)
    assert routing.prefix_key(a, "", 16).key != routing.prefix_key(c, "", 16).key
    assert routing.prefix_key([3, 4], "", 16).tokens == 2


def _recorded_copy(p: routing.Placement, replica: str, keys: list[RouteKey]) -> set[int]:
    """Reference for Placement.evicted: record on a fresh copy and see which held keys, other
    than the request's own (a request larger than the pool evicts its own too), left."""
    q = routing.Placement(p.capacity)
    q.record(replica, [RouteKey(k, t) for k, t in p._held.get(replica, {}).items()])
    before = set(q._held.get(replica, {}))
    q.record(replica, keys)
    return before - set(q._held.get(replica, {})) - {k.key for k in keys}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.builds(RouteKey, st.integers(0, 30), st.integers(1, 40)), max_size=5), max_size=8),
       st.lists(st.builds(RouteKey, st.integers(0, 30), st.integers(1, 40)), max_size=5))
def test_evicted_is_what_recording_would_push_out(history: list[list[RouteKey]], keys: list[RouteKey]) -> None:
    # unique keys per request (a request names a key once) so token totals are unambiguous
    history = [list({k.key: k for k in h}.values()) for h in history]
    keys = list({k.key: k for k in keys}.values())
    p = routing.Placement(capacity=100)
    for h in history:
        p.record("a", h)
    held = dict(p._held.get("a", {}))
    got = p.evicted("a", keys)
    assert dict(p._held.get("a", {})) == held  # a query, not a change
    assert {k.key for k in got} == _recorded_copy(p, "a", keys)
    assert all(held[k.key] == k.tokens for k in got)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**64), min_size=1, max_size=4), min_size=1, max_size=60),
       st.integers(1, 64), st.integers(1, 4))
def test_key_counts_never_under_count_and_are_exact_when_wide(reqs: list[list[int]], width: int, depth: int) -> None:
    exact: dict[int, int] = {}
    small, wide = routing.KeyCounts(width, depth), routing.KeyCounts(1 << 20, 4)
    for r in reqs:
        small.add([RouteKey(k, 1) for k in r])
        wide.add([RouteKey(k, 1) for k in r])
        for k in set(r):
            exact[k] = exact.get(k, 0) + 1
    for k, n in exact.items():
        assert small.count(k) >= n
        assert wide.count(k) == n  # 60 requests x 4 keys in 2^20 cells x 4 rows: no collision in practice
        assert wide.rate(k) == n / len(reqs)
    assert routing.KeyCounts().rate(5) == 0.0


def test_key_counts_age_by_halving() -> None:
    c = routing.KeyCounts(width=64, depth=2, window=10)
    for _ in range(9):
        c.add([RouteKey(1, 1)])
    assert c.count(1) == 9 and c.requests == 9
    c.add([RouteKey(2, 1)])  # the 10th request: everything halves
    assert c.requests == 5 and c.count(1) == 4 and c.count(2) == 0
    assert c.rate(1) == 4 / 5


def test_ranked_subtracts_the_expected_recomputation_of_pushed_out_keys() -> None:
    names = ["a", "b"]
    p = routing.Placement(capacity=100)
    hot, cold = RouteKey(1, 50), RouteKey(2, 50)
    p.record("a", [hot, cold])  # a is full of a hot and a cold document
    p.record("b", [RouteKey(3, 50), RouteKey(4, 50)])  # b of two documents never asked for again
    counts = routing.KeyCounts()
    for _ in range(10):
        counts.add([hot])
    new = [RouteKey(9, 50)]
    # without the charge the tie goes by rendezvous order; with it, to b, whose pushed-out key is cold
    cost = routing.eviction_cost(new, names, p, counts, horizon=3.0)
    assert cost == {"a": 3.0 * 50 * 1.0, "b": 0.0}
    assert routing.ranked(new, names, p, counts, horizon=3.0)[0] == "b"
    # a request that hits on a goes there unless the charge outweighs the hit
    counts2 = routing.KeyCounts()
    counts2.add([hot])
    for _ in range(9):
        counts2.add([RouteKey(7, 1)])
    fresh = next(k for k in range(10, 100) if routing.owner(k, names) == "b")  # computed at b if sent there
    req = [cold, RouteKey(fresh, 20)]
    # a: 50 hit - 3 x 50 x 0.1 for pushing the hot key out = 35; b: 20 as the new key's owner - 0
    assert routing.ranked(req, names, p, counts2, horizon=3.0)[0] == "a"
    assert routing.ranked(req, names, p, counts2, horizon=10.0)[0] == "b"  # a: 50 - 50


@settings(max_examples=100, deadline=None)
@given(keys_st, names_st, st.data(), st.floats(0, 10))
def test_ranked_with_counts_matches_a_brute_force_score(keys: list[RouteKey], names: list[str],
                                                       data: st.DataObject, horizon: float) -> None:
    placement = routing.Placement(capacity=data.draw(st.integers(1, 20_000)))
    counts = routing.KeyCounts()
    for r in names:
        placement.record(r, [k for k in keys if data.draw(st.booleans())])
        counts.add([k for k in keys if data.draw(st.booleans())])
    order = routing.ranked(keys, names, placement, counts, horizon)
    assert sorted(order) == sorted(names)

    def value(r: str) -> float:  # reference: affinity as above, less horizon x rate x tokens pushed out
        hit = 0.0
        for k in keys:
            holders = [x for x in names if placement.holds(x, k.key)]
            hit += k.tokens if r in (holders or [brute_owner(k.key, names)]) else 0
        gone = _recorded_copy(placement, r, keys)
        tokens = dict(placement._held.get(r, {}))
        return hit - horizon * sum(tokens[g] * counts.rate(g) for g in gone)

    got = [value(r) for r in order]
    assert all(x >= y - 1e-6 for x, y in zip(got, got[1:]))
