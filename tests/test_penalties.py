"""Logit bias and the presence / frequency / repetition penalties: the batched implementation
against a plain per-row, per-token restatement of the rules, on random logits and histories."""
from __future__ import annotations

import random

import pytest
import torch

from spanserve.engine.params import SamplingParams
from spanserve.engine.penalties import apply_penalties
from spanserve.engine.sampling import Sampler

VOCAB = 50


def reference_row(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    """One row, one token at a time, in the documented order: bias, repetition, frequency/presence."""
    x = list(logits)
    for tok, b in (p.logit_bias or {}).items():
        x[tok] += b
    seen = set(prompt) | set(output)
    for t in range(len(x)):
        if t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in range(len(x)):
        c = output.count(t)
        x[t] -= p.frequency_penalty * c + (p.presence_penalty if c > 0 else 0.0)
    return x


def random_params(rng: random.Random) -> SamplingParams:
    kind = rng.randrange(5)
    if kind == 0:
        return SamplingParams()  # untouched row in a processed batch
    return SamplingParams(
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
        logit_bias=rng.choice([None, {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 5))}]),
    )


@pytest.mark.parametrize("seed", range(6))
def test_batched_matches_per_row_reference(seed: int) -> None:
    rng = random.Random(seed)
    batch = rng.randrange(1, 9)
    params = [random_params(rng) for _ in range(batch)]
    hist = [([rng.randrange(VOCAB) for _ in range(rng.randrange(0, 20))],
             [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 30))]) for _ in range(batch)]
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4
    before = logits.clone()
    got = apply_penalties(logits, params, hist)
    want = torch.tensor([reference_row(logits[i].tolist(), params[i], *hist[i]) for i in range(batch)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert torch.equal(logits, before)  # the raw logits (logprobs are reported from them) are kept


def test_no_processing_returns_the_same_tensor() -> None:
    logits = torch.randn(3, VOCAB)
    assert apply_penalties(logits, [SamplingParams()] * 3, [([1], [2])] * 3) is logits


def test_sampler_applies_them_and_reports_raw_logprobs() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 5.0
    params = [SamplingParams(temperature=0, logit_bias={3: 100}, logprobs=0),
              SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=0)]
    # row 1 has generated token 7 four times: 5 - 2*4 < 0, so 7 loses to the zeros
    tokens, lps = Sampler()(logits, params, [None, None], histories=[([], []), ([], [7, 7, 7, 7])])
    assert tokens[0] == 3 and tokens[1] != 7
    raw = torch.log_softmax(logits[0], dim=-1)
    assert lps[0] is not None and lps[0].logprob == pytest.approx(float(raw[3]))
    # without histories the bias still applies and nothing has been generated to penalise
    assert Sampler()(logits, params, [None, None])[0] == [3, 7]


def test_bias_bans_and_forces_when_sampling() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    banned = int(logits[0].argmax())
    params = [SamplingParams(temperature=1.0, seed=s, logit_bias={banned: -100, 11: 100}) for s in range(4)]
    tokens, _ = Sampler()(logits, params, [torch.Generator().manual_seed(s) for s in range(4)], histories=[([], [])] * 4)
    assert tokens == [11] * 4


@pytest.mark.parametrize("kwargs, message", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {5: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"response_format": "json"}, "response_format"),
])
def test_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
