"""Tensor parallelism on the CPU: TP=2 (gloo, two processes) computes what TP=1 computes, on tiny
Llama, Qwen2 and Qwen3 models: plain prompts, span layouts with deltas cold and warm, selective
recomputation, greedy decoding. One TP=2 engine per architecture serves every test of the module."""
import pytest
import torch

from spanserve import LLM, SamplingParams, Segment
from spanserve.reuse.policies import CacheBlend, Policy, SparseQ
from span_helpers import capture_logits, run_all
from tiny_models import make_tiny_model

BS = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _toks(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n,), generator=g).tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request, tmp_path_factory):
    path, _ = make_tiny_model(request.param, tmp_path_factory.mktemp(f"tp-{request.param}"),
                              tie=request.param == "qwen2")
    one = LLM(str(path), block_size=BS, num_blocks=512, max_num_batched_tokens=64)
    two = LLM(str(path), block_size=BS, num_blocks=512, max_num_batched_tokens=64, tensor_parallel_size=2)
    one.path = str(path)
    yield one, two
    two.shutdown()


def _same_logits(pair, prompts, policy=None):
    """Prompt-end logits of every prompt on both engines (run as one batch each)."""
    one, two = pair
    s1, s2 = capture_logits(one.engine), capture_logits(two.engine)
    ids1 = run_all(one.engine, prompts, policy=policy)
    ids2 = run_all(two.engine, prompts, policy=policy)
    for a, b in zip(ids1, ids2):
        torch.testing.assert_close(s2[b], s1[a], rtol=0, atol=1e-4)
    return ids1, ids2


def test_plain_prompts_and_greedy_tokens(pair):
    one, two = pair
    prompts = [_toks(n, n) for n in (5, 23, 90)]  # 90 > max_num_batched_tokens: chunked prefill
    _same_logits(pair, prompts)
    a = [o.token_ids for o in one.generate(prompts, GREEDY)]
    b = [o.token_ids for o in two.generate(prompts, GREEDY)]
    assert a == b
    assert two.engine.pool.num_free == two.engine.pool.num_blocks  # nothing leaked


def test_span_layouts_with_deltas_cold_and_warm(pair):
    one, two = pair
    docs = [_toks(n, 100 + n) for n in (13, 9, 17)]
    sys_ = _toks(6, 7)

    def layout(order, q):
        return ([Segment(token_ids=sys_)] + [Segment(token_ids=docs[i], kind="plus") for i in order]
                + [Segment(token_ids=_toks(5, q))])

    _same_logits(pair, [layout([0, 1, 2], 1)])  # cold
    warm = [layout([2, 0, 1], 2), layout([1, 2], 3)]  # reordered: cached docs read with new deltas
    _same_logits(pair, warm)
    outs1, outs2 = one.generate(warm, GREEDY), two.generate(warm, GREEDY)
    for o1, o2 in zip(outs1, outs2):
        assert o2.metrics["reuse"]["segment"] > 0
        assert o2.metrics["reuse"] == o1.metrics["reuse"]
        assert o2.token_ids == o1.token_ids


@pytest.mark.parametrize("policy", [CacheBlend(ratio=0.5, check_layer=1), SparseQ(k=6, boundary=1, tail=0)])
def test_selective_recompute_decides_the_same(pair, policy):
    """Each rank scores with its own heads; the scores are summed over ranks before deciding."""
    one, two = pair
    docs = [_toks(21, 200), _toks(15, 201)]
    lay = [Segment(token_ids=_toks(4, 9))] + [Segment(token_ids=d, kind="plus") for d in docs] + \
        [Segment(token_ids=_toks(6, 10))]
    run_all(one.engine, [lay]), run_all(two.engine, [lay])  # the docs cached
    lay2 = [lay[0], lay[2], lay[1], Segment(token_ids=_toks(6, 11))]
    outs1, outs2 = one.generate(lay2, GREEDY, policy=policy), two.generate(lay2, GREEDY, policy=policy)
    assert outs2[0].metrics["recompute"] == outs1[0].metrics["recompute"]
    assert outs2[0].metrics["recompute"]["reused"] > 0
    assert outs2[0].token_ids == outs1[0].token_ids
    lay3 = [lay[0], lay[1], lay[2], Segment(token_ids=_toks(6, 12))]
    _same_logits(pair, [lay3], policy=policy)


