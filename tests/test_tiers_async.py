"""Loads from the tiers below the pool run off the engine thread: a request whose blocks are being
loaded waits (keeping its queue place) while the requests behind it run; an aborted request's
load installs nothing and leaks no block; a tier that raises is a hole. Outputs equal a run
without tiers and the dense oracle."""
import random
import threading
import time

import pytest
import torch

from spanserve import SamplingParams, Segment
from spanserve.cache.tiers.payload import BlockKV
from spanserve.engine.engine import LLMEngine
from spanserve.engine.layout import resolve
from spanserve.engine.request import Status
from spanserve.model.loader import load_model
from dense_reference import Dense
from engine_helpers import make_engine
from span_helpers import capture_logits
from tiny_models import make_tiny_model

BS = 4
N_BLOCKS = 96
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("tiers-async"))
    return load_model(str(path))


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 384) for _ in range(n)]


@pytest.fixture(scope="module")
def layouts():
    rng = random.Random(7)
    a = [Segment(token_ids=_toks(rng, 9)), Segment(token_ids=_toks(rng, 14), kind="plus"),
         Segment(token_ids=_toks(rng, 5))]
    b = [Segment(token_ids=_toks(rng, 11))]
    return a, b


@pytest.fixture(scope="module")
def expected(loaded, layouts):
    """Tokens of each layout from an engine without tiers."""
    eng = make_engine(loaded, block_size=BS, num_blocks=N_BLOCKS)
    reqs = [eng.add_request(x, GREEDY) for x in layouts]
    while eng.has_unfinished():
        eng.step()
    return [r.output_token_ids for r in reqs]


class Gate:
    """Stands in for a tier's load_many: holds a load of any of `held` (every load if None) until
    opened, or raises."""

    def __init__(self, load, fail: bool = False, held: "set[int] | None" = None):
        self.load, self.fail, self.held = load, fail, held
        self.entered, self.open = threading.Event(), threading.Event()
        self.calls = 0

    def __call__(self, keys):
        if self.held is not None and not self.held.intersection(keys):
            return self.load(keys)
        self.calls += 1
        self.entered.set()
        if self.fail:
            raise OSError("tier gone")
        assert self.open.wait(60), "test never opened the gate"
        return self.load(keys)


def _engine(loaded, async_loads: bool = True, store_url: "str | None" = None) -> LLMEngine:
    return make_engine(loaded, block_size=BS, num_blocks=N_BLOCKS,
                       kv_offload={"cpu_bytes": "1MiB", "async_loads": async_loads, "store_url": store_url,
                                   "store_secret": "async-test-secret-0123456789"})


def _to_host(eng: LLMEngine, layout) -> dict[int, BlockKV]:
    """Compute the layout's prompt once, then move every block the pool cached to the host tier
    (and out of the pool). Returns them by key."""
    req = eng.add_request(layout, SamplingParams(max_tokens=1, temperature=0))
    while eng.has_unfinished():
        eng.step()
    assert req.finished and eng.tiers.flush()
    cached = [b for b in eng.pool.blocks if b.key is not None]
    kv = torch.empty((len(cached), *eng.tiers.shape.dims), dtype=eng.dtype)
    eng.storage.read_blocks([b.id for b in cached], kv)
    eng.tiers.host.drain()
    blocks = {b.key: BlockKV(b.key, b.tokens, kv[i], b.parent) for i, b in enumerate(cached)}
    eng.tiers.host.store_many(list(blocks.values()))
    for b in cached:
        eng.pool.evict(b)
    assert eng.pool.num_free == N_BLOCKS and eng.pool.num_cached == 0
    return blocks


def _run(eng: LLMEngine, bound: int = 500) -> None:
    for _ in range(bound):
        if not eng.has_unfinished():
            return
        eng.step()
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("store", [False, True])
def test_others_run_while_a_request_loads(loaded, layouts, expected, request, store):
    """Host tier only: b, cold, starts no load. With a store, b's blocks might be there, so b
    asks for them too, on another loader thread, and is not held up by a's load."""
    a_layout, b_layout = layouts
    redis = request.getfixturevalue("redis_server") if store else None
    if redis is not None:
        redis.client().flushdb()
    eng = _engine(loaded, store_url=redis.url if redis is not None else None)
    gate = Gate(eng.tiers.host.load_many, held=set(_to_host(eng, a_layout)))
    eng.tiers.host.load_many = gate
    misses = eng.tiers.store.stats.misses if store else 0
    seen = capture_logits(eng)
    a = eng.add_request(a_layout, GREEDY)
    b = eng.add_request(b_layout, GREEDY)  # behind a in the queue, nothing of it below the pool
    for _ in range(50):
        eng.step()
        if b.finished:
            break
    assert gate.entered.wait(10) and b.finished and b.output_token_ids == expected[1]
    # a waited the whole time at the head of the queue, its load held, nothing computed
    assert a.status is Status.WAITING and eng.scheduler.waiting[0] is a and not a.output_token_ids
    assert a.request_id in eng.scheduler.loading
    if store:  # b asked the store for its blocks (a has not got that far)
        assert eng.tiers.store.stats.misses - misses == len(b_layout[0].token_ids) // BS + 1
    t0 = time.monotonic()
    assert eng.step() == []  # only a loading request left: the engine sleeps on the loader
    assert time.monotonic() - t0 >= 0.015
    gate.open.set()
    _run(eng)
    assert a.output_token_ids == expected[0]
    ref = Dense(loaded.config, loaded.weights).span_logits(resolve(a_layout, None, "none"))
    torch.testing.assert_close(seen[a.request_id].double(), ref, rtol=0, atol=1e-4)
    r = a.reuse
    assert r["host"] == r["prefix"] + r["perforated"] + r["segment"] > 0  # every hit came from host
    assert r["segment"] == 14 and r["computed"] == 1  # the whole prompt but its last token
    assert gate.calls == 1 and eng.tiers.served["host"] == r["host"]
    assert eng.pool.num_free == N_BLOCKS and not eng.scheduler.loading
    eng.shutdown()


