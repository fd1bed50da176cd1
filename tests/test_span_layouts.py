"""Span layouts against the dense oracle, over random layouts and cache states."""
import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from spanserve import Segment
from spanserve.engine.layout import resolve
from spanserve.model.loader import load_model
from dense_reference import Dense
from engine_helpers import make_engine
from span_helpers import capture_logits, run_all
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("span"))
    loaded = load_model(str(path))
    return loaded, Dense(loaded.config, loaded.weights)


def _engine(loaded, bs, num_blocks=4096):
    return make_engine(loaded, block_size=bs, num_blocks=num_blocks)


@st.composite
def layouts(draw, vocab=384):
    n = draw(st.integers(1, 12))
    segs = []
    for i in range(n):
        last = i == n - 1
        kind = "cross" if last else draw(st.sampled_from(["cross", "plus"]))
        length = draw(st.integers(1, 70))
        toks = draw(st.lists(st.integers(3, vocab - 1), min_size=length, max_size=length))
        anchor = draw(st.sampled_from(["none", "prefix"])) if kind == "plus" else "none"
        segs.append(Segment(token_ids=toks, kind=kind, anchor=anchor))
    if segs[0].kind == "plus":  # anchor="prefix" needs a leading cross segment
        segs = [s if s.kind == "cross" else Segment(token_ids=s.token_ids, kind="plus") for s in segs]
    return segs


def _check(engine, dense, prompts, state="cold"):
    seen = capture_logits(engine)
    ids = run_all(engine, prompts)
    for rid, segs in zip(ids, prompts):
        ref = dense.span_logits(resolve(segs, None, "none"))
        torch.testing.assert_close(seen[rid].double(), ref, rtol=0, atol=1e-4, msg=lambda m: f"{state}: {m}")


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck),
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])


@pytest.mark.parametrize("bs", [4, 16])
@SETTINGS
@given(segs=layouts(), seed=st.integers(0, 2**16))
def test_engine_matches_dense_cold_warm_and_half_evicted(tiny, bs, segs, seed):
    loaded, dense = tiny
    engine = _engine(loaded, bs)
    _check(engine, dense, [segs], "cold")
    _check(engine, dense, [segs], "warm")
    cached = [b for b in engine.pool.free_blocks() if b.key is not None]
    for b in random.Random(seed).sample(cached, len(cached) // 2):
        engine.pool.evict(b)
    _check(engine, dense, [segs], "half-evicted")
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("bs", [4, 16])
@SETTINGS
@given(doc=st.lists(st.integers(3, 383), min_size=1, max_size=70), a=layouts(), b=layouts(),
       warm=st.booleans())
def test_one_cached_segment_at_two_positions_in_one_batch(tiny, bs, doc, a, b, warm):
    loaded, dense = tiny
    engine = _engine(loaded, bs)
    shared = Segment(token_ids=doc, kind="plus")
    pa = a[:-1] + [shared] + a[-1:]
    pb = b[:-1] + [shared, shared] + b[-1:]
    if warm:
        _check(engine, dense, [[shared, Segment(token_ids=[5])]])
    before = engine.counters["segment"]
    _check(engine, dense, [pa, pb])
    if warm:  # every placement read the one cached copy
        assert engine.counters["segment"] - before >= 3 * len(doc)
    assert engine.pool.num_free == engine.pool.num_blocks