def test_prompt_logprobs_match(pair):
    """Prompt logprobs need the LM head over every prompt position: under TP its vocabulary gather
    is a collective, so the workers must join each scoring call (this hung before they did)."""
    one, two = pair
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=3)
    prompt = _toks(150, 9)  # three prefill chunks of 64: three steps scored
    (a,), (b,) = one.generate(prompt, params), two.generate(prompt, params)
    assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
    assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(prompt)
    for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert (x.token_id, x.rank) == (y.token_id, y.rank)
        assert abs(x.logprob - y.logprob) < 1e-4
        assert sorted(x.top.values()) == pytest.approx(sorted(y.top.values()), abs=1e-4)
    assert a.token_ids == b.token_ids


def test_one_device_emulating_two_ranks_gives_their_bits(pair):
    """emulate_tp=2: one process computing as TP=2's ranks do (their GEMM shapes, partial products
    added in rank order) gives TP=2's logits exactly, where plain TP=1 differs in the last bits;
    plain TP=1 and the emulation agree to rounding. One torch thread, as the worker has: on the CPU
    a GEMM's rounding can follow the thread count."""
    one, two = pair
    emu = LLM(one.path, block_size=BS, num_blocks=512, max_num_batched_tokens=64, emulate_tp=2)
    docs = [_toks(n, 300 + n) for n in (11, 19)]
    lays = [[Segment(token_ids=_toks(5, 31))] + [Segment(token_ids=docs[i], kind="plus") for i in order]
            + [Segment(token_ids=_toks(4, q))] for order, q in (([0, 1], 32), ([1, 0], 33))]
    prompts = [_toks(70, 34), *lays]  # 70 > max_num_batched_tokens: chunked prefill
    s1, s2, se = capture_logits(one.engine), capture_logits(two.engine), capture_logits(emu.engine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for p in prompts:  # one at a time: the second layout reads the first one's documents warm
            (a,), (b,), (c,) = (run_all(e.engine, [p], params=GREEDY) for e in (one, two, emu))
            assert torch.equal(se[c], s2[b])
            torch.testing.assert_close(se[c], s1[a], rtol=0, atol=1e-4)
        assert not torch.equal(s1[a], s2[b])  # what the emulation is for
        tokens = [o.token_ids for o in two.generate(prompts, GREEDY)]
        assert [o.token_ids for o in emu.generate(prompts, GREEDY)] == tokens
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="emulate_tp"):
        LLM(one.path, num_blocks=64, tensor_parallel_size=2, emulate_tp=3)


@pytest.mark.parametrize("policy", [Policy("none", temperature=0.6, log_scale=0.8),
                                    SparseQ(k=6, boundary=1, tail=0, temperature=1.5, log_scale=-0.5)])
def test_repaired_segments_give_emulated_bits(pair, policy):
    """Plus segments read repaired (temperature, log scale): TP=2 equals emulate_tp=2 bit for bit,
    and TP=1 to rounding, cold and warm, decoding included."""
    one, two = pair
    emu = LLM(one.path, block_size=BS, num_blocks=256, max_num_batched_tokens=64, emulate_tp=2)
    docs = [_toks(n, 400 + n) for n in (12, 18)]
    lays = [[Segment(token_ids=_toks(5, 41))] + [Segment(token_ids=docs[i], kind="plus") for i in order]
            + [Segment(token_ids=_toks(4, q))] for order, q in (([0, 1], 42), ([1, 0], 43))]
    s1, s2, se = capture_logits(one.engine), capture_logits(two.engine), capture_logits(emu.engine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for p in lays:  # the second reads the first one's documents warm
            (a,), (b,), (c,) = (run_all(e.engine, [p], params=GREEDY, policy=policy) for e in (one, two, emu))
            assert torch.equal(se[c], s2[b])
            torch.testing.assert_close(se[c], s1[a], rtol=0, atol=1e-4)
        tokens = [o.token_ids for o in two.generate(lays, GREEDY, policy=policy)]
        assert [o.token_ids for o in emu.generate(lays, GREEDY, policy=policy)] == tokens
    finally:
        torch.set_num_threads(threads)
        emu.shutdown()
