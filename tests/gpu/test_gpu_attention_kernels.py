"""The Triton attention kernels compiled for the GPU at Llama-3-8B shapes (32 query heads, 8 KV
heads, head dim 128, bf16 and fp16) against the reference backend in float32: a mixed step
(prefill chunks, a plus-form unit, decodes over up to 4k keys with span, zero and per-block
deltas), with prerotated and fused prefill, and split launches; then eager repositioning of 32
layers. tests/test_triton_attention.py covers the same kernels at small shapes on the CPU
(interpreter); here they run with the GPU's tiles, warps and dtypes."""
from __future__ import annotations

import random

import pytest
import torch

from spanserve.attention.plan import AttentionPlan, Row
from spanserve.attention.reference import ReferenceBackend
from spanserve.attention.triton import TritonBackend, reposition_blocks
from spanserve.cache.table import Entry, key_deltas, key_slots
from spanserve.rope import Rotary, apply_rotary

H, KVH, D, BS, LAYERS, NUM_BLOCKS = 32, 8, 128, 16, 32, 8000
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def rot() -> Rotary:
    return Rotary(D, 500000.0, LLAMA3, torch.device("cuda"))


def entries_for(rng: random.Random, n_keys: int, pool: list[int], mode: str) -> list[Entry]:
    """Spans of 300-700 keys, a partial entry closing each; `zero`: all deltas 0, `seg`: one
    delta per span, `block`: one per entry (the worst case)."""
    out: list[Entry] = []
    total = 0
    while total < n_keys:
        seg = min(rng.randint(300, 700), n_keys - total)
        delta = rng.choice([1, -1]) * rng.randint(1, 20000)
        while seg > 0:
            n = min(BS, seg)
            d = 0 if mode == "zero" else (rng.randint(-20000, 20000) or 1) if mode == "block" else delta
            out.append(Entry(pool.pop(), d, n))
            seg -= n
            total += n
    return out


def row_for(entries: list[Entry], q_start: int, nq: int, plus: tuple[int, int] | None) -> Row:
    slots, deltas = key_slots(entries, BS), key_deltas(entries)
    n, dev = len(slots), "cuda"
    return Row(q_start, q_start + nq, torch.arange(n - nq, n, device=dev), torch.tensor(slots, device=dev),
               None if deltas is None else torch.tensor(deltas, device=dev),
               None if plus is None else torch.full((nq,), plus[0], device=dev),
               None if plus is None else torch.full((nq,), plus[1], device=dev))


def mixed_step(seed: int) -> tuple[AttentionPlan, int]:
    """Three prefill rows (one a plus-form unit) and 20 decodes, each row with its own delta mode."""
    rng = random.Random(seed)
    pool = list(range(1, NUM_BLOCKS))
    rng.shuffle(pool)
    specs = [(3000, 700, None), (1500, 1500, None), (900, 400, (64, 300))]
    specs += [(rng.randint(20, 4000), 1, None) for _ in range(20)]
    rows, q0 = [], 0
    for n, nq, plus in specs:
        rows.append(row_for(entries_for(rng, n, pool, rng.choice(["seg", "seg", "zero", "block"])), q0, nq, plus))
        q0 += nq
    pos = torch.cat([r.q_pos for r in rows])
    return AttentionPlan(rows, pos, torch.cat([r.key_slots[r.q_pos] for r in rows])), q0


@pytest.mark.parametrize("seed,dtype,prerotate,split", [
    (0, torch.bfloat16, True, None), (1, torch.bfloat16, True, None), (2, torch.float16, True, None),
    (3, torch.bfloat16, False, None), (4, torch.bfloat16, True, 2048), (5, torch.bfloat16, False, 2048)])
def test_mixed_step_matches_the_float32_reference(rot, seed, dtype, prerotate, split):
    plan, n_tokens = mixed_step(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(n_tokens, h, D, device="cuda", generator=gen).to(dtype) for h in (H, KVH, KVH))
    kc, vc = (torch.randn(NUM_BLOCKS, BS, KVH, D, device="cuda", dtype=dtype) for _ in range(2))
    used = torch.zeros(NUM_BLOCKS * BS, dtype=torch.bool, device="cuda")
    used[:BS] = True  # the reference pads key lists with slot 0
    for r in plan.rows:
        used[r.key_slots] = True
    kc.view(-1, KVH, D)[~used] = float("nan")  # a read outside the rows' slots poisons the output
    vc.view(-1, KVH, D)[~used] = float("nan")
    ref = ReferenceBackend()
    want = ref.forward(ref.prepare(plan, rot, BS), q.float(), k.float(), v.float(), kc.float(), vc.float())
    ref_k, ref_v = kc.clone(), vc.clone()
    ref.forward(ref.prepare(plan, rot, BS), q, k, v, ref_k, ref_v)
    tb = TritonBackend(prerotate_prefill=prerotate, split_programs=split, dense_prefill=0)
    lay = tb.prepare(plan, rot, BS)
    tk, tv = kc.clone(), vc.clone()
    got = tb.forward(lay, q, k, v, tk, tv).float()
    assert torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert torch.equal(got, tb.attend(lay, q, tk, tv).float())  # bitwise reruns: no race
    assert torch.equal(tk.view(-1, KVH, D)[used], ref_k.view(-1, KVH, D)[used])  # the KV write
    assert torch.equal(tv.view(-1, KVH, D)[used], ref_v.view(-1, KVH, D)[used])


