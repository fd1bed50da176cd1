"""The warm-admission fast paths against the plain ones on random inputs: token checking through
marshal (one segment or all at once), the pool's chain memo (and its seeding on release), the
partial-block index, inlined acquire, the wholly cached plan shortcut and block tables as columns."""
from __future__ import annotations

import enum
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spanserve.cache import hashing
from spanserve.cache.block_pool import Block, BlockPool
from spanserve.cache.manager import CacheManager, _Plan
from spanserve.engine.layout import Piece, Segment, checked_many, checked_tokens, resolve
from spanserve.engine.params import SamplingParams
from spanserve.engine.request import Request
from spanserve.reuse.policies import resolve_policy

VOCAB = 50


# ---- token checking --------------------------------------------------------------------------
def plain_check(ids, vocab: int) -> list[int]:
    """The vectorized check as it was: numpy conversion, range check, tolist."""
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise ValueError("token ids must be integers") from None
    if arr.ndim != 1:
        raise ValueError("token ids must be a flat list of integers")
    bad = arr[(arr < 0) | (arr >= vocab)]
    if bad.size:
        raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5].tolist()}")
    return arr.tolist()


class Tok(enum.IntEnum):
    A = 3


ODD = st.sampled_from([True, False, 2.0, 3.7, np.int64(4), np.int32(5), Tok.A, "7", 2**31, 2**40, -1,
                       VOCAB, [1, 2], None])


@given(st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, 2**33), ODD), max_size=40))
@settings(max_examples=400, deadline=None)
def test_checked_tokens_matches_plain(ids):
    try:
        want = plain_check(ids, VOCAB)
    except ValueError as e:
        with pytest.raises(ValueError) as got:
            checked_tokens(ids, VOCAB)
        assert str(got.value) == str(e)
        return
    toks, packed = checked_tokens(ids, VOCAB)
    assert list(toks) == want and all(type(t) is int for t in toks)
    assert packed == np.asarray(want, dtype="<i4").tobytes()


@given(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=200), st.sampled_from(["list", "tuple", "array"]))
def test_checked_tokens_any_container(ids, kind):
    box = {"list": list, "tuple": tuple, "array": np.asarray}[kind](ids)
    toks, packed = checked_tokens(box, VOCAB)
    assert list(toks) == ids and all(type(t) is int for t in toks)
    assert packed == np.asarray(ids, dtype="<i4").tobytes()


IDS = st.lists(st.one_of(st.integers(0, VOCAB - 1), ODD), max_size=12)


@given(st.lists(st.one_of(IDS, st.lists(st.integers(0, VOCAB - 1), max_size=30)), max_size=6), st.booleans())
@settings(max_examples=300, deadline=None)
def test_checked_many_matches_one_by_one(idss, as_tuple):
    if as_tuple and idss:
        idss[0] = tuple(idss[0])
    got = checked_many(idss, VOCAB)
    try:
        want = [checked_tokens(ids, VOCAB) for ids in idss]
    except ValueError:
        assert got is None  # the caller goes one by one and raises there
        return
    if got is None:  # allowed only where the shortcut cannot tell exact ints (not a list)
        assert any(type(ids) is not list for ids in idss) or any(type(x) is not int for ids in idss for x in ids)
        return
    assert got == want and all(type(t) is int for toks, _ in got for t in toks)


@given(st.lists(st.tuples(st.sampled_from(["cross", "plus"]), st.one_of(IDS, st.lists(st.integers(0, VOCAB - 1)))),
                min_size=1, max_size=5), st.sampled_from(["none", "full"]))
@settings(max_examples=200, deadline=None)
def test_resolve_checks_all_segments_at_once(segs, policy):
    """resolve with check_all (what the engine passes) against one check per segment: the same
    pieces with the same packed bytes, or the same error."""
    layout = [Segment(token_ids=ids, kind=kind) for kind, ids in segs]

    def run(**kw):
        try:
            return [(p, p.packed) for p in resolve(layout, None, policy, check=lambda ids: checked_tokens(ids, VOCAB), **kw)]
        except ValueError as e:
            return str(e)

    assert run(check_all=lambda idss: checked_many(idss, VOCAB)) == run()


