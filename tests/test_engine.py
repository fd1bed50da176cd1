"""Engine core on tiny random models: numerics against transformers, caching, preemption, errors."""
import pytest
import torch
from tiny_models import ARCHS, make_tiny_model

from spanserve import LLM, SamplingParams
from spanserve.engine.batch import prepare
from spanserve.engine.engine import LLMEngine
from spanserve.model.loader import load_model
from engine_helpers import make_engine
from tiny_models import ARCHS, make_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """arch -> (path, transformers model)"""
    d = tmp_path_factory.mktemp("tiny")
    out = {a: make_tiny_model(a, d) for a in ARCHS}
    out["llama-tied"] = make_tiny_model("llama", d, tie=True)
    return out


def _prompts(vocab, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _engine_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    engine.add_request(prompt, SamplingParams(max_tokens=1))
    sched = engine.scheduler.schedule()
    out = engine.executor.run(prepare(sched.chunks, engine.executor.graph_limits))
    return out.logits[out.rows[-1]]


@pytest.mark.parametrize("arch", list(ARCHS) + ["llama-tied"])
def test_logits_match_transformers(tiny, arch):
    path, hf = tiny[arch]
    engine = make_engine(str(path), block_size=4, num_blocks=64)
    for prompt in _prompts(hf.config.vocab_size, [1, 7, 33]):
        ours = _engine_logits(engine, prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_transformers_batched_and_chunked(tiny, arch):
    path, hf = tiny[arch]
    prompts = _prompts(hf.config.vocab_size, [5, 13, 30, 8])
    refs = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
        refs.append(out[0, len(p):].tolist())
    # a tiny token budget forces chunked prefill mixed with decodes
    llm = LLM(str(path), block_size=4, num_blocks=128, max_num_batched_tokens=7)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == refs
    single = LLM(str(path), block_size=16, num_blocks=32)
    assert [single.generate(p, GREEDY)[0].token_ids for p in prompts] == refs


def test_prefix_cache_hits_and_cache_salt_isolates(tiny):
    path, _ = tiny["llama"]
    llm = LLM(str(path), block_size=4, num_blocks=128)
    shared = _prompts(300, [40])[0]
    a = shared + [5, 6, 7]
    b = shared + [9, 10]
    first = llm.generate(b, GREEDY)[0]
    assert first.metrics["cached_tokens"] == 0
    llm.generate(a, GREEDY)
    again = llm.generate(b, GREEDY)[0]
    assert again.metrics["cached_tokens"] >= 40
    assert again.token_ids == first.token_ids
    other = llm.generate(b, GREEDY, namespace="tenant-2")[0]
    assert other.metrics["cached_tokens"] == 0
    assert other.token_ids == first.token_ids


def test_preemption_gives_identical_outputs(tiny):
    path, _ = tiny["qwen2"]
    prompts = _prompts(300, [20, 25, 18, 30, 22, 27, 19, 24], seed=3)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    roomy = LLM(str(path), block_size=4, num_blocks=512).generate(prompts, params)
    tight = LLM(str(path), block_size=4, num_blocks=40)
    outs = tight.generate(prompts, params)
    assert tight.engine.counters["preemptions"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert tight.engine.pool.num_free == 40


def test_seeded_sampling_is_reproducible_across_batches(tiny):
    path, _ = tiny["mistral"]
    llm = LLM(str(path), block_size=4, num_blocks=256)
    p = _prompts(300, [12])[0]
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate(p, sp)[0].token_ids
    others = _prompts(300, [5, 9, 17], seed=9)
    batch = llm.generate(others + [p], [SamplingParams(max_tokens=10, ignore_eos=True)] * 3 + [sp])
    assert batch[-1].token_ids == alone


def test_stop_strings_stop_ids_and_logprobs(tiny):
    path, _ = tiny["llama"]
    llm = LLM(str(path), block_size=4, num_blocks=256)
    p = llm.tokenizer.encode("the cat sat on the mat", add_special_tokens=False)
    free = llm.generate(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3))[0]
    assert len(free.logprobs) == len(free.token_ids)
    for tok, lp in zip(free.token_ids, free.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3 and lp.logprob <= 0
        assert max(lp.top.values()) >= lp.logprob - 1e-6
    assert free.logprobs[0].top[free.token_ids[0]] == pytest.approx(free.logprobs[0].logprob)
    stop_tok = free.token_ids[3]
    cut = llm.generate(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_tok
    assert cut.token_ids == free.token_ids[: free.token_ids.index(stop_tok) + 1]
    if len(free.text) > 6:
        s = free.text[3:6]
        stopped = llm.generate(p, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[s]))[0]
        assert stopped.finish_reason == "stop" and stopped.text == free.text[: free.text.index(s)]


def test_abort_frees_blocks(tiny):
    path, _ = tiny["llama"]
    engine = make_engine(str(path), block_size=4, num_blocks=64)
    for i, p in enumerate(_prompts(300, [10, 20, 30])):
        engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True), request_id=f"r{i}")
    engine.step()
    engine.step()
    assert engine.pool.num_free < 64
    for i in range(3):
        assert engine.abort(f"r{i}").finish_reason == "abort"
    assert engine.pool.num_free == 64 and not engine.has_unfinished()


def test_bad_arguments_say_what_to_change(tiny):
    path, _ = tiny["llama"]
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="model"):
        LLM("no-such-model")
    llm = LLM(str(path), block_size=4, num_blocks=16)  # 64 tokens of KV
    with pytest.raises(ValueError, match="context"):
        llm.generate(list(range(3, 100)), GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([1, 2, 10**6], GREEDY)
    assert llm.engine.pool.num_free == 16 and not llm.engine.has_unfinished()


def test_chat_applies_template(tiny):
    path, _ = tiny["qwen2"]
    llm = LLM(str(path), block_size=4, num_blocks=64)
    msgs = [{"role": "user", "content": "hello world"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    expected = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert out.prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)
