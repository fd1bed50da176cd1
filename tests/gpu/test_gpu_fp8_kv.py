"""The 8-bit KV cache on CUDA: the write kernel against the quantizer, attention over an 8-bit
cache against attention over its dequantized bfloat16 copy (bit for bit: the scales are powers of
two), and the engine's span layouts cold and warm, with CUDA graphs."""
from __future__ import annotations

from functools import partial

import pytest
import torch

import test_gpu_attention_kernels as gk
from gpu_helpers import cold_then_warm, span_layouts
from spanserve import LLM, SamplingParams
from spanserve.attention.kv_cache import FP8, Fp8Cache, dequantize, quantize
from spanserve.attention.reference import ReferenceBackend
from spanserve.attention.triton import TritonBackend
from spanserve.attention.triton.backend import write_kv
from spanserve.rope import Rotary
from tiny_models import make_tiny_model

DEV = torch.device("cuda")


def test_write_kernel_stores_the_quantizers_bits() -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    T, KVH, D = 4096, 8, 128
    k = (torch.randn(T, KVH, D, generator=g, device=DEV) * torch.exp2(
        torch.randint(-10, 10, (T, KVH, 1), generator=g, device=DEV).float())).to(torch.bfloat16)
    v = torch.randn(T, KVH, D, generator=g, device=DEV).to(torch.bfloat16)
    slots = torch.randperm(T * 2, device=DEV)[:T]
    caches = [Fp8Cache(torch.zeros(T * 2 // 16, 16, KVH, D, dtype=FP8, device=DEV),
                       torch.ones(T * 2 // 16, 16, KVH, dtype=torch.bfloat16, device=DEV)) for _ in range(2)]
    write_kv(k, v, caches[0], caches[1], slots)
    for x, c in zip((k, v), caches):
        q, s = quantize(x.cpu())  # the dense reference, on the CPU
        got = c.data.view(-1, KVH, D)[slots].cpu()
        assert torch.equal(c.scale.view(-1, KVH)[slots].cpu(), s)
        bad = got.view(torch.uint8) != q.view(torch.uint8)
        where = bad.nonzero()[:8].tolist()
        assert not bad.any(), (f"{int(bad.sum())} values differ, e.g. " + "; ".join(
            f"x={x[t, h, d].item()!r} scale={s[t, h].item()} kernel={got[t, h, d].item()} "
            f"reference={q[t, h, d].item()}" for t, h, d in where))


@pytest.mark.parametrize("seed,prerotate,split,staged", [(0, True, None, False), (1, False, None, False),
                                                        (2, True, 2048, False), (3, False, 2048, False),
                                                        (4, True, None, True), (5, False, 2048, True)])
def test_fp8_attention_equals_attention_over_the_dequantized_cache(seed: int, prerotate: bool, split,
                                                                   staged: bool) -> None:
    """A mixed step at Llama-3-8B shapes (prefill chunks, a plus-form unit, decodes over up to 4k
    keys with span, zero and per-block deltas), prerotated or fused, split or not."""
    plan, n_tokens = gk.mixed_step(seed)
    H, KVH, D, BS = gk.H, gk.KVH, gk.D, gk.BS
    rot = Rotary(D, 500000.0, gk.LLAMA3, DEV)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v = (torch.randn(n_tokens, h, D, device=DEV, generator=gen).to(torch.bfloat16) for h in (H, KVH, KVH))
    shape = (gk.NUM_BLOCKS, BS, KVH, D)
    k8, v8 = (Fp8Cache(*quantize(torch.randn(shape, generator=gen, device=DEV))) for _ in range(2))
    tb = TritonBackend(prerotate_prefill=prerotate, split_programs=split, dense_prefill=0)
    tb = tb.for_kv_cache(FP8) if staged else tb  # the engine's: prefill launches read bf16 copies
    got = tb.forward(tb.prepare(plan, rot, BS), q, k, v, k8, v8)  # this step's rows written quantized
    dk, dv = dequantize(k8.data, k8.scale, torch.bfloat16), dequantize(v8.data, v8.scale, torch.bfloat16)
    same = tb.attend(tb.prepare(plan, rot, BS), q, dk, dv).float()
    ref = ReferenceBackend()
    want = ref.attend(ref.prepare(plan, rot, BS), q.float(), dk.float(), dv.float())
    err_ref = ((got.float() - want).norm() / want.norm()).item()
    err_same = ((got.float() - same).norm() / same.norm()).item()
    print(f"seed {seed}: against the float32 reference {err_ref:.2e}, against bf16 over the dequantized cache "
          f"{err_same:.2e} (that kernel against the reference {((same - want).norm() / want.norm()).item():.2e})")
    assert torch.isfinite(got).all()
    assert err_ref < 1e-2 and err_same < 1e-2
    assert torch.equal(got, tb.attend(tb.prepare(plan, rot, BS), q, k8, v8))  # reruns: the same bits


def test_span_layouts_cold_and_warm_under_fp8_kv(tmp_path) -> None:
    """Greedy tokens of span layouts through Triton with CUDA graphs and an 8-bit pool: warm (the
    other order, segments read back from the 8-bit cache) equal cold; and the reference backend on
    the same device, reading the same 8-bit cache, gives the same tokens."""
    path, _ = make_tiny_model("llama", tmp_path, layers=4)
    gen = torch.Generator().manual_seed(5)
    lays = span_layouts(gen, 384, torch.randint(3, 384, (37,), generator=gen).tolist())
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    def eight_bit(llm: LLM) -> None:
        assert llm.engine.storage.k.dtype == FP8

    outs = {}
    for name, backend in [("reference", "reference"), ("triton", TritonBackend())]:
        outs[name] = cold_then_warm(partial(LLM, str(path), device="cuda", dtype="float32", block_size=16, num_blocks=256,
                                            backend=backend, kv_cache_dtype="fp8"), lays, params, check=eight_bit)
    assert outs["triton"][0] == outs["triton"][1]
    assert outs["triton"] == outs["reference"]
