from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from spanserve.engine import sampling
from spanserve.engine.params import SamplingParams
from spanserve.engine.sampling import Sampler, TokenLogprobs, filtered_probs, make_generator

# Margin kept between any filter decision and its cut-off in the property test:
# the reference decides in float64, the sampler in float32.
EPS = 1e-5


def _normalize(w: list[float]) -> list[float]:
    total = sum(w)
    return [x / total for x in w]


def reference_probs(logits: list[float], p: SamplingParams, margins: list[float]) -> list[float]:
    """Plain float64 restatement of the filtering rules, one token at a time.

    Appends to `margins` how far each top-p / min-p decision was from its cut-off.
    """
    n = len(logits)
    if p.greedy:
        best = max(range(n), key=lambda i: (logits[i], -i))  # first of tied maxima
        return [1.0 if i == best else 0.0 for i in range(n)]

    keep = [True] * n
    if 0 < p.top_k < n:
        kth = sorted(logits, reverse=True)[p.top_k - 1]
        keep = [x >= kth for x in logits]

    scaled = [x / p.temperature for x in logits]
    hi = max(s for s, k in zip(scaled, keep) if k)
    probs = _normalize([math.exp(s - hi) if k else 0.0 for s, k in zip(scaled, keep)])

    if p.top_p < 1.0:
        new_keep = []
        for i in range(n):
            mass_above = sum(q for q in probs if q > probs[i])
            if keep[i]:
                margins.append(abs(mass_above - p.top_p))
            new_keep.append(keep[i] and mass_above < p.top_p)
        keep = new_keep
        probs = _normalize([q if k else 0.0 for q, k in zip(probs, keep)])

    if p.min_p > 0.0:
        cut = p.min_p * max(probs)
        for i in range(n):
            if keep[i]:
                margins.append(abs(probs[i] - cut))
            keep[i] = keep[i] and probs[i] >= cut
        probs = _normalize([q if k else 0.0 for q, k in zip(probs, keep)])

    return probs


# Logits on a 0.25 grid: ties are common (exercising tie handling) and distinct
# values are far enough apart that float32 and float64 agree on their order.
grid_logits = st.lists(st.integers(-40, 40).map(lambda i: i / 4), min_size=1, max_size=10)


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    return SamplingParams(
        temperature=draw(st.floats(0.5, 2.0)),
        top_k=draw(st.integers(-1, 12)),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.0, 1.0, exclude_min=True))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
    )


# () sorts whole rows at once; tiny candidate lists force the escalation path.
@pytest.mark.parametrize("candidates", [(), (1,), (2, 5), (1024, 8192)])
@given(logits=grid_logits, params=sampling_params())
@settings(max_examples=150, deadline=None)
def test_filtered_probs_match_reference(
    candidates: tuple[int, ...], logits: list[float], params: SamplingParams
) -> None:
    margins: list[float] = []
    want = reference_probs(logits, params, margins)
    assume(all(m > EPS for m in margins))

    with mock.patch.object(sampling, "_TOP_P_CANDIDATES", candidates):
        got = filtered_probs(torch.tensor(logits, dtype=torch.float32), params)

    assert got.dtype == torch.float32
    assert [g > 0 for g in got.tolist()] == [w > 0 for w in want]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), atol=1e-5, rtol=1e-4)


def _support(probs: torch.Tensor) -> list[int]:
    return (probs > 0).nonzero()[:, 0].tolist()