# ---- the pool's chain memo -------------------------------------------------------------------
def _chain(rng: random.Random, n: int, bs: int, seed: int) -> tuple[list[int], tuple[int, ...]]:
    toks = tuple(rng.randrange(VOCAB) for _ in range(n * bs))
    return hashing.chain_keys(seed, toks, bs), toks


def _packed(toks) -> bytes:
    return np.asarray(toks, dtype="<i4").tobytes()


@pytest.mark.parametrize("seed", range(25))
def test_chain_memo_matches_block_by_block(seed):
    """Random registration, eviction, reallocation and a forged key (a collision) in between:
    the memoized answer must always be the block-by-block one."""
    rng = random.Random(seed)
    bs, pool = 2, BlockPool(40)
    chains = [_chain(rng, rng.randrange(1, 9), bs, s) for s in range(6)]
    for _ in range(150):
        op = rng.random()
        keys, toks = rng.choice(chains)
        if op < 0.3:  # publish some blocks of a chain
            for i in rng.sample(range(len(keys)), rng.randrange(len(keys) + 1)):
                if pool.lookup(keys[i], toks[i * bs:(i + 1) * bs]) is None and pool.num_free:
                    b = pool.allocate()
                    pool.register(b, keys[i], toks[i * bs:(i + 1) * bs])
                    pool.release(b)
        elif op < 0.45 and pool.num_free:
            pool.allocate()  # may evict a cached block; held from now on
        elif op < 0.55:
            cached = [b for b in pool.free_blocks() if b.key is not None]
            if cached:
                pool.evict(rng.choice(cached))
        elif op < 0.62 and pool.num_free:  # another block under a chain's key, other tokens
            i = rng.randrange(len(keys))
            if pool.lookup(keys[i], toks[i * bs:(i + 1) * bs]) is not None:
                pool.evict(pool._index[keys[i]]) if pool._index[keys[i]].ref_cnt == 0 else None
            if keys[i] not in pool._index:
                b = pool.allocate()
                pool.register(b, keys[i], [VOCAB + 1] * bs)
                pool.release(b)
        for keys, toks in chains:
            want = pool.lookup_chain(keys, toks, bs)
            for _ in range(2):  # the second call answers from the memo where it can
                assert pool.lookup_chain(keys, toks, bs, _packed(toks)) == want


def test_chain_memo_needs_the_same_tokens_and_keys():
    rng = random.Random(1)
    bs, pool = 2, BlockPool(16)
    keys, toks = _chain(rng, 6, bs, 0)
    for i in range(6):
        b = pool.allocate()
        pool.register(b, keys[i], toks[i * bs:(i + 1) * bs])
    whole = pool.lookup_chain(keys, toks, bs, _packed(toks))
    assert None not in whole
    other = toks[:-1] + ((toks[-1] + 1) % VOCAB,)  # same keys, last token differs
    assert pool.lookup_chain(keys, other, bs, _packed(other))[-1] is None
    moved = keys[:-1] + [keys[-1] ^ 1]
    assert pool.lookup_chain(moved, toks, bs, _packed(toks))[-1] is None
    reseeded = [keys[0] ^ 1] + keys[1:]  # same last key, another chain: only a collision does that
    assert pool.lookup_chain(reseeded, toks, bs, _packed(toks))[0] is None
    assert pool.lookup_chain(keys, toks, bs, _packed(toks)) == whole


# ---- the pool: partial index, chain memo seeded on release, inlined acquire -----------------------
def scan_partial(pool: BlockPool, parent: int, toks, longest: int):
    """The partial probe as it was: every cached partial block of the parent, compared."""
    best, got = None, 0
    for b in pool.partials(parent):
        n = len(b.tokens)
        if got < n <= longest and b.tokens == tuple(toks[:n]):
            best, got = b, n
    return best, got