def test_reposition_of_32_layers_matches_copy_and_rotate(rot):
    gen = torch.Generator(device="cuda").manual_seed(3)
    k, v = (torch.randn(LAYERS, 64, BS, KVH, D, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    jobs = [(i, 32 + i, BS if i % 3 else 7, [0, 37, -1200, 15000][i % 4]) for i in range(32)]
    want_k, want_v = k.clone(), v.clone()
    for src, dst, n, delta in jobs:
        cos, sin = rot.cos_sin(torch.tensor([delta], device="cuda"), torch.float32)
        for layer in range(LAYERS):
            want_k[layer, dst, :n] = apply_rotary(k[layer, src, :n].float(), cos.expand(n, -1),
                                                  sin.expand(n, -1)).to(k.dtype)
            want_v[layer, dst, :n] = v[layer, src, :n]
    reposition_blocks(k, v, jobs, rot.inv_freq)
    assert ((k.float() - want_k.float()).norm() / want_k.float().norm()).item() < 1e-2
    assert torch.equal(v, want_v)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n_keys,n_q", [(4096, 4096), (8192, 3072), (5000, 1200)])
def test_dense_rows_through_cudnn_match_the_reference(monkeypatch, n_keys: int, n_q: int, fp8: bool) -> None:
    """A fresh prompt's row and later chunks of one (queries the last of their keys) at Llama-3-8B
    heads take the dense path: cuDNN, a chunk in two calls merged by log-sum-exp (the explicit-mask
    fallback is made to fail, so the test sees the cuDNN route), over scattered slots of a bf16 or
    8-bit cache; against the float32 reference and against the paged Triton kernel."""
    from spanserve.attention.kv_cache import Fp8Cache, dequantize, quantize
    from spanserve.attention.triton import dense
    DEV = torch.device("cuda")

    def refuse(*a, **k):
        raise AssertionError("the explicit-mask fallback ran")
    monkeypatch.setattr(dense, "_masked", refuse)
    gen = torch.Generator(device=DEV).manual_seed(n_keys + fp8)
    rot = Rotary(D, 500000.0, LLAMA3, DEV)
    blocks = n_keys // BS + 8
    shape = (blocks, BS, KVH, D)
    if fp8:
        kc, vc = (Fp8Cache(*quantize(torch.randn(shape, generator=gen, device=DEV))) for _ in range(2))
        dk, dv = dequantize(kc.data, kc.scale), dequantize(vc.data, vc.scale)
    else:
        kc, vc = (torch.randn(shape, generator=gen, device=DEV).to(torch.bfloat16) for _ in range(2))
        dk, dv = kc.float(), vc.float()
    slots = torch.randperm(blocks * BS, generator=gen, device=DEV)[:n_keys]
    q = torch.randn(n_q, H, D, generator=gen, device=DEV).to(torch.bfloat16)
    pos = torch.arange(n_keys - n_q, n_keys, device=DEV)
    plan = AttentionPlan([Row(0, n_q, pos, slots)], pos, slots[n_keys - n_q:].clone())
    be = TritonBackend()
    be = be.for_kv_cache(kc.dtype) if fp8 else be
    lay = be.prepare(plan, rot, BS)
    assert len(lay.dense_rows(1024)) == 1
    got = be.attend(lay, q, kc, vc).float()
    paged = TritonBackend(dense_prefill=0)
    paged = paged.for_kv_cache(kc.dtype) if fp8 else paged
    triton_out = paged.attend(paged.prepare(plan, rot, BS), q, kc, vc).float()
    ref = ReferenceBackend()
    want = ref.attend(ref.prepare(plan, rot, BS), q.float(), dk, dv)
    err = ((got - want).norm() / want.norm()).item()
    err_triton = ((triton_out - want).norm() / want.norm()).item()
    print(f"{n_q} queries over {n_keys} keys, fp8 {fp8}: dense {err:.2e}, paged Triton {err_triton:.2e}")
    assert torch.isfinite(got).all()
    assert err < 1e-2 and err < 2 * err_triton + 1e-3
