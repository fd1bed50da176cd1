"""KV tiers below the pool, against the dense oracle: a layout's blocks scattered across the pool,
host memory, disk, Redis and nowhere (every pattern of holes) give the same logits and tokens as
a run without tiers."""
import random

import pytest
import torch

from spanserve import LLM, SamplingParams, Segment
from spanserve.cache.tiers.payload import BlockKV
from spanserve.engine.layout import resolve
from spanserve.model.loader import load_model
from dense_reference import Dense
from span_helpers import capture_logits
from tiny_models import make_tiny_model

BS = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PLACES = ("pool", "host", "disk", "store", "nowhere")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("tiers"))
    return load_model(str(path))


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 384) for _ in range(n)]


def _layout(rng: random.Random) -> list[Segment]:
    segs = [Segment(token_ids=_toks(rng, rng.randrange(1, 11)))]
    for _ in range(rng.randrange(1, 4)):
        anchor = "prefix" if rng.random() < 0.3 else "none"
        segs.append(Segment(token_ids=_toks(rng, rng.randrange(3, 19)), kind="plus", anchor=anchor))
        if rng.random() < 0.4:
            segs.append(Segment(token_ids=_toks(rng, rng.randrange(1, 6))))
    segs.append(Segment(token_ids=_toks(rng, rng.randrange(1, 7))))
    return segs


def _offload(tmp_path, redis_server, async_loads: bool) -> dict:
    return {"cpu_bytes": "1MiB", "disk_path": str(tmp_path / "kv"), "disk_bytes": "8MiB",
            "store_url": redis_server.url, "store_secret": "oracle-test-secret-0123456789", "async_loads": async_loads}


def _cached_blocks(llm: LLM) -> list[BlockKV]:
    """Every block the pool has published (full ones and partial tails), copied out."""
    e = llm.engine
    cached = [b for b in e.pool.blocks if b.key is not None]
    out = torch.empty((len(cached), *e.tiers.shape.dims), dtype=e.dtype)
    e.storage.read_blocks([b.id for b in cached], out)
    return [BlockKV(b.key, b.tokens, out[i], b.parent) for i, b in enumerate(cached)]


def _scatter(llm: LLM, blocks: list[BlockKV], where: dict[int, str], redis_server) -> None:
    """Empty the pool and every tier, then put each block where `where` says."""
    e = llm.engine
    stack = e.tiers
    assert stack.flush()
    for b in list(e.pool.blocks):
        if b.key is not None and b.ref_cnt == 0:
            e.pool.evict(b)
    stack.host.drain()
    stack.disk.clear()
    redis_server.client().flushdb()
    by_place = {p: [b for b in blocks if where[b.key] == p] for p in PLACES}
    stack.host.store_many(by_place["host"])
    stack.disk.store_many(by_place["disk"])
    stack.store.store_many(by_place["store"])
    pool_blocks = [e.pool.allocate() for _ in by_place["pool"]]
    e.storage.write_blocks([b.id for b in pool_blocks], [kv.kv for kv in by_place["pool"]])
    for pb, kv in zip(pool_blocks, by_place["pool"]):
        e.pool.register(pb, kv.key, kv.tokens, parent=kv.parent)
    e.pool.release_many(pool_blocks)


# loads beside other requests (the default) and inside admission
@pytest.mark.parametrize("seed,async_loads", [(s, True) for s in range(6)] + [(s, False) for s in range(2)])
def test_scattered_blocks_equal_the_oracle(loaded, tmp_path, redis_server, seed, async_loads):
    rng = random.Random(seed)
    layout = _layout(rng)
    plain = LLM(loaded, block_size=BS, num_blocks=128).generate(layout, GREEDY)[0]
    ref = Dense(loaded.config, loaded.weights).span_logits(resolve(layout, None, "none"))
    llm = LLM(loaded, block_size=BS, num_blocks=128, kv_offload=_offload(tmp_path, redis_server, async_loads))
    seen = capture_logits(llm.engine)
    cold = llm.generate(layout, SamplingParams(max_tokens=1, temperature=0))[0]
    assert cold.token_ids == plain.token_ids[:1]
    blocks = _cached_blocks(llm)  # the prompt's blocks (one token generated: no KV beyond)
    patterns = [{b.key: p for b in blocks} for p in PLACES]  # warm in each tier, and cold
    patterns += [{b.key: rng.choice(PLACES) for b in blocks} for _ in range(4)]  # perforated
    for where in patterns:
        _scatter(llm, blocks, where, redis_server)
        out = llm.generate(layout, GREEDY)[0]
        assert out.token_ids == plain.token_ids, where
        torch.testing.assert_close(seen[out.request_id].double(), ref, rtol=0, atol=1e-4)
        reuse = out.metrics["reuse"]
        for tier in ("host", "disk", "store"):  # every placed block serves its tokens (the last one: less one)
            placed = sum(len(b.tokens) for b in blocks if where[b.key] == tier)
            assert placed - 1 <= reuse[tier] <= placed, (tier, where)
            if all(p == tier for p in where.values()):
                assert reuse[tier] == out.metrics["cached_tokens"]
        # a block in a tier serves exactly as the same block resident in the pool would
        _scatter(llm, blocks, {k: "pool" if p != "nowhere" else p for k, p in where.items()}, redis_server)
        resident = llm.generate(layout, GREEDY)[0].metrics["reuse"]
        kinds = ("prefix", "perforated", "segment", "computed")
        assert {k: reuse[k] for k in kinds} == {k: resident[k] for k in kinds}
        if all(p == "nowhere" for p in where.values()):
            assert out.metrics["cached_tokens"] == 0
    llm.close()
    assert llm.engine.pool.num_free == 128