@pytest.mark.parametrize("seed", range(30))
def test_pool_fast_paths_match_plain(seed):
    """Random registration (whole and partial blocks, forged keys: collisions), eviction,
    reallocation; after each op: the length-indexed partial probe equals the scan, a seeded
    chain memo answers as block-by-block lookups, and inlined acquire_many moves the free list
    as acquire() does."""
    rng = random.Random(seed)
    bs, pool = 3, BlockPool(48)
    parents = [hashing.seed("p", i) for i in range(3)]
    chains = []
    for s in range(5):
        toks = tuple(rng.randrange(4) for _ in range(rng.randrange(4, 8) * bs))
        chains.append((hashing.chain_keys(s, toks, bs), toks))
    for _ in range(120):
        op = rng.random()
        keys, toks = rng.choice(chains)
        if op < 0.25 and pool.num_free:  # a partial block, maybe under a key not its own
            parent, n = rng.choice(parents), rng.randrange(1, bs)
            t = tuple(rng.randrange(3) for _ in range(n))
            key = hashing.block_key(parent, t) if rng.random() < 0.8 else rng.randrange(1 << 64)
            b = pool.allocate()
            pool.register(b, key, t, parent=parent)
            pool.release(b)
        elif op < 0.5 and pool.num_free >= 2 * len(keys):  # a chain published, then remembered
            mine = []
            for i, k in enumerate(keys):
                if rng.random() < 0.1 and k not in pool._index:  # another holder, other tokens
                    other = pool.allocate()
                    pool.register(other, k, (9,) * bs)
                    pool.release(other)
                b = pool.allocate()
                pool.register(b, k, toks[i * bs:(i + 1) * bs])  # first writer wins
                mine.append(b)
            pool.remember_chain(keys, toks, bs, _packed(toks), mine)
            pool.release_many(mine)
        elif op < 0.6 and pool.num_free:
            pool.allocate()  # held from now on; may evict
        elif op < 0.75:
            cached = [b for b in pool.free_blocks() if b.key is not None]
            if cached:
                pool.evict(rng.choice(cached))
        for parent in parents:
            for n in range(1, bs):
                t = tuple(rng.randrange(3) for _ in range(bs))
                got, want = pool.longest_partial(parent, t, n), scan_partial(pool, parent, t, n)
                # blocks of equal tokens under one parent (forged keys only) are interchangeable
                assert got[1] == want[1] and (got[0] is None) == (want[0] is None)
                assert got[0] is want[0] or (got[0].tokens == want[0].tokens and got[0].parent == parent)
        for k, t in chains:
            assert pool.lookup_chain(k, t, bs, _packed(t)) == pool.lookup_chain(k, t, bs)


@pytest.mark.parametrize("seed", range(10))
def test_acquire_many_matches_acquire(seed):
    pools = [BlockPool(24), BlockPool(24)]
    for many, pool in zip((True, False), pools):
        rng = random.Random(seed)
        held = []
        for step in range(60):
            if rng.random() < 0.4 and pool.num_free:
                b = pool.allocate()
                if rng.random() < 0.5:
                    pool.register(b, step, (step,))
                held.append(b)
            elif rng.random() < 0.5 and held:
                pool.release(held.pop(rng.randrange(len(held))))
            else:
                picks = [rng.choice(pool.blocks) for _ in range(rng.randrange(8))]
                if many:
                    pool.acquire_many(picks)
                else:
                    for b in picks:
                        pool.acquire(b)
                held += picks
    a, b = pools
    assert [x.id for x in a.free_blocks()] == [x.id for x in b.free_blocks()] and a.num_free == b.num_free
    assert [x.ref_cnt for x in a.blocks] == [x.ref_cnt for x in b.blocks]


# ---- admission: memo and plan shortcut against the plain path ----------------------------------
class _Storage:
    def copy(self, src: int, dst: int, n: int) -> None:
        pass

    def copy_many(self, jobs) -> None:
        pass

    def copy_rotated(self, src, dst, delta, rotary) -> None:
        pass


