"""The replica router's decision logic (spanserve.cluster.routing), against a brute-force
reference and the cache manager's own keys."""
from __future__ import annotations

import math

import hypothesis.strategies as st
from hypothesis import given, settings

from spanserve.cache.block_pool import BlockPool
from spanserve.cache.claim import Admission, Holding, Piece
from spanserve.cache.manager import CacheManager
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
