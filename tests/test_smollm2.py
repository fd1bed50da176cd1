"""The real default model: greedy output and logits equal Hugging Face transformers'."""
import pytest
import torch
import transformers

from spanserve import LLM, SamplingParams
from spanserve.engine.batch import prepare
from spanserve.model.loader import resolve_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Alice has 3 apples and Bob has 5. Together they have",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nName a primary color.<|im_end|>\n<|im_start|>assistant\n",
]
N_NEW = 16  # every prompt's generation still crosses a 16-token block
ALONE = (0, 4)  # the shortest prompt and the chat-template one, each also run alone


@pytest.fixture(scope="module")
def hf_and_llm():
    path = resolve_model("smollm2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    llm = LLM("smollm2", block_size=16)
    return hf, llm


def test_greedy_equals_transformers_batched_and_alone(hf_and_llm):
    hf, llm = hf_and_llm
    params = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    prompts = [llm.engine.encode(p) for p in PROMPTS]
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False, eos_token_id=None, pad_token_id=2)
        refs.append(out[0, len(p):].tolist())
    batched = llm.generate(prompts, params)
    assert [o.token_ids for o in batched] == refs
    alone = [llm.generate(prompts[i], params)[0].token_ids for i in ALONE]
    assert alone == [refs[i] for i in ALONE]


def test_final_logits_within_1e_3(hf_and_llm):
    hf, llm = hf_and_llm
    eng = llm.engine
    for text in PROMPTS[:3]:
        ids = eng.encode(text)
        eng.add_request(ids, SamplingParams(max_tokens=1), request_id=f"logits-{text[:8]}")
        sched = eng.scheduler.schedule()
        out = eng.executor.run(prepare(sched.chunks, eng.executor.graph_limits))
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1]
        assert (out.logits[out.rows[-1]] - ref).abs().max().item() < 1e-3
        eng.abort(f"logits-{text[:8]}")
