"""The attention repair of parallel encoding (temperature and log scale on reused segments' scores)
against the dense oracle: every policy, cold and warm, decode steps included; identity values
change nothing; names and bad values."""
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from spanserve import SamplingParams, Segment
from spanserve.engine.layout import resolve
from spanserve.model.loader import load_model
from spanserve.reuse.policies import FULL, NONE, CacheBlend, Policy, Sinks, SparseQ, resolve_policy
from dense_reference import Dense, policy_logits
from engine_helpers import make_engine
from span_helpers import assert_cold_and_warm, capture_logits, run_all
from test_span_layouts import layouts
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("repair"), layers=4)
    loaded = load_model(str(path))
    return loaded, Dense(loaded.config, loaded.weights)


repairs = st.tuples(st.sampled_from([0.3, 0.7, 1.0, 1.6]), st.sampled_from([-1.5, 0.0, 0.4, 2.0]))
bases = st.one_of(st.just(NONE), st.builds(CacheBlend, ratio=st.sampled_from([0.15, 0.5]), sink_tokens=st.sampled_from([0, 2])),
                  st.builds(SparseQ, budget=st.sampled_from([0.05, 0.3]), boundary=st.sampled_from([0, 2])),
                  st.builds(Sinks, sink_tokens=st.integers(1, 3)))


def reference(dense, segs, policy, bs, generated=()):
    pieces = resolve(segs, None, "none")
    if policy.selective:
        return policy_logits(dense, pieces, policy, bs)
    return dense.span_logits(pieces, generated, policy.temperature, policy.log_scale)


@pytest.mark.parametrize("bs", [4, 16])
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(segs=layouts(vocab=256), base=bases, tl=repairs)
def test_repaired_policies_match_dense_cold_and_warm(tiny, bs, segs, base, tl):
    loaded, dense = tiny
    policy = replace(base, temperature=tl[0], log_scale=tl[1])
    engine = make_engine(loaded, block_size=bs, num_blocks=2048)
    ref = reference(dense, segs, policy, bs)
    assert_cold_and_warm(engine, segs, ref, policy)


def test_decode_steps_read_segments_repaired(tiny):
    """Generated tokens read the plus segments repaired too: each step's logits match the oracle
    over the prompt and the tokens generated so far."""
    loaded, dense = tiny
    policy = replace(NONE, temperature=0.5, log_scale=1.0)
    segs = [Segment(token_ids=[5, 6, 7]), Segment(token_ids=list(range(20, 45)), kind="plus"),
            Segment(token_ids=list(range(60, 77)), kind="plus"), Segment(token_ids=[9, 10])]
    engine = make_engine(loaded, block_size=4, num_blocks=512)
    req = engine.add_request(segs, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3),
                             policy=policy)
    while engine.has_unfinished():
        engine.step()
    out = req.output_token_ids
    for i, lp in enumerate(req.logprobs):
        ref = torch.log_softmax(reference(dense, segs, policy, 4, out[:i]), -1)
        assert lp.token_id == out[i]
        assert abs(lp.logprob - float(ref[out[i]])) < 1e-4


def test_identity_values_change_nothing(tiny):
    """temperature 1 and log_scale 0 give today's outputs and cache keys, bit for bit."""
    loaded, _ = tiny
    segs = [Segment(token_ids=[5, 6, 7]), Segment(token_ids=list(range(20, 45)), kind="plus"), Segment(token_ids=[9, 10])]
    outs = []
    for policy in (NONE, Policy("none", temperature=1.0, log_scale=0.0)):
        engine = make_engine(loaded, block_size=4, num_blocks=512)
        seen = capture_logits(engine)
        rid, = run_all(engine, [segs], policy=policy)
        outs.append(seen[rid])
    assert torch.equal(outs[0], outs[1])
    assert Policy("none", temperature=1.0).key == NONE.key == "Policy(name='none', sink_tokens=0)"
    assert CacheBlend(temperature=0.8).key != CacheBlend().key


def test_repair_changes_the_answer_and_the_cache_key(tiny):
    """A repaired request's own chain differs from an unrepaired one's (its KV differs); the plus
    segment's standalone copy is shared by both."""
    loaded, _ = tiny
    segs = [Segment(token_ids=[5, 6, 7]), Segment(token_ids=list(range(20, 45)), kind="plus"), Segment(token_ids=[9, 10])]
    engine = make_engine(loaded, block_size=4, num_blocks=512)
    seen = capture_logits(engine)
    a, = run_all(engine, [segs])
    b, = run_all(engine, [segs], policy=replace(NONE, temperature=0.5))
    assert not torch.allclose(seen[a], seen[b])
    assert engine.counters["segment"] == 25  # the second request reused the segment


def test_names_and_bad_values():
    for name in ("none", "cacheblend", "sparseq", "sinks"):
        p = resolve_policy(f"{name}+repair")
        assert p.name == f"{name}+repair" and type(p) is type(resolve_policy(name))
    with pytest.raises(ValueError, match="temperature"):
        Policy(temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SparseQ(temperature=float("nan"))
    with pytest.raises(ValueError, match="log_scale"):
        CacheBlend(log_scale=1e9)
    with pytest.raises(ValueError, match="full policy"):
        replace(FULL, log_scale=1.0)
    with pytest.raises(ValueError, match="unknown"):
        resolve_policy("full+repair")