def test_filter_examples() -> None:
    # log of these probabilities as logits, so filters act on known numbers.
    dist = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()

    # top-k keeps every token tied with the k-th.
    assert _support(filtered_probs(torch.tensor([3.0, 2.0, 2.0, 1.0]), SamplingParams(top_k=2))) == [0, 1, 2]
    assert _support(filtered_probs(dist, SamplingParams(top_k=3))) == [0, 1, 2]
    # top-k >= vocab and -1 both mean off.
    assert _support(filtered_probs(dist, SamplingParams(top_k=9))) == [0, 1, 2, 3]
    assert _support(filtered_probs(dist, SamplingParams(top_k=-1))) == [0, 1, 2, 3]

    # top-p: smallest head whose mass reaches top_p.
    torch.testing.assert_close(
        filtered_probs(dist, SamplingParams(top_p=0.75)), torch.tensor([0.625, 0.375, 0.0, 0.0])
    )
    assert _support(filtered_probs(dist, SamplingParams(top_p=0.85))) == [0, 1, 2]
    # The top token survives any top_p.
    assert _support(filtered_probs(dist, SamplingParams(top_p=1e-9))) == [0]
    # Ties at the top-p cut are kept together.
    assert _support(filtered_probs(torch.zeros(4), SamplingParams(top_p=0.3))) == [0, 1, 2, 3]

    # min-p: drop tokens below min_p * max prob (0.1 here).
    torch.testing.assert_close(
        filtered_probs(dist, SamplingParams(min_p=0.2)), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    )
    assert _support(filtered_probs(dist, SamplingParams(min_p=1.0))) == [0]

    # Combined, in order: top-k 3 -> [.5, .3, .15]/.95; top-p .8 keeps 2; min-p no-op.
    assert _support(filtered_probs(dist, SamplingParams(top_k=3, top_p=0.8, min_p=0.1))) == [0, 1]

    # Temperature reshapes before top-p: at T=0.5 the head is [.66, .24, .06, .006].
    assert _support(filtered_probs(dist, SamplingParams(temperature=0.5, top_p=0.85))) == [0, 1]


def test_greedy_is_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 300, generator=gen)
    params = [
        SamplingParams(temperature=0.0) if i % 3 == 0
        else SamplingParams(top_k=1, temperature=1.5) if i % 3 == 1
        else SamplingParams(top_p=0.9)
        for i in range(12)
    ]
    assert [p.greedy for p in params[:3]] == [True, True, False]
    gens = [make_generator(i) for i in range(12)]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tokens, _ = Sampler()(logits.to(dtype), params, gens)
        want = logits.to(dtype).float().argmax(dim=-1).tolist()
        assert [t for t, p in zip(tokens, params) if p.greedy] == [
            w for w, p in zip(want, params) if p.greedy
        ]
    one_hot = filtered_probs(logits[0], SamplingParams(temperature=0.0))
    assert one_hot.tolist() == torch.nn.functional.one_hot(logits[0].argmax(), 300).float().tolist()


TARGET = SamplingParams(temperature=0.8, top_k=200, top_p=0.95, min_p=0.01, seed=1234)
VOCAB = 500
STEPS = 6


def _step_logits(step: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(100 + step)) * 2


def _run_target(position: int, others: list[SamplingParams], seed: int = 1234) -> list[int]:
    """Sample STEPS tokens for TARGET at `position` among `others`; returns TARGET's tokens."""
    params = list(others)
    params.insert(position, TARGET)
    gens = [make_generator(p.seed) for p in params]
    gens[position] = make_generator(seed)
    noise = torch.Generator().manual_seed(len(others) * 31 + position)
    out = []
    for step in range(STEPS):
        logits = torch.randn(len(params), VOCAB, generator=noise) * 3
        logits[position] = _step_logits(step)
        tokens, _ = Sampler()(logits, params, gens)
        out.append(tokens[position])
    return out


other_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_k=st.sampled_from([0, 5, 1000]),
    top_p=st.sampled_from([1.0, 0.5]),
    seed=st.one_of(st.none(), st.integers(0, 10)),
)


@given(others=st.lists(other_params, max_size=7), data=st.data())
@settings(max_examples=25, deadline=None)
def test_seeded_row_independent_of_batch(others: list[SamplingParams], data: st.DataObject) -> None:
    alone = _run_target(0, [])
    position = data.draw(st.integers(0, len(others)))
    assert _run_target(position, others) == alone


