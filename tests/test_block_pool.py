import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from spanserve.cache.block_pool import Block, BlockPool, NoFreeBlocks


def ids(pool: BlockPool) -> list[int]:
    return [b.id for b in pool.free_blocks()]


def test_initial_state():
    pool = BlockPool(4)
    assert pool.num_free == 4 and pool.num_cached == 0
    assert ids(pool) == [0, 1, 2, 3]
    assert "prev" not in repr(pool.blocks[0])  # links would make repr recurse


def test_allocate_takes_head_and_exhausts():
    pool = BlockPool(2)
    assert pool.allocate().id == 0
    b1 = pool.allocate()
    assert b1.id == 1 and b1.ref_cnt == 1 and pool.num_free == 0
    with pytest.raises(NoFreeBlocks):
        pool.allocate()


def test_release_uncached_to_head_cached_to_tail():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate_many(4)
    pool.register(a, 10, [1])
    pool.release(a)  # cached -> tail
    pool.release(b)  # plain -> head
    pool.register(c, 11, [2])
    pool.release(c)  # cached -> tail, behind a
    pool.release(d)  # plain -> head, ahead of b
    assert ids(pool) == [d.id, b.id, a.id, c.id]


def test_cached_block_survives_until_only_cached_are_free():
    pool = BlockPool(3)
    a, b, c = pool.allocate_many(3)
    pool.register(a, 10, [1])
    pool.register(b, 11, [2])
    pool.release(a)
    pool.release(b)
    pool.release(c)
    # The plain block goes first; both cached blocks stay hittable.
    assert pool.allocate() is c
    assert pool.lookup(10, [1]) is a and pool.lookup(11, [2]) is b
    # Now a fresh block must evict the least recently freed cached one.
    x = pool.allocate()
    assert x is a and x.key is None and x.tokens == ()
    assert pool.lookup(10, [1]) is None
    assert pool.lookup(11, [2]) is b
    assert pool.num_cached == 1


def test_hit_on_free_cached_block_revives_it():
    pool = BlockPool(3)
    a, b, c = pool.allocate_many(3)
    pool.register(b, 5, [7, 7])
    for blk in (a, b, c):
        pool.release(blk)
    hit = pool.lookup(5, [7, 7])
    assert hit is b
    assert ids(pool) == [c.id, a.id, b.id]  # lookup alone changes no order
    pool.acquire(hit)
    assert hit.ref_cnt == 1 and pool.num_free == 2 and ids(pool) == [c.id, a.id]
    pool.acquire(hit)
    assert hit.ref_cnt == 2 and pool.num_free == 2
    pool.release(hit)
    pool.release(hit)
    assert ids(pool) == [c.id, a.id, b.id]


def test_lru_order_among_cached():
    pool = BlockPool(3)
    blocks = pool.allocate_many(3)
    for i, blk in enumerate(blocks):
        pool.register(blk, 100 + i, [i])
    for blk in (blocks[2], blocks[0], blocks[1]):
        pool.release(blk)
    assert [pool.allocate().id for _ in range(3)] == [2, 0, 1]
    assert pool.num_cached == 0


def test_collision_is_a_miss():
    pool = BlockPool(2)
    a = pool.allocate()
    pool.register(a, 42, [1, 2, 3])
    assert pool.lookup(42, [1, 2, 3]) is a
    assert pool.lookup(42, [1, 2, 4]) is None
    assert pool.lookup(42, [1, 2]) is None
    assert pool.lookup(43, [1, 2, 3]) is None


def test_register_first_writer_wins():
    pool = BlockPool(3)
    a, b, c = pool.allocate_many(3)
    assert pool.register(a, 1, [9]) is a
    assert pool.register(b, 1, [9]) is a
    assert b.key is None and pool.num_cached == 1
    assert pool.register(a, 1, [9]) is a  # idempotent
    with pytest.raises(ValueError):
        pool.register(a, 2, [8])  # one key per block
    assert pool.register(c, 2, [8]) is c and pool.num_cached == 2


def test_register_free_block_moves_it_behind_plain_ones():
    pool = BlockPool(3)
    pool.register(pool.blocks[0], 1, [1])
    assert ids(pool) == [1, 2, 0]


def test_allocate_many_all_or_nothing():
    pool = BlockPool(4)
    held = pool.allocate()
    pool.register(held, 1, [1])
    pool.release(held)
    before = ids(pool)
    with pytest.raises(NoFreeBlocks):
        pool.allocate_many(5)
    assert ids(pool) == before and pool.num_free == 4 and pool.num_cached == 1
    assert pool.allocate_many(0) == []
    got = pool.allocate_many(4)
    assert len({b.id for b in got}) == 4 and pool.num_free == 0 and pool.num_cached == 0


def test_release_below_zero_raises():
    pool = BlockPool(1)
    b = pool.allocate()
    pool.release(b)
    with pytest.raises(ValueError):
        pool.release(b)
    assert b.ref_cnt == 0 and pool.num_free == 1


