"""Short general steps through fixed-address, padded buffers (the CUDA-graph path for prefill
chunks, run here without capture through Triton's interpreter): the padded attention equals the
reference on the real tokens and writes nothing for padding tokens, and an engine that sends its
short steps this way gives the same tokens as the eager general path."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from test_triton_attention import BS, D, SMALL, _case  # noqa: E402
from engine_helpers import make_engine  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from spanserve.attention.host_plan import HostPlan  # noqa: E402
from spanserve.attention.plan import AttentionPlan, HostRow  # noqa: E402
from spanserve.attention.reference import ReferenceBackend  # noqa: E402
from spanserve.attention.triton import LaunchConfig, TritonBackend  # noqa: E402
from spanserve.attention.triton.graph_step import bucket  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.engine.layout import Segment  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.rope import Rotary  # noqa: E402


def _host_plan(plan: AttentionPlan) -> HostPlan:
    def np_(t: torch.Tensor | None) -> np.ndarray | None:
        return None if t is None else t.numpy().astype(np.int64)

    rows = [HostRow(np_(r.q_pos), np_(r.key_slots), np_(r.key_delta), np_(r.anchor_end), np_(r.seg_start), r.repair)
            for r in plan.rows]
    T = int(plan.positions.numel())
    return HostPlan(np.arange(T, dtype=np.int64), np_(plan.positions), np_(plan.write_slots), rows)


# 40 programs wanted per KV head: every prefill launch here is split (a graph's ways follow the
# program count alone), so padded token indices reach the combine, and the shares (20, 5 or 3
# ways) leave padding descriptors after them (as do split-decode's decode launches, 5 ways). Not
# more: the interpreter's time grows with the programs (1000 gave seed 3 16x as many).
SPLIT = 40
BACKENDS = {
    "plain": lambda: TritonBackend(SMALL, SMALL),
    "split": lambda: TritonBackend(LaunchConfig(32, 16, 4, 1), SMALL, split_programs=SPLIT),
    "split-fused": lambda: TritonBackend(LaunchConfig(32, 16, 4, 1), SMALL, split_programs=SPLIT,
                                         prerotate_prefill=False),
    # 4-key decode tiles: decode-size rows of 32+ keys are split too, padding reaching that combine
    "split-decode": lambda: TritonBackend(LaunchConfig(32, 16, 4, 1), LaunchConfig(16, 4, 4, 1), split_programs=SPLIT),
}


@pytest.mark.parametrize("mode", sorted(BACKENDS))
@pytest.mark.parametrize("seed", range(5))
def test_padded_step_matches_reference(mode: str, seed: int) -> None:
    """Seeds 3 and 4: some rows read their plus segments repaired (plan.Repair)."""
    rng = random.Random(300 + seed)
    case = _case(rng, n_rows=rng.randint(1, 5), plus=seed % 2 == 1, max_keys=200, repair=seed >= 3)
    backend = BACKENDS[mode]()
    H, KVH = 4, 2
    static = backend.static_steps(H // KVH, KVH, Rotary(D, 10000.0, None, torch.device("cpu")).inv_freq,
                                  torch.device("cpu"))
    hp = _host_plan(case.plan)
    T = len(hp.ids)
    shape, lay, dev, _ = static.load(hp)
    assert shape.repaired == any(r.repair is not None for r in case.plan.rows)
    Tp = shape.tokens
    assert Tp == bucket(T, 16) and dev["write_slots"][T:].eq(-1).all()
    if mode != "plain" and shape.big:
        assert shape.ways > 1
    if shape.ways > 1:
        assert lay.fixed[1].tokens.numel() == Tp and (lay.fixed[1].tokens[T:] == -1).all()
    if shape.small_ways > 1:
        assert lay.fixed[0].tokens.numel() == Tp and (lay.fixed[0].tokens[T:] == -1).all()
    small_keys = [r.num_keys for r in case.plan.rows if r.num_queries <= 8]  # 16-row programs, G = 2
    if mode == "split-decode" and small_keys and max(small_keys) >= 32:
        assert shape.small_ways > 1

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(Tp, H, D, generator=gen)
    k = torch.randn(Tp, KVH, D, generator=gen)
    v = torch.randn(Tp, KVH, D, generator=gen)
    shape_c = (case.num_blocks, BS, KVH, D)
    cache_k, cache_v = torch.randn(shape_c, generator=gen), torch.randn(shape_c, generator=gen)
    unused = torch.ones(case.num_blocks * BS, dtype=torch.bool)
    unused[list(case.used)] = False
    cache_k.view(-1, KVH, D)[unused] = float("nan")
    cache_v.view(-1, KVH, D)[unused] = float("nan")

    rotary = Rotary(D, 10000.0, None, torch.device("cpu"))
    ref = ReferenceBackend()
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    want = ref.forward(ref.prepare(case.plan, rotary, BS), q[:T], k[:T], v[:T], ref_k, ref_v)
    got_k, got_v = cache_k.clone(), cache_v.clone()
    got = backend.forward(lay, q, k, v, got_k, got_v)
    # padding tokens wrote nothing (the caches match the reference's exactly, NaN slots included)
    torch.testing.assert_close(got_k, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_v, ref_v, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(got[:T]).all()
    err = ((got[:T] - want).norm() / want.norm()).item()
    assert err < 2e-6, err


def test_buckets_reuse_and_grow() -> None:
    # Steps of one padded shape share buffers; more keys than the capacity move them (and say so).
    rng = random.Random(9)
    backend = TritonBackend(SMALL, SMALL)
    static = backend.static_steps(2, 2, Rotary(D, 10000.0, None, torch.device("cpu")).inv_freq, torch.device("cpu"))
    case = _case(rng, n_rows=1, plus=False, max_keys=120)
    hp = _host_plan(case.plan)
    s1, lay1, dev1, moved1 = static.load(hp)
    s2, lay2, dev2, moved2 = static.load(hp)
    assert not moved1 and not moved2 and lay1 is lay2 and dev1["ids"].data_ptr() == dev2["ids"].data_ptr()
    reps = 2000 // len(hp.rows[0].key_slots) + 1  # past the initial 1024-key capacity
    big = HostPlan(hp.ids, hp.positions, hp.write_slots,
                   [r._replace(key_slots=np.tile(r.key_slots, reps), key_delta=None if r.key_delta is None
                               else np.tile(r.key_delta, reps)) for r in hp.rows])
    s3, lay3, dev3, moved3 = static.load(big)
    assert s3.buffers == s1.buffers
    assert moved3 and dev3["ids"].data_ptr() != dev1["ids"].data_ptr()
    assert static.sets[s3.buffers].regions.key_cap >= 2000


def _prompts(gen: torch.Generator, vocab: int, doc: list[int], other: list[int]) -> list:
    t = lambda n: torch.randint(3, vocab, (n,), generator=gen).tolist()  # noqa: E731
    return [
        t(30),
        [Segment(token_ids=t(6)), Segment(token_ids=doc, kind="plus"), Segment(token_ids=other, kind="plus"),
         Segment(token_ids=t(12))],
        [Segment(token_ids=t(4)), Segment(token_ids=other, kind="plus"), Segment(token_ids=doc, kind="plus"),
         Segment(token_ids=t(11))],
        t(70),
    ]


def _run(engine: LLMEngine, prompts: list) -> list[list[int]]:
    reqs = [engine.add_request(p, SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("split,prerotate,kv", [(0, False, "auto"), (SPLIT, True, "auto"), (0, False, "fp8")])
def test_engine_short_steps_match_eager(tmp_path, split: int, prerotate: bool, kv: str) -> None:
    """Prefill steps (plain prompts, span queries cold and warm with deltas) take the padded
    fixed-buffer path up to max_tokens and the general path above it; tokens match the eager
    engine's. Over an 8-bit pool every prefill launch, fixed or not, reads staged bf16 copies."""
    path, _ = make_tiny_model("llama", tmp_path)
    gen = torch.Generator().manual_seed(4)
    doc, other = torch.randint(3, 384, (45,), generator=gen).tolist(), torch.randint(3, 384, (23,), generator=gen).tolist()
    prompts = _prompts(gen, 384, doc, other)

    def engine(graphs: bool | str) -> LLMEngine:
        return make_engine(str(path), block_size=8, num_blocks=160, max_num_batched_tokens=96,
                           backend=TritonBackend(LaunchConfig(32, 8, 4, 1) if split else SMALL, SMALL,
                                                 split_programs=split, prerotate_prefill=prerotate), cuda_graphs=graphs,
                           kv_cache_dtype=kv)

    eager, fixed = engine(False), engine("eager")
    steps = fixed.executor.step_graphs
    assert steps is not None and not steps.capture
    steps.max_tokens = 64  # the 70-token prompt's first step runs eagerly
    assert _run(fixed, prompts) == _run(eager, prompts)
    # warm: the same documents at new positions (their order swapped) under new questions, one
    # request at a time, so each prefill is a short step of its own over keys with deltas
    warm = _prompts(gen, 384, other, doc)[1:3]
    for p in warm:
        assert _run(fixed, [p]) == _run(eager, [p])
    assert steps.replays >= 1 + len(warm)  # the cold short step, then each warm prefill
    shapes = [s for b in steps.static.sets.values() for s in b.layouts]
    assert any(s.small_fused for s in shapes)  # decode-size rows rotate Q in the kernel
    # warm prefill rows: their keys copied rotated by a counted pass, or Q rotated in the kernel
    assert any(s.big_prerotated if prerotate or kv == "fp8" else s.big_fused for s in shapes)
    if kv == "fp8":
        assert fixed.storage.fp8 and not any(s.big_fused for s in shapes)
    if split:
        assert any(s.ways > 1 for s in shapes)