def test_abort_while_loading_installs_nothing(loaded, layouts, expected):
    a_layout, b_layout = layouts
    eng = _engine(loaded)
    n_host = len(_to_host(eng, a_layout))
    gate = Gate(eng.tiers.host.load_many)
    eng.tiers.host.load_many = gate
    first = eng.add_request(a_layout, GREEDY)  # aborted while its load is held
    eng.step()
    assert gate.entered.wait(10) and first.request_id in eng.scheduler.loading
    job_in_flight = eng.scheduler.loading[first.request_id]
    eng.abort(first.request_id)
    assert job_in_flight.dropped and not eng.scheduler.loading and not eng.scheduler.waiting
    gate.open.set()
    second = eng.add_request(a_layout, GREEDY)  # aborted after its load landed, before install
    eng.step()
    job_landed = eng.scheduler.loading[second.request_id]
    assert eng.tiers.wait([job_landed], 10) and len(job_landed.found) == n_host
    eng.abort(second.request_id)
    assert eng.pool.num_cached == 0 and eng.pool.num_free == N_BLOCKS  # nothing installed, nothing held
    assert not eng.tiers.served
    b = eng.add_request(b_layout, GREEDY)  # the engine keeps serving
    a = eng.add_request(a_layout, GREEDY)
    _run(eng)
    assert b.output_token_ids == expected[1] and a.output_token_ids == expected[0]
    assert a.reuse["host"] > 0
    assert eng.pool.num_free == N_BLOCKS
    eng.shutdown()


def test_a_block_that_reached_the_pool_meanwhile_is_not_loaded(loaded, layouts, expected):
    a_layout, _ = layouts
    eng = _engine(loaded)
    blocks = _to_host(eng, a_layout)
    gate = Gate(eng.tiers.host.load_many)
    eng.tiers.host.load_many = gate
    a = eng.add_request(a_layout, GREEDY)
    eng.step()
    assert gate.entered.wait(10) and a.request_id in eng.scheduler.loading
    # while the load is held, every other full block reaches the pool (as if computed by another
    # request); the partial tails stay below, so each moved block serves exactly BS tokens
    moved = [kv for kv in blocks.values() if len(kv.tokens) == BS][::2]
    into = [eng.pool.allocate() for _ in moved]
    eng.storage.write_blocks([b.id for b in into], [kv.kv for kv in moved])
    for b, kv in zip(into, moved):
        eng.pool.register(b, kv.key, kv.tokens, parent=kv.parent)
    eng.pool.release_many(into)
    gate.open.set()
    _run(eng)
    assert a.output_token_ids == expected[0] and len(moved) >= 2
    assert len(eng.scheduler.loading) == 0 and a.num_cached_tokens == 27  # all but the last token
    assert a.reuse["host"] == eng.tiers.served["host"] == a.num_cached_tokens - BS * len(moved)
    assert eng.pool.num_free == N_BLOCKS
    eng.shutdown()


@pytest.mark.parametrize("async_loads", [True, False])
def test_a_tier_that_raises_is_a_hole(loaded, layouts, expected, async_loads):
    a_layout, _ = layouts
    eng = _engine(loaded, async_loads)
    _to_host(eng, a_layout)
    gate = Gate(eng.tiers.host.load_many, fail=True)
    eng.tiers.host.load_many = gate
    a = eng.add_request(a_layout, GREEDY)
    _run(eng)
    assert gate.calls == 1 and a.output_token_ids == expected[0]
    assert a.reuse["host"] == 0 and a.num_cached_tokens == 0  # every prompt token computed
    assert eng.tiers.host.stats.errors == 1
    assert eng.pool.num_free == N_BLOCKS
    eng.shutdown()
