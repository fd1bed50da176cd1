"""Reuse beyond prefixes on a tiny model: perforated holes, generated-output units, tenants, pins."""
import pytest
import torch

from spanserve import LLM, SamplingParams, Segment
from spanserve.cache import hashing
from spanserve.model.loader import load_model
from dense_reference import Dense
from span_helpers import capture_logits
from tiny_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("reuse"))
    return load_model(str(path))


def _toks(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


def test_perforated_reuse_is_exact(loaded):
    bs = 4
    prompt = _toks(61, 1)
    cold = LLM(loaded, block_size=bs, num_blocks=256).generate(prompt, GREEDY)[0]
    llm = LLM(loaded, block_size=bs, num_blocks=256)
    llm.generate(prompt, GREEDY)
    keys = hashing.chain_keys(hashing.seed(""), prompt, bs)
    for i in (2, 3, 7, 11):  # holes in the middle of the chain
        blk = llm.engine.pool.lookup(keys[i], prompt[i * bs:(i + 1) * bs])
        llm.engine.pool.evict(blk)
    warm = llm.generate(prompt, GREEDY)[0]
    r = warm.metrics["reuse"]
    assert r["prefix"] == 2 * bs and r["perforated"] > 0
    assert r["computed"] == 4 * bs + 1  # the holes and the last token
    assert warm.token_ids == cold.token_ids


def test_generated_output_is_a_reusable_unit(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=512)
    a_prompt = _toks(23, 2)
    a = llm.generate(a_prompt, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))[0]
    conversation = a_prompt + a.token_ids
    b_layout = [Segment(token_ids=_toks(9, 3)), Segment(token_ids=conversation, kind="plus"),
                Segment(token_ids=_toks(6, 4))]
    seen = capture_logits(llm.engine)
    b = llm.generate(b_layout, GREEDY)[0]
    assert b.metrics["reuse"]["segment"] >= len(conversation) - 1
    # and it is exactly what the span semantics say
    from spanserve.engine.layout import resolve
    ref = Dense(loaded.config, loaded.weights).span_logits(resolve(b_layout, None, "none"))
    rid = next(iter(seen))
    torch.testing.assert_close(seen[rid].double(), ref, rtol=0, atol=1e-4)


def test_namespaces_never_share_blocks(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=512)
    doc = _toks(40, 5)
    layout = [Segment(token_ids=_toks(5, 6)), Segment(token_ids=doc, kind="plus"), Segment(token_ids=_toks(4, 7))]
    seen_blocks = {}
    for ns in ("tenant-a", "tenant-b"):
        before = {b.id for b in llm.engine.pool.blocks if b.key is not None}
        out = llm.generate(layout, GREEDY, namespace=ns)[0]
        assert out.metrics["cached_tokens"] == 0
        seen_blocks[ns] = {b.id for b in llm.engine.pool.blocks if b.key is not None} - before
    assert seen_blocks["tenant-a"] and seen_blocks["tenant-b"]
    assert not seen_blocks["tenant-a"] & seen_blocks["tenant-b"]
    again = llm.generate(layout, GREEDY, namespace="tenant-a")[0]
    assert again.metrics["reuse"]["segment"] == len(doc)


def test_pinned_segments_survive_pressure_and_unpin_frees_them(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=64, pin_fraction=0.5)
    docs = [Segment(token_ids=_toks(30, 10 + i), kind="plus", key=f"doc{i}") for i in range(2)]
    llm.pin(docs)
    pinned_blocks = 2 * 8
    assert llm.engine.pool.num_free == 64 - pinned_blocks
    for i in range(6):  # churn through more than the pool holds
        llm.generate(_toks(40, 100 + i), GREEDY)
    out = llm.generate([Segment(token_ids=[7, 8]), docs[1], docs[0], Segment(token_ids=[9])], GREEDY)[0]
    assert out.metrics["reuse"]["segment"] == 60
    llm.unpin(["doc0", "doc1"])
    assert llm.engine.pool.num_free == 64
    with pytest.raises(ValueError, match="pin"):
        llm.pin([Segment(token_ids=_toks(200, 3), kind="plus")])
    with pytest.raises(ValueError, match="nothing is pinned"):
        llm.unpin("doc0")