def test_seeds_and_twins() -> None:
    alone = _run_target(0, [])
    assert _run_target(0, [], seed=1235) != alone
    # Two rows with the same seed and logits in one batch draw the same tokens.
    logits = _step_logits(0).repeat(2, 1)
    tokens, _ = Sampler()(logits, [TARGET, TARGET], [make_generator(7), make_generator(7)])
    assert tokens[0] == tokens[1]
    assert make_generator(None) is None
    a, b = make_generator(5), make_generator(5)
    assert a is not None and b is not None
    assert torch.equal(a.get_state(), b.get_state())


FREQ_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -2.0, -4.0])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=1.6, min_p=0.02),
    ],
)
@pytest.mark.parametrize("seeded", [True, False])
def test_empirical_frequencies(params: SamplingParams, seeded: bool) -> None:
    n = 40_000
    probs = filtered_probs(FREQ_LOGITS, params).double()
    logits = FREQ_LOGITS.repeat(n, 1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        # One shared generator: each row draws in turn from the same stream.
        gens = [make_generator(0)] * n if seeded else [None] * n
        tokens, _ = Sampler()(logits, [params] * n, gens)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(FREQ_LOGITS)).double()

    support = probs > 0
    assert counts[~support].sum() == 0  # filtered-out tokens never appear
    expected = probs[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    # Deterministic seeds, so this never flakes; a real bias of ~1% shows up in the
    # hundreds, far above this bound.
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 5, (chi2, counts / n, probs)
    assert float((counts / n - probs).abs().max()) < 0.01


def test_logprobs() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 50
    logits = torch.randn(6, vocab, generator=gen) * 2
    params = [
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0, temperature=0.3),
        SamplingParams(logprobs=3, top_k=5),
        SamplingParams(logprobs=20, temperature=0.0),
        SamplingParams(logprobs=1, top_p=0.5, temperature=2.0),
        SamplingParams(logprobs=5, min_p=0.5),
    ]
    tokens, lps = Sampler()(logits, params, [make_generator(i) for i in range(6)])
    # Raw logits: temperature and filters must not change the reported numbers.
    ref = torch.log_softmax(logits.double(), dim=-1)

    assert lps[0] is None
    for i in range(1, 6):
        lp = lps[i]
        assert isinstance(lp, TokenLogprobs)
        n = params[i].logprobs
        assert n is not None
        assert lp.token_id == tokens[i]
        assert lp.logprob == pytest.approx(float(ref[i, tokens[i]]), abs=1e-5)
        order = ref[i].argsort(descending=True).tolist()
        assert list(lp.top) == order[:n]  # the right ids, highest first
        values = list(lp.top.values())
        assert values == sorted(values, reverse=True)
        for tok, v in lp.top.items():
            assert v == pytest.approx(float(ref[i, tok]), abs=1e-5)
        assert (tokens[i] in lp.top) == (order.index(tokens[i]) < n)
    assert lps[1] is not None and lps[1].top == {}
    assert lps[3] is not None and tokens[3] in lps[3].top  # greedy picks the top one

    # Asking for more alternatives than the vocabulary has returns all of them.
    _, small = Sampler()(torch.randn(1, 4), [SamplingParams(logprobs=20)], [None])
    assert small[0] is not None and len(small[0].top) == 4


def test_extreme_logits() -> None:
    inf = float("inf")
    logits = torch.tensor(
        [
            [-inf, 1e4, -inf, 9999.0],
            [-inf, -inf, 5.0, -inf],
            [3e38, 3e38, -3e38, 0.0],
        ]
    )
    params = [
        SamplingParams(temperature=1e-3, top_p=0.5),
        SamplingParams(top_k=3, min_p=0.9, logprobs=2),
        SamplingParams(temperature=0.01, top_k=2),
    ]
    for seed in range(20):
        tokens, lps = Sampler()(logits, params, [make_generator(seed)] * 3)
        assert tokens[0] == 1 and tokens[1] == 2 and tokens[2] in (0, 1)
        assert lps[1] is not None and lps[1].logprob == 0.0
    for row, p in zip(logits, params):
        assert not filtered_probs(row, p).isnan().any()


