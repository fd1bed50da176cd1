"""KV tiers under tensor parallelism (TP=2, gloo, two processes). Tiers keep whole blocks (every
rank's heads): blocks evicted from a small pool go to host memory and disk, standalone segments
through to Redis, and come back into every rank's heads with the outputs of TP=1 without tiers;
a disk tier written at TP=2 serves TP=1 and one written at TP=1 serves TP=2 (also with a KV head
replicated over both ranks)."""
import dataclasses
import os
import signal
import time

import pytest
import torch
from span_helpers import capture_logits, run_all
from tiny_models import make_tiny_model

from spanserve import LLM, SamplingParams, Segment
from spanserve.cache.tiers import model_fingerprint
from spanserve.model.config import ModelConfig
from spanserve.model.fingerprint import LeadingRows, whole_model_fingerprint
from spanserve.model.loader import load_model
from spanserve.model.weights import RandomWeights, source_of

BS = 4
POOL = 24  # blocks per rank: a few prompts overflow it, so blocks are evicted and loaded back
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
ONE_KV = ModelConfig(arch="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=1, head_dim=8, max_position_embeddings=4096)


def _toks(n, seed, vocab=384):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


PROMPTS = [_toks(37, i) for i in range(5)]
DOCS = [_toks(n, 100 + n) for n in (13, 9, 17)]
SECRET = "tp-test-secret-0123456789"  # the store's and the disk tier's payloads carry a MAC


def _layout(order, q):
    return ([Segment(token_ids=_toks(6, 7))] + [Segment(token_ids=DOCS[i], kind="plus") for i in order]
            + [Segment(token_ids=_toks(5, q))])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tp-tiers"))[0]


@pytest.fixture(scope="module")
def ref(model):
    """TP=1 without tiers, a pool that keeps everything."""
    return LLM(str(model), block_size=BS, num_blocks=512)


@pytest.fixture(scope="module")
def tp(model, tmp_path_factory, redis_server):
    disk = tmp_path_factory.mktemp("tp-kv") / "kv"
    llm = LLM(str(model), block_size=BS, num_blocks=POOL, tensor_parallel_size=2,
              kv_offload={"cpu_bytes": 20 * 2048, "disk_path": str(disk), "disk_bytes": "8MiB",  # host: 20 blocks
                          "store_url": redis_server.url, "store_secret": SECRET,
                          "store_timeout_ms": 5000})
    yield llm, disk
    llm.shutdown()


def _same_outputs(ref, llm, batch):
    """Greedy tokens equal and prompt-end logits within 1e-4; the reuse counts of `llm`."""
    s1, s2 = capture_logits(ref.engine), capture_logits(llm.engine)
    reuse = {"host": 0, "disk": 0}
    for p in batch:  # one at a time: each admission looks its blocks up in the tiers
        a, b = ref.generate(p, GREEDY)[0], llm.generate(p, GREEDY)[0]
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(s2[b.request_id], s1[a.request_id], rtol=0, atol=1e-4)
        for t in reuse:
            reuse[t] += b.metrics["reuse"][t]
    return reuse


def test_evicted_blocks_come_back_with_tp1_outputs(ref, tp):
    llm, _ = tp
    e = llm.engine
    cold = _same_outputs(ref, llm, PROMPTS + [_layout([0, 1, 2], 1)])
    assert cold == {"host": 0, "disk": 0}
    assert e.tiers.flush()
    assert len(e.tiers.host) == 20 and len(e.tiers.disk) > 0  # the host tier spilled to disk
    # the documents went through to the store as soon as they were computed: TP=1's KV, every head
    ref_blocks = [b for b in ref.engine.pool.blocks if b.key is not None]
    stored = e.tiers.store.load_many([b.key for b in ref_blocks])
    assert sum(x is not None for x in stored) >= sum(len(d) // BS for d in DOCS)
    want = torch.empty(len(ref_blocks), *e.tiers.shape.dims)
    ref.engine.storage.read_blocks([b.id for b in ref_blocks], want)
    for b, w, x in zip(ref_blocks, want, stored):
        if x is not None:
            n = len(b.tokens)
            torch.testing.assert_close(x.kv[:, :, :n], w[:, :, :n], rtol=0, atol=1e-5)
    # newest first: host memory holds the newest blocks, disk the older ones; docs reordered: new deltas
    warm = _same_outputs(ref, llm, [_layout([2, 0, 1], 2)] + PROMPTS[::-1])
    assert warm["host"] > 0 and warm["disk"] > 0, warm
    assert e.pool.num_free == POOL  # nothing leaked


def test_whole_blocks_read_and_written_over_both_ranks(ref, tp):
    """A capture holds every head in order (TP=1's block); a load lands on each rank's heads."""
    llm, _ = tp
    e1, e2 = ref.engine, llm.engine
    run_all(e1, [PROMPTS[0]]), run_all(e2, [PROMPTS[0]])
    by_key = {b.key: b.id for b in e1.pool.blocks if b.key is not None}
    mine = [b for b in e2.pool.blocks if b.key is not None and b.key in by_key]
    assert mine
    dims = e2.tiers.shape.dims
    got, want = torch.empty(len(mine), *dims), torch.empty(len(mine), *dims)
    e2.storage.read_blocks([b.id for b in mine], got)
    e1.storage.read_blocks([by_key[b.key] for b in mine], want)
    for b, g, w in zip(mine, got, want):  # a partial block's slots past its tokens hold nothing
        torch.testing.assert_close(g[:, :, :len(b.tokens)], w[:, :, :len(b.tokens)], rtol=0, atol=1e-5)

    blocks = [e2.pool.allocate() for _ in range(3)]
    kv = torch.randn(3, *dims)
    e2.storage.write_blocks([b.id for b in blocks], list(kv))
    back = torch.empty_like(kv)
    e2.storage.read_blocks([b.id for b in blocks], back)
    assert torch.equal(back, kv)
    ids = torch.tensor([b.id for b in blocks])
    assert torch.equal(e2.storage.k[:, ids], kv[:, 0, :, :, :1].transpose(0, 1))  # the driver: head 0
    e2.pool.release_many(blocks)


def test_a_disk_tier_written_at_tp2_serves_tp1(model, ref, tp):
    llm, disk = tp
    run_all(llm.engine, PROMPTS)
    llm.shutdown()  # what the host tier and the pool hold goes to disk too
    one = LLM(str(model), block_size=BS, num_blocks=512,
              kv_offload={"disk_path": str(disk), "disk_bytes": "8MiB", "store_secret": SECRET})
    reuse = _same_outputs(ref, one, PROMPTS)
    assert reuse["disk"] >= len(PROMPTS) * 36  # every prompt served from disk but its last token
    one.close()


def test_a_replicated_kv_head_to_and_from_disk(tmp_path):
    """One KV head over two ranks: a capture takes it once; TP=1's disk blocks serve TP=2. With
    its worker dead, the engine shuts down without reading the pool."""
    weights = RandomWeights(ONE_KV, seed=3)
    disk = {"disk_path": str(tmp_path / "kv"), "disk_bytes": "8MiB"}
    prompts = [_toks(29, i, vocab=97) for i in range(4)]
    one = LLM(weights, block_size=BS, num_blocks=256, kv_offload=disk)
    s1 = capture_logits(one.engine)
    outs1 = one.generate(prompts, GREEDY)
    one.close()  # its pool goes to disk
    two = LLM(weights, block_size=BS, num_blocks=POOL, tensor_parallel_size=2, kv_offload=disk)
    try:
        s2 = capture_logits(two.engine)
        for p, o1 in zip(prompts, outs1):
            o2 = two.generate(p, GREEDY)[0]
            assert o2.token_ids == o1.token_ids
            assert o2.metrics["reuse"]["disk"] >= 28
            torch.testing.assert_close(s2[o2.request_id], s1[o1.request_id], rtol=0, atol=1e-4)
        e = two.engine
        cached = [b for b in e.pool.blocks if b.key is not None and len(b.tokens) == BS]
        on_disk = e.tiers.disk.load_many([b.key for b in cached])
        assert sum(x is not None for x in on_disk) > 0
        got = torch.empty(len(cached), *e.tiers.shape.dims)
        e.storage.read_blocks([b.id for b in cached], got)
        for g, d in zip(got, on_disk):
            if d is not None:
                torch.testing.assert_close(g, d.kv, rtol=0, atol=1e-5)
        os.kill(e.tp.procs[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while e.tp.dead is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert e.tp.dead is not None
        two.shutdown()  # the pool cannot be read any more: not kept, and no error at shutdown
    finally:
        two.shutdown()


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True)])
def test_the_driver_fingerprints_the_model_as_tp1_does(tmp_path, arch, tie):
    path = make_tiny_model(arch, tmp_path, tie=tie)[0]
    for dtype in (torch.float32, torch.bfloat16):
        loaded = load_model(str(path), dtype)
        want = model_fingerprint(loaded.config, loaded.weights, dtype, BS)
        for source in (source_of(str(path)), source_of(loaded)):
            assert whole_model_fingerprint(source, loaded.config, dtype, BS, torch.device("cpu")) == want
        assert whole_model_fingerprint(source_of(str(path)), loaded.config, dtype, BS + 1, torch.device("cpu")) != want
    wide = dataclasses.replace(ONE_KV, vocab_size=600, hidden_size=64, intermediate_size=512)  # > 64 KiB tensors
    for config in (wide, dataclasses.replace(wide, tie_word_embeddings=True)):
        random = RandomWeights(config, seed=1)
        for dtype in (torch.float32, torch.bfloat16):
            whole = random.whole(dtype, "cpu").weights
            rows = LeadingRows(random, config, dtype, torch.device("cpu"))
            assert rows.keys() == whole.keys()
            for name, t in whole.items():  # row-parallel ones too (their rows cross the random pieces)
                assert torch.equal(rows[name], t[:len(rows[name])]), name
            assert (whole_model_fingerprint(random, config, dtype, BS, torch.device("cpu"))
                    == model_fingerprint(config, whole, dtype, BS))