def reference_plan(m: CacheManager, seed: int, tokens, keys: list[int], extended: bool) -> _Plan:
    """Block by block, no memo and no shortcut: what _plan_unit must return."""
    bs, pool = m.block_size, m.pool
    n_blocks = -(-len(tokens) // bs)
    shared: list[Block | None] = []
    copies = {}
    for i in range(n_blocks):
        toks = tuple(tokens[i * bs:(i + 1) * bs])
        parent = keys[i - 1] if i else seed
        last = i == n_blocks - 1
        key = keys[i] if len(toks) == bs else hashing.block_key(parent, toks)
        hit = pool.lookup(key, toks)
        if hit is not None and not (extended and last):
            shared.append(hit)
            continue
        shared.append(None)
        keep = len(toks) - 1 if (extended and last) else len(toks)
        copies[i] = (hit, keep) if hit is not None else scan_partial(pool, parent, toks, min(keep, len(toks) - 1))
    return _Plan(shared, copies)


def _layout(rng: random.Random, docs: list[list[int]], questions: list[list[int]], packed: bool,
            anchored: bool) -> list[Piece]:
    pieces, pos = [], 0
    if anchored:
        head = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        pieces.append(Piece("cross", tuple(head), 0, packed=_packed(head) if packed else None))
        pos = len(head)
    for d in rng.sample(docs, rng.randrange(1, len(docs) + 1)):
        d = list(d)
        if rng.random() < 0.2:  # an edited copy: a perforated hit
            d[rng.randrange(len(d))] = rng.randrange(VOCAB)
        a = pieces[0].end if anchored and rng.random() < 0.3 else 0  # anchor="prefix"
        pieces.append(Piece("plus", tuple(d), pos, a, packed=_packed(d) if packed else None))
        pos += len(d)
    q = rng.choice(questions)  # asked again, or a prefix of one asked before: copy sources
    q = q[:rng.randrange(1, len(q) + 1)] if rng.random() < 0.5 else q
    pieces.append(Piece("cross", tuple(q), pos, packed=_packed(q) if packed else None))
    return pieces


def admit(m: CacheManager, req: Request) -> bool:
    """As the scheduler admits: the manager takes the request's plain view, the request carries
    the holding it gets back."""
    kv = m.admit(req.admission())
    if kv is not None:
        req.hold(kv)
    return kv is not None


def _state(req: Request) -> tuple:
    tasks = [(list(t.tokens), t.todo, t.slots.tolist(), None if t.deltas is None else t.deltas.tolist(),
              t.sample, t.main) for t in req.tasks]
    units = [(u.keys, [b.id for b in u.blocks], u.n_valid, u.todo, u.fresh) for u in req.units + req.sources]
    return tasks, units, [b.id for b in req.held], dict(req.reuse)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy", ["none", "cacheblend"])
def test_admission_with_and_without_packed_tokens(seed, policy):
    """Twin pools see the same requests, one with the tokens packed (chain memo on) and one
    without; every admission must give the same blocks, tasks and reuse, and every unit plan
    must equal the block-by-block reference."""
    rng = random.Random(seed)
    bs, n_blocks = 4, rng.randrange(48, 160)
    managers = [CacheManager(BlockPool(n_blocks), _Storage(), bs) for _ in range(2)]
    docs = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(5)]
    questions = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    pol = resolve_policy(policy)
    for step in range(30):
        layout_seed = rng.random()
        anchored = rng.random() < 0.3
        reqs = []
        for packed, m in zip((True, False), managers):
            pieces = _layout(random.Random(layout_seed), docs, questions, packed, anchored)
            ids = [t for p in pieces for t in p.tokens]
            req = Request(f"r{step}", ids, SamplingParams(), pieces=pieces, policy=pol)
            for u in m._units(req.admission()):
                want = reference_plan(m, u.seed, u.tokens, u.keys, u.final)
                assert m._plan_unit(u.seed, u.tokens, u.keys, u.final, u.packed, u.tail_key) == want
            reqs.append((m, req, admit(m, req)))
        (ma, ra, oka), (mb, rb, okb) = reqs
        assert oka == okb
        if not oka:
            continue
        assert _state(ra) == _state(rb)
        computed, decoded, resumed = rng.random() < 0.8, rng.random() < 0.5, rng.random() < 0.3
        tok = rng.randrange(VOCAB)
        for m, req, _ in reqs:
            if computed:  # as if the forward ran: everything is published on release
                for t in req.tasks:
                    t.todo.clear()
            if computed and decoded:  # one generated token: the table grows when a block fills
                req.output_token_ids.append(tok)
                req.main.tokens.append(tok)
                req.main.todo.append(len(req.main.tokens) - 1)
                assert m.ensure_capacity(req.kv)
        assert _state(ra) == _state(rb)
        if computed and decoded and resumed:  # preempted, then admitted again with its output
            for m, req, _ in reqs:
                m.release(req.kv)
                req.num_preemptions += 1
            assert admit(ma, ra) == admit(mb, rb)
            assert _state(ra) == _state(rb)
        for m, req, _ in reqs:
            m.release(req.kv)
        assert [b.ref_cnt for b in ma.pool.blocks] == [b.ref_cnt for b in mb.pool.blocks]
        assert [b.id for b in ma.pool.free_blocks()] == [b.id for b in mb.pool.free_blocks()]
