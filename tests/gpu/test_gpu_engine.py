"""The engine on a CUDA GPU against references: the CPU engine (tiny model, float32), the
reference attention backend (Llama-3-8B shape, random bf16 weights) and eager steps (CUDA graphs).

bf16 over 32 layers puts the Triton kernels' logits about 2.3e-2 (relative) from the reference
backend's (each kernel alone is 2-3e-3 from float32), so logits are held to 5e-2; greedy tokens
are compared only where both sides run the same kernels, since random weights make near-ties."""
from __future__ import annotations

from functools import partial

import torch

from gpu_helpers import cold_then_warm, release, rel_err, span_layouts
from spanserve import LLM, SamplingParams
from spanserve.attention.triton import TritonBackend
from spanserve.engine.engine import LLMEngine
from spanserve.engine.batch import prepare
from engine_helpers import make_engine
from tiny_models import make_tiny_model

LOGITS_TOL = 5e-2
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def last_logits(eng: LLMEngine, prompt) -> torch.Tensor:
    """Final-position logits of `prompt`'s prefill, through the engine's own steps; the request is
    dropped afterwards (its blocks stay cached)."""
    eng.add_request(prompt, SamplingParams(max_tokens=1))
    sched = eng.scheduler.schedule()
    while not any(c.task.sample and c.positions[-1] == len(c.task.tokens) - 1 for c in sched.chunks):
        eng.executor.run(prepare(sched.chunks, eng.executor.graph_limits))
        sched = eng.scheduler.schedule()
    out = eng.executor.run(prepare(sched.chunks, eng.executor.graph_limits))
    out = out.logits[[r for r in out.rows if r >= 0][-1]].float()
    for rid in list(eng.requests):
        eng.abort(rid)
    return out


def run_to_end(eng: LLMEngine, prompts: list, params: SamplingParams) -> list[list[int]]:
    reqs = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    return [list(r.output_token_ids) for r in reqs]


def test_tiny_model_on_cuda_gives_the_cpu_engines_tokens(tmp_path):
    """Greedy tokens of span layouts, cold and then warm in the other order, on CUDA with the
    reference and the Triton backends equal the CPU engine's (float32, a 4-layer model)."""
    path, _ = make_tiny_model("llama", tmp_path, layers=4)
    gen = torch.Generator().manual_seed(0)
    lays = span_layouts(gen, 384, torch.randint(3, 384, (37,), generator=gen).tolist())
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = {}
    for name, dev, backend in [("cpu", "cpu", "reference"), ("cuda-reference", "cuda", "reference"),
                               ("cuda-triton", "cuda", TritonBackend())]:
        outs[name] = cold_then_warm(partial(LLM, str(path), device=dev, dtype="float32", block_size=16, num_blocks=256,
                                            backend=backend), lays, params)
    expect = outs["cpu"][0]
    assert all(len(t) == 16 for t in expect)
    for name in ("cuda-reference", "cuda-triton"):
        assert outs[name] == (expect, expect), name


def test_repaired_segments_on_cuda_give_the_cpu_engines_tokens(tmp_path):
    """Plus segments read with a temperature and log scale (the attention repair): greedy tokens
    on CUDA through Triton (decode and step graphs, split launches) equal the CPU engine's, cold
    and warm, with and without selective recompute."""
    from spanserve.reuse.policies import Policy, SparseQ

    path, _ = make_tiny_model("llama", tmp_path, layers=4)
    gen = torch.Generator().manual_seed(3)
    lays = span_layouts(gen, 384, torch.randint(3, 384, (37,), generator=gen).tolist())
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for policy in (Policy("none", temperature=0.5, log_scale=1.0), SparseQ(k=8, boundary=1, temperature=1.5, log_scale=-0.5)):
        outs = {}
        for name, dev, backend in [("cpu", "cpu", "reference"), ("cuda-triton", "cuda", TritonBackend())]:
            outs[name] = cold_then_warm(partial(LLM, str(path), device=dev, dtype="float32", block_size=16,
                                                num_blocks=256, backend=backend), lays, params, policy=policy)
        assert outs["cuda-triton"] == (outs["cpu"][0], outs["cpu"][0]), policy


def test_seeded_sampling_on_cuda_is_reproducible(tmp_path):
    """Per-request generators live on the engine's device: a seeded request repeats itself."""
    path, _ = make_tiny_model("llama", tmp_path, layers=2)
    llm = LLM(str(path), device="cuda", dtype="float32", block_size=16, num_blocks=64)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate([5, 6, 7, 8], seeded)[0].token_ids
    b = llm.generate([5, 6, 7, 8], seeded)[0].token_ids
    llm.shutdown()
    del llm
    release()
    assert len(a) == 8 and a == b


