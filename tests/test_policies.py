"""Selective recomputation against the dense oracle, cold and warm, on random layouts."""
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from spanserve import LLM, SamplingParams, Segment
from spanserve.engine.engine import LLMEngine
from spanserve.engine.layout import resolve
from spanserve.model.loader import load_model
from spanserve.reuse.policies import CacheBlend, SparseQ, resolve_policy
from dense_reference import Dense, policy_logits
from span_helpers import capture_logits, run_all
from test_span_layouts import layouts
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("pol"), layers=4)
    loaded = load_model(str(path))
    return loaded, Dense(loaded.config, loaded.weights)


policies = st.one_of(
    st.builds(CacheBlend, ratio=st.sampled_from([0.0, 0.15, 0.5, 1.0]), check_layer=st.integers(1, 3)),
    st.builds(SparseQ, budget=st.sampled_from([0.05, 0.15, 0.3]), boundary=st.sampled_from([None, 0, 1, 2]),
              overflow_blocks=st.integers(0, 1), tail=st.sampled_from([0, 8])),
    st.builds(SparseQ, k=st.integers(0, 20), boundary=st.sampled_from([0, 2])),
)


@pytest.mark.parametrize("bs", [4, 16])
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(segs=layouts(vocab=256), policy=policies)
def test_policies_match_dense_cold_and_warm(tiny, bs, segs, policy):
    loaded, dense = tiny
    engine = LLMEngine(loaded, block_size=bs, num_blocks=2048)
    ref = policy_logits(dense, resolve(segs, None, "none"), policy, bs)
    seen = capture_logits(engine)
    cold, warm = run_all(engine, [segs], policy=policy) + run_all(engine, [segs], policy=policy)
    for rid in (cold, warm):
        torch.testing.assert_close(seen[rid].double(), ref, rtol=0, atol=1e-4)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_names_and_objects_resolve():
    assert resolve_policy("cacheblend") == CacheBlend()
    assert resolve_policy(SparseQ(k=3)).k == 3
    with pytest.raises(ValueError, match="ratio"):
        CacheBlend(ratio=2)
    with pytest.raises(ValueError, match="check_layer"):
        CacheBlend(check_layer=0)
    with pytest.raises(ValueError, match="budget"):
        SparseQ(budget=None)


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
