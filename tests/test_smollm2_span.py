"""On the real model, a RAG layout's output never depends on what happened to be cached."""
import pytest

from spanserve import LLM, SamplingParams, Segment
from spanserve.model.loader import load_model

SYSTEM = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
DOCS = [
    "The red box holds 17 coins and sits on the top shelf of the old wooden cabinet.\n",
    "The blue box holds 42 coins; it was found in the garden behind the house last spring.\n",
    "The green box holds 8 coins. Nobody knows who left it in the kitchen drawer.\n",
    "The yellow box holds 91 coins and belongs to the neighbour who collects rare stamps.\n",
]
QUESTION = "How many coins does the blue box hold? Answer with the number only.<|im_end|>\n<|im_start|>assistant\n"
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def layout(order):
    return [Segment(text=SYSTEM)] + [Segment(text=DOCS[i], kind="plus") for i in order] + [Segment(text=QUESTION)]


@pytest.fixture(scope="module")
def model():
    return load_model("smollm2")


def test_rag_output_is_invariant_to_cache_state(model):
    cold = LLM(model).generate(layout([0, 1, 2, 3]), PARAMS)[0]
    assert cold.metrics["reuse"]["segment"] == 0

    llm = LLM(model)
    llm.generate(layout([0, 1, 2, 3]), PARAMS)
    warm = llm.generate(layout([0, 1, 2, 3]), PARAMS)[0]
    assert warm.metrics["reuse"]["computed"] <= 16  # at most the prompt's partial last block

    other = LLM(model)
    other.generate(layout([3, 1, 0, 2]), PARAMS)  # same documents, another order
    reordered = other.generate(layout([0, 1, 2, 3]), PARAMS)[0]
    assert reordered.metrics["reuse"]["segment"] == sum(len(other.engine.encode(d)) for d in DOCS)

    tight = LLM(model, num_blocks=24)  # 384 tokens: a filler prompt evicts part of the layout
    tight.generate(layout([0, 1, 2, 3]), PARAMS)
    tight.generate("Filler text to push blocks out of the cache. " * 20, SamplingParams(max_tokens=1))
    shrunk = tight.generate(layout([0, 1, 2, 3]), PARAMS)[0]
    r = shrunk.metrics["reuse"]
    assert 0 < r["prefix"] + r["segment"] + r["perforated"] and r["computed"] > 1

    assert warm.token_ids == cold.token_ids
    assert reordered.token_ids == cold.token_ids
    assert shrunk.token_ids == cold.token_ids


def test_full_policy_equals_plain_prompt_on_smollm2(model):
    llm = LLM(model)
    lay = layout([2, 0, 3, 1])
    plain_ids = [t for s in lay for t in llm.engine.encode(s.text)]
    plain = llm.generate(plain_ids, PARAMS)[0]
    fresh = LLM(model)
    full = fresh.generate(lay, PARAMS, policy="full")[0]
    assert full.token_ids == plain.token_ids