def test_invalid_layouts_explain_themselves(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([Segment(token_ids=[]), Segment(token_ids=[5])], GREEDY)
    with pytest.raises(ValueError, match="kind"):
        Segment(token_ids=[1], kind="star")
    with pytest.raises(ValueError, match="anchor"):
        llm.generate([Segment(token_ids=[5], kind="plus", anchor="prefix"), Segment(token_ids=[5])], GREEDY)
    with pytest.raises(ValueError, match="end with a cross"):
        llm.generate([Segment(token_ids=[5]), Segment(token_ids=[6], kind="plus")], GREEDY)
    with pytest.raises(ValueError, match="policy"):
        llm.generate([Segment(token_ids=[5])], GREEDY, policy="magic")
    assert llm.engine.pool.num_free == 64


def test_full_policy_equals_plain_prompt(loaded):
    llm = LLM(loaded, block_size=4, num_blocks=256)
    parts = [_toks(7, 20), _toks(13, 21), _toks(5, 22)]
    layout = [Segment(token_ids=parts[0]), Segment(token_ids=parts[1], kind="plus"), Segment(token_ids=parts[2])]
    plain = llm.generate(sum(parts, []), GREEDY)[0]
    full = llm.generate(layout, GREEDY, policy="full")[0]
    assert full.token_ids == plain.token_ids
    assert full.metrics["reuse"]["prefix"] == 24  # the plain prompt's blocks served it


def test_eager_repositioning_matches_deferred(loaded):
    doc = _toks(30, 40)
    first = [Segment(token_ids=_toks(3, 41)), Segment(token_ids=doc, kind="plus"), Segment(token_ids=[9, 9])]
    moved = [Segment(token_ids=_toks(17, 42)), Segment(token_ids=doc, kind="plus"), Segment(token_ids=[9, 9])]
    outs = {}
    for mode in ("deferred", "eager"):
        llm = LLM(loaded, block_size=4, num_blocks=256, reposition=mode)
        seen = capture_logits(llm.engine)
        llm.generate(first, GREEDY)
        out = llm.generate(moved, GREEDY)[0]
        assert out.metrics["reuse"]["segment"] == len(doc)
        outs[mode] = (out.token_ids, seen[out.request_id])
        assert llm.engine.pool.num_free == 256
    assert outs["eager"][0] == outs["deferred"][0]
    torch.testing.assert_close(outs["eager"][1], outs["deferred"][1], rtol=0, atol=1e-4)


def test_partial_tail_blocks_are_reused(loaded):
    """A finished conversation ends inside a block; the next turn copies that cached partial
    block instead of recomputing it, and a repeated prompt computes only its last token."""
    bs = 8
    llm = LLM(loaded, block_size=bs, num_blocks=256)
    first = _toks(19, 7)  # with 4 generated tokens (the last never computed): 22 have KV
    out = llm.generate(first, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    again = llm.generate(first, GREEDY)[0]
    assert again.metrics["reuse"]["computed"] == 1  # the prompt's tail block was snapshotted
    turn2 = first + out.token_ids + _toks(6, 8)
    warm = llm.generate(turn2, GREEDY)[0]
    r = warm.metrics["reuse"]
    # 22 tokens have KV: 16 in two full blocks, 6 in a partial third block that is copied
    assert r["prefix"] == len(first) + len(out.token_ids) - 1 == 22
    assert r["computed"] == len(turn2) - r["prefix"]
    cold = LLM(loaded, block_size=bs, num_blocks=256).generate(turn2, GREEDY)[0]
    assert warm.token_ids == cold.token_ids
