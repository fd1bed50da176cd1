"""Two Llama-3-8B-shaped engines built one after the other in one process: shutting the first
down gives its device memory back (KV pool, CUDA graphs, weights), so the second, sized by the
default rule (80% of the free memory), gets the same KV pool. A notebook that builds a second
`LLM` depends on this."""
from __future__ import annotations

import torch

from gpu_helpers import LLAMA3_8B, release
from spanserve import LLM, SamplingParams
from spanserve.model.weights import RandomWeights


def build_use_and_shut_down() -> int:
    """Blocks in the KV pool of a fresh engine with default sizing, after a short generation."""
    release()  # what earlier tests in this process left cached is not the first engine's to lose
    llm = LLM(RandomWeights(LLAMA3_8B, seed=0))
    prompt = torch.randint(3, 128000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    blocks = llm.engine.pool.num_blocks
    llm.shutdown()
    del llm, out
    release()
    return blocks


def test_second_engine_gets_the_first_engines_kv_pool():
    first = build_use_and_shut_down()
    second = build_use_and_shut_down()
    assert first > 1000, first  # tens of GiB at 2 MiB a block: the pool took the free memory
    assert abs(second - first) <= 0.02 * first, (first, second)
