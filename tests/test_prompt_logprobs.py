"""Prompt logprobs and penalties in the engine, on a tiny random model, against transformers'
own forward pass (prompt logprobs) and a per-step re-run of the rules (penalties)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spanserve import LLM, SamplingParams
from spanserve.engine.layout import Segment
from spanserve.engine.penalties import apply_penalties
from tiny_models import make_tiny_model

PROMPT = [5, 9, 33, 120, 7, 7, 301, 44, 18, 250, 3, 99, 64, 12, 200, 150, 6, 81, 90, 17]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, torch.nn.Module]:
    path, hf = make_tiny_model("llama", tmp_path_factory.mktemp("plp"))
    # A 6-token step budget splits the prompt into chunked prefills.
    return LLM(str(path), num_blocks=64, block_size=4, max_num_batched_tokens=6), hf


def hf_logprobs(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_prompt_logprobs_match_transformers_cold_and_cached(tiny: tuple[LLM, torch.nn.Module]) -> None:
    llm, hf = tiny
    ref = hf_logprobs(hf, PROMPT)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    for _ in range(2):  # the second run would be a full cache hit without the reuse bypass
        out = llm.generate(PROMPT, params)[0]
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(PROMPT) and plp[0] is None
        for i in range(1, len(PROMPT)):
            e = plp[i]
            assert e is not None and e.token_id == PROMPT[i]
            assert e.logprob == pytest.approx(float(ref[i - 1, PROMPT[i]]), abs=1e-4)
            assert e.rank == int((ref[i - 1] > ref[i - 1, PROMPT[i]]).sum()) + 1
            top = torch.topk(ref[i - 1], 3)
            assert list(e.top) == top.indices.tolist()
            assert list(e.top.values()) == pytest.approx(top.values.tolist(), abs=1e-4)
    # requests not asking for them get none, and still hit the cache
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.prompt_logprobs is None and plain.metrics["cached_tokens"] > 0
    assert plain.token_ids == out.token_ids


def test_prompt_logprobs_refused_for_span_layouts(tiny: tuple[LLM, torch.nn.Module]) -> None:
    llm, _ = tiny
    layout = [Segment(token_ids=[5, 6, 7], kind="plus"), Segment(token_ids=[8, 9])]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate(layout, SamplingParams(max_tokens=1, prompt_logprobs=0))


def test_logit_bias_outside_vocab_is_refused(tiny: tuple[LLM, torch.nn.Module]) -> None:
    llm, _ = tiny
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate(PROMPT, SamplingParams(max_tokens=1, logit_bias={10**6: 1.0}))


def test_penalised_greedy_decode_matches_stepwise_reference(tiny: tuple[LLM, torch.nn.Module]) -> None:
    """Greedy decoding under penalties: each token is the argmax of the penalised transformers
    logits given everything generated before it."""
    llm, hf = tiny
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=3.0,
                            frequency_penalty=2.0, presence_penalty=1.5, logit_bias={17: 2.0, 207: -3.0})
    got = llm.generate(PROMPT, params)[0].token_ids
    ids: list[int] = []
    for _ in range(8):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + ids])).logits[0, -1:].float()
        ids.append(int(apply_penalties(logits, [params], [(PROMPT, ids)])[0].argmax()))
    assert got == ids
    # and the penalties change something here, or the comparison would prove little
    assert llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids != ids