def test_evict():
    pool = BlockPool(3)
    a, b, c = pool.allocate_many(3)
    pool.register(a, 1, [1])
    with pytest.raises(ValueError):
        pool.evict(a)  # still referenced
    for blk in (a, b, c):
        pool.release(blk)
    pool.evict(a)
    assert a.key is None and pool.lookup(1, [1]) is None and pool.num_cached == 0
    assert ids(pool)[0] == a.id and pool.num_free == 3
    with pytest.raises(ValueError):
        pool.evict(a)  # no longer cached


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/touch/release/register/evict against a ref-count model."""

    @initialize(n=st.integers(min_value=1, max_value=8))
    def setup(self, n: int) -> None:
        self.pool = BlockPool(n)
        self.refs: dict[int, int] = {i: 0 for i in range(n)}  # model: block id -> refs
        self.next_key = 0

    def _held(self) -> list[Block]:
        return [b for b in self.pool.blocks if self.refs[b.id] > 0]

    def _cached(self) -> list[Block]:
        return sorted(self.pool._index.values(), key=lambda b: b.id)

    @rule()
    def allocate(self) -> None:
        had_plain = any(b.key is None for b in self.pool.free_blocks())
        cached_before = self.pool.num_cached
        if self.pool.num_free == 0:
            with pytest.raises(NoFreeBlocks):
                self.pool.allocate()
            return
        b = self.pool.allocate()
        assert self.refs[b.id] == 0
        self.refs[b.id] = 1
        assert b.key is None and b.ref_cnt == 1
        # A cached block is only sacrificed when no plain free block was left.
        assert self.pool.num_cached == cached_before - (0 if had_plain else 1)

    @rule(n=st.integers(min_value=0, max_value=9))
    def allocate_many(self, n: int) -> None:
        free_before = ids(self.pool)
        if n > len(free_before):
            with pytest.raises(NoFreeBlocks):
                self.pool.allocate_many(n)
            assert ids(self.pool) == free_before
            return
        got = self.pool.allocate_many(n)
        assert [b.id for b in got] == free_before[:n]
        for b in got:
            self.refs[b.id] = 1

    @precondition(lambda self: self.pool.num_cached > 0)
    @rule(data=st.data(), corrupt=st.booleans())
    def touch(self, data: st.DataObject, corrupt: bool) -> None:
        b = data.draw(st.sampled_from(self._cached()))
        tokens = list(b.tokens) + ([999] if corrupt else [])
        hit = self.pool.lookup(b.key, tokens)
        if corrupt:
            assert hit is None
            return
        assert hit is b
        self.pool.acquire(hit)
        self.refs[b.id] += 1

    @precondition(lambda self: any(v > 0 for v in self.refs.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from(self._held()))
        self.pool.release(b)
        self.refs[b.id] -= 1
        if b.ref_cnt == 0:
            free = list(self.pool.free_blocks())
            assert free[-1 if b.key is not None else 0] is b

    @rule(data=st.data(), reuse=st.booleans())
    def register(self, data: st.DataObject, reuse: bool) -> None:
        # Any block, held or free: registering a free block must keep the LRU order.
        b = data.draw(st.sampled_from(self.pool.blocks))
        cached = self._cached()
        if reuse and cached:
            other = data.draw(st.sampled_from(cached))
            assert self.pool.register(b, other.key, other.tokens) is other
            return
        if b.key is not None:
            return
        key, self.next_key = self.next_key, self.next_key + 1
        parent = data.draw(st.one_of(st.none(), st.integers(0, 2)))  # some are partial blocks
        assert self.pool.register(b, key, [key, 7], parent=parent) is b
        assert self.pool.lookup(key, (key, 7)) is b
        if parent is not None:
            assert b in self.pool.partials(parent)

    @precondition(lambda self: any(b.ref_cnt == 0 for b in self.pool._index.values()))
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        b = data.draw(st.sampled_from([c for c in self._cached() if c.ref_cnt == 0]))
        self.pool.evict(b)
        assert b.key is None and next(self.pool.free_blocks()) is b

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        free = list(pool.free_blocks())
        free_ids = {b.id for b in free}
        assert len(free_ids) == len(free) == pool.num_free
        for b in pool.blocks:
            assert b.ref_cnt >= 0
            assert b.ref_cnt == self.refs[b.id]
            assert (b.id in free_ids) == (b.ref_cnt == 0)
            if b.key is None:
                assert b.tokens == ()
            else:
                assert pool._index[b.key] is b
        for key, b in pool._index.items():
            assert b.key == key
        # The partial-block index holds exactly the cached blocks registered with a parent.
        indexed = {b.id for kids in pool._partials.values() for b in kids}
        assert indexed == {b.id for b in pool.blocks if b.parent is not None}
        for parent, kids in pool._partials.items():
            assert kids and all(b.key is not None and b.parent == parent for b in kids)
        assert pool.num_cached == sum(b.key is not None for b in pool.blocks)
        # Plain free blocks always precede cached ones: eviction is a last resort.
        flags = [b.key is not None for b in free]
        assert flags == sorted(flags)

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for b in self.pool.blocks:
            for _ in range(self.refs[b.id]):
                self.pool.release(b)
        assert self.pool.num_free == self.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.pool.blocks)


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestPoolMachine = PoolMachine.TestCase
