"""Selective recomputation against the dense oracle, cold and warm, on random layouts."""
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from spanserve import LLM, SamplingParams, Segment
from spanserve.engine.layout import resolve
from spanserve.model.loader import load_model
from spanserve.reuse.policies import FULL, NONE, CacheBlend, Sinks, SparseQ, resolve_policy
from dense_reference import Dense, policy_logits
from engine_helpers import make_engine
from span_helpers import assert_cold_and_warm, run_all
from test_span_layouts import layouts
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("pol"), layers=4)
    loaded = load_model(str(path))
    return loaded, Dense(loaded.config, loaded.weights)


sink_k = st.sampled_from([0, 0, 1, 4])
policies = st.one_of(
    st.builds(CacheBlend, ratio=st.sampled_from([0.0, 0.15, 0.5, 1.0]), check_layer=st.sampled_from([None, 1, 2, 3]),
              sink_tokens=sink_k),
    st.builds(SparseQ, budget=st.sampled_from([0.05, 0.15, 0.3]), boundary=st.sampled_from([None, 0, 1, 2]),
              overflow_blocks=st.integers(0, 1), tail=st.sampled_from([0, 8]), sink_tokens=sink_k),
    st.builds(SparseQ, k=st.integers(0, 20), boundary=st.sampled_from([0, 2]), sink_tokens=sink_k),
    st.builds(Sinks, sink_tokens=st.integers(0, 5)),
)
SINK = (1, 2)  # a stand-in for the model's sink prefix (BOS + chat template opening)


@st.composite
def sink_layouts(draw):
    """Random layouts that begin with SINK, some plus segments anchored on it."""
    segs = draw(layouts(vocab=256))
    head = Segment(token_ids=list(SINK) + list(segs[0].token_ids)) if segs[0].kind == "cross" else Segment(token_ids=list(SINK))
    rest = segs[1:] if segs[0].kind == "cross" else segs
    rest = [Segment(token_ids=s.token_ids, kind="plus", anchor=draw(st.sampled_from(["sink", "none", "prefix"])))
            if s.kind == "plus" else s for s in rest]
    return [head] + rest


def reference(dense, segs, policy, bs):
    pieces = resolve(segs, None, policy.name, sink=SINK)
    return policy_logits(dense, pieces, policy, bs) if policy.selective else dense.span_logits(pieces)


@pytest.mark.parametrize("bs", [4, 16])
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(segs=sink_layouts(), policy=st.one_of(policies, st.just(NONE), st.just(FULL)))
def test_sink_anchor_and_sink_tokens_match_dense_cold_and_warm(tiny, bs, segs, policy):
    loaded, dense = tiny
    engine = make_engine(loaded, block_size=bs, num_blocks=2048, sink_prefix=SINK)
    ref = reference(dense, segs, policy, bs)
    assert_cold_and_warm(engine, segs, ref, policy)


def test_sink_anchored_segment_is_one_copy_across_requests(tiny):
    """Two requests with different instructions share a sink-anchored document's blocks (a
    prefix-anchored one would be encoded twice)."""
    loaded, _ = tiny
    engine = make_engine(loaded, block_size=4, num_blocks=512, sink_prefix=SINK)
    doc = Segment(token_ids=list(range(10, 50)), kind="plus", anchor="sink")
    a = [Segment(token_ids=list(SINK) + [5, 6, 7]), doc, Segment(token_ids=[8, 9])]
    b = [Segment(token_ids=list(SINK) + [11, 12, 13, 14, 15]), doc, Segment(token_ids=[8, 9])]
    run_all(engine, [a])
    assert engine.counters["segment"] == 0
    run_all(engine, [b])
    assert engine.counters["segment"] == 40


def test_sink_anchor_needs_the_sink_prefix(tiny):
    loaded, _ = tiny
    engine = make_engine(loaded, block_size=4, num_blocks=64, sink_prefix=SINK)
    bad = [Segment(token_ids=[5, 6]), Segment(token_ids=[7, 8], kind="plus", anchor="sink"), Segment(token_ids=[9])]
    with pytest.raises(ValueError, match="sink prefix"):
        engine.add_request(bad)
    bare = make_engine(loaded, block_size=4, num_blocks=64, sink_prefix=())
    with pytest.raises(ValueError, match="no sink prefix"):
        bare.add_request([Segment(token_ids=[5]), Segment(token_ids=[7], kind="plus", anchor="sink"), Segment(token_ids=[9])])
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.requests


@pytest.mark.parametrize("bs", [4, 16])
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(segs=layouts(vocab=256), policy=policies)
def test_policies_match_dense_cold_and_warm(tiny, bs, segs, policy):
    loaded, dense = tiny
    engine = make_engine(loaded, block_size=bs, num_blocks=2048)
    ref = policy_logits(dense, resolve(segs, None, "none"), policy, bs)
    assert_cold_and_warm(engine, segs, ref, policy)


def test_names_and_objects_resolve():
    assert resolve_policy("cacheblend") == CacheBlend()
    assert resolve_policy(SparseQ(k=3)).k == 3
    with pytest.raises(ValueError, match="ratio"):
        CacheBlend(ratio=2)
    with pytest.raises(ValueError, match="check_layer"):
        CacheBlend(check_layer=0)
    with pytest.raises(ValueError, match="budget"):
        SparseQ(budget=None)
    with pytest.raises(ValueError, match="sink_tokens"):
        SparseQ(sink_tokens=-1)
    assert resolve_policy("sinks") == Sinks(sink_tokens=4)


def test_question_change_recomputes_at_most_budget_overflow_and_tail(tiny):
    loaded, _ = tiny
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(3, 256, (40,), generator=g).tolist() for _ in range(4)]
    llm = LLM(loaded, block_size=4, num_blocks=1024)
    pol = SparseQ(budget=0.15, boundary=1, overflow_blocks=1, tail=64)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def ask(q):
        return [Segment(token_ids=[5, 6, 7])] + [Segment(token_ids=d, kind="plus") for d in docs] + [Segment(token_ids=q)]

    llm.generate(ask([9, 10, 11]), params, policy=pol)
    out = llm.generate(ask([12, 13, 14, 15]), params, policy=pol)[0]
    assert out.metrics["reuse"]["segment"] == 160
    r = out.metrics["recompute"]
    # top 15% of 160, plus one block on each side of the two non-reused intervals (prefix, question)
    assert r["reused"] == 160 and r["selected"] <= round(0.15 * 160) + 2 * 4