BAD_PARAMS = [
    (dict(max_tokens=0), r"max_tokens must be an int >= 1, got 0"),
    (dict(temperature=-0.5), r"temperature must be .* got -0.5; use 0 for greedy"),
    (dict(temperature=float("nan")), r"temperature must be"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5; use 1.0 to disable nucleus sampling"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_k=-2), r"top_k must be an int >= -1, got -2; use 0 or -1 to disable"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\], got -0.1; use 0.0 to disable"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
    (dict(logprobs=-1), r"logprobs must be an int in \[0, 20\] or None, got -1"),
    (dict(logprobs=21), r"logprobs must be .* got 21; use 0 for only the chosen"),
    (dict(stop_token_ids=["2"]), r"stop_token_ids must be non-negative ints, got '2' \(str\) at index 0"),
    (dict(stop_token_ids=[1, 2.0]), r"got 2.0 \(float\) at index 1"),
    (dict(stop_token_ids=[True]), r"stop_token_ids must be non-negative ints"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids must be non-negative ints, got -1"),
    (dict(stop=["ok", ""]), r"stop strings must be non-empty, got '' at index 1; remove it"),
    (dict(stop=""), r"stop strings must be non-empty"),
    (dict(stop=["ok", 3]), r"stop must be a string or a list of strings, got 3 \(int\) at index 1"),
    (dict(seed="42"), r"seed must be an int or None"),
]


@pytest.mark.parametrize("kwargs, message", BAD_PARAMS)
def test_validation_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_valid_params_and_normalization() -> None:
    p = SamplingParams()
    assert (p.stop, p.stop_token_ids, p.greedy) == ([], [], False)
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]
    assert SamplingParams(stop=None).stop == []  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]  # type: ignore[arg-type]
    for ok in [
        dict(top_k=-1), dict(top_k=0), dict(top_p=1.0), dict(min_p=0.0), dict(min_p=1.0),
        dict(logprobs=0), dict(logprobs=20), dict(temperature=0.0), dict(seed=-3),
    ]:
        SamplingParams(**ok)  # type: ignore[arg-type]
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(top_k=1).greedy


def test_sampler_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="one of each per row"):
        Sampler()(torch.zeros(2, 4), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
        Sampler()(torch.zeros(4), [SamplingParams()], [None])


def test_uniforms_seeded_rows_own_stream_unseeded_rows_one_global_fill() -> None:
    """Reference: a seeded row is its generator's first V uniforms; the unseeded rows, in order,
    are one fill of the global RNG (seeded rows draw nothing from it)."""
    from spanserve.engine.sampling import _uniforms

    v = 37
    for pattern in ("all-none", "all-seeded", "mixed"):
        seeds = [None] * 6 if pattern == "all-none" else list(range(6)) if pattern == "all-seeded" \
            else [None, 3, None, None, 8, None]
        with torch.random.fork_rng():
            torch.manual_seed(11)
            got = _uniforms(torch.Size((6, v)), torch.device("cpu"), [make_generator(s) for s in seeds])
            torch.manual_seed(11)
            free = [i for i, s in enumerate(seeds) if s is None]
            want_free = torch.empty((len(free), v), dtype=torch.float64).uniform_()
        assert got.dtype == torch.float64 and got.shape == (6, v)
        for i, s in enumerate(seeds):
            if s is not None:
                want = torch.empty(v, dtype=torch.float64).uniform_(generator=make_generator(s))
                assert torch.equal(got[i], want)
        assert torch.equal(got[free], want_free)


def test_argmax_rows_picks_the_first_maximum_as_argmax_does():
    from spanserve.engine.sampling import argmax_rows

    g = torch.Generator().manual_seed(0)
    for V in (128256, 49152, 1000, 97):  # 97: prime, no even cut (plain argmax)
        for B in (1, 3, 9):
            x = torch.randint(-3, 4, (B, V), generator=g).float()  # many ties at the maximum
            assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
            x = torch.randn(B, V, generator=g)
            assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