def test_8b_triton_logits_match_the_reference_backend(model_8b):
    """Final logits of span layouts, cold then warm: Triton (fused elementwise ops) against the
    reference backend, and against Triton with eager elementwise ops."""
    from spanserve.model.llama import _Eager

    gen = torch.Generator().manual_seed(1)
    lays = span_layouts(gen, 128000, torch.randint(3, 128000, (700,), generator=gen).tolist())
    logits = {}
    for name, backend in [("reference", None), ("triton", TritonBackend()), ("triton-eager-ops", TritonBackend())]:
        eng = make_engine(model_8b, device="cuda", dtype="bfloat16", num_blocks=2048, backend=backend)
        if name == "triton-eager-ops":
            eng.model.ops = _Eager
        logits[name] = [last_logits(eng, lay) for lay in lays + lays]
        eng.shutdown()
        del eng
        release()
    for other in ("reference", "triton-eager-ops"):
        errs = [rel_err(a, b) for a, b in zip(logits["triton"], logits[other])]
        assert max(errs) < LOGITS_TOL, (other, errs)


def graph_run(model, graphs, lays: list, warm: list) -> tuple[list[list[int]], list[torch.Tensor], int, int]:
    """Decode the layouts at batch 3 to the end, then each warm layout alone: its prefill logits
    (a short step over cached documents at new positions) and its tokens."""
    backend = None if graphs is None else TritonBackend()
    eng = make_engine(model, device="cuda", dtype="bfloat16", num_blocks=1024, backend=backend,
                    cuda_graphs=graphs or False)
    toks = run_to_end(eng, lays, GREEDY)
    first = []
    for lay in warm:
        first.append(last_logits(eng, lay))
        toks += run_to_end(eng, [lay], GREEDY)
    runner = eng.executor
    replays = (runner.graphs.replays if runner.graphs else 0, runner.step_graphs.replays if runner.step_graphs else 0)
    eng.shutdown()
    del eng, runner
    release()
    return toks, first, *replays


def test_8b_cuda_graphs_match_eager_steps(model_8b):
    """Decode through CUDA graphs gives the eager engine's greedy tokens; warm short prefills
    replayed from step graphs stay as close to the reference backend as eager ones."""
    gen = torch.Generator().manual_seed(3)
    doc = torch.randint(3, 128000, (300,), generator=gen).tolist()
    lays = span_layouts(gen, 128000, doc)
    warm = span_layouts(gen, 128000, doc)[:2] + span_layouts(gen, 128000, doc)[:2]
    g_toks, g_first, replays, step_replays = graph_run(model_8b, "auto", lays, warm)
    e_toks, e_first, _, _ = graph_run(model_8b, False, lays, warm)
    _, r_first, _, _ = graph_run(model_8b, None, lays, warm)
    assert replays > 0 and step_replays > 0
    assert g_toks[:3] == e_toks[:3]
    for first in (g_first, e_first):
        errs = [rel_err(a, b) for a, b in zip(first, r_first)]
        assert max(errs) < LOGITS_TOL, errs


def test_8b_split_decode_graphs_match_split_eager_over_16k_keys(model_8b):
    """Batch-1 decode over a 16k-token context splits its launch along keys; the graphs of the
    split launch give the same greedy tokens as the same split run eagerly (cold runs both: a
    repeated prompt would recompute its last position in a one-token step, which rounds apart)."""
    n_ctx = 16384
    prompt = torch.randint(3, 128000, (n_ctx,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(max_tokens=38, temperature=0, ignore_eos=True)
    toks, ways = {}, []
    for graphs in (True, False):
        eng = make_engine(model_8b, device="cuda", dtype="bfloat16", max_num_batched_tokens=n_ctx + 16,
                        num_blocks=n_ctx // 16 + 64, backend=TritonBackend(), cuda_graphs=graphs)
        toks[graphs] = run_to_end(eng, [prompt], params)[0]
        if graphs:
            ways = sorted(w for _, w, _ in eng.executor.graphs.buffers[1].static._layouts)
        eng.shutdown()
        del eng
        release()
    assert ways and max(ways) > 1, ways  # the decode launch was split along keys
    assert len(toks[True]) == 38 and toks[True] == toks[False]
