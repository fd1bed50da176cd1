"""Fresh prompt rows over an 8-bit cache with their products in e4m3 (`cudnn_fp8`, `dense._fp8_row`).

cuDNN's FP8 attention runs only on Hopper (tests/gpu/test_gpu_attention_kernels.py compares it with
the float32 reference there). Here, on the CPU: the per-tensor rounding of Q, K and V against its
dense definitions, and the route around the cuDNN call (gathering the row's slots, padding to the
graph's rows, merging a later chunk's two calls) through a float32 stand-in for that call, against
float32 attention over the same rounded values. Then the engine's choice of the route.
"""
from __future__ import annotations

import math

import pytest
import torch

from spanserve.attention import cudnn_fp8
from spanserve.attention.kv_cache import FP8, Fp8Cache, dequantize, quantize
from spanserve.attention.triton import dense
from spanserve.engine.builder import fp8_attention
from spanserve.engine.config import EngineConfig

H, KVH, D, BS = 4, 2, 32, 16


class Float32Call(cudnn_fp8.Fp8Attention):
    """cuDNN's FP8 call computed in float32 from the same e4m3 inputs: what the route around it
    must hand over and take back."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, bool]] = []

    def attend_e4m3(self, q8, sq, k8, sk, v8, sv, n_q, causal, stats=False):
        # queries padded to the graphs' rows with zeros; a causal call's keys padded alike
        assert q8.dtype == k8.dtype == v8.dtype == FP8 and q8.shape[0] == cudnn_fp8.bucket(n_q)
        assert not q8[n_q:].float().any() and (not causal or k8.shape[0] == q8.shape[0])
        self.calls.append((n_q, k8.shape[0], causal))
        q = q8.float() * sq.reshape(())
        k, v = (x.float().repeat_interleave(H // KVH, 1) * s.reshape(()) for x, s in ((k8, sk), (v8, sv)))
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        if causal:
            s = s.masked_fill(torch.arange(k.shape[0])[None, :] > torch.arange(q.shape[0])[:, None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)[:n_q]
        return o.to(torch.bfloat16), (torch.logsumexp(s, -1)[:, :n_q] if stats else None)


def _cache(n_slots: int, seed: int) -> Fp8Cache:
    """Rows whose scales span several powers of two, so the per-tensor rounding shifts codes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_slots, KVH, D, generator=g) * torch.exp2(torch.randint(-3, 3, (n_slots, KVH, 1), generator=g).float())
    data, scale = quantize(x)
    return Fp8Cache(data.view(-1, BS, KVH, D), scale.view(-1, BS, KVH))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 causal attention of q [n, H, D], the last n of the keys' positions."""
    n, m = q.shape[0], k.shape[0]
    k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
    s = s.masked_fill(torch.arange(m)[None, :] > torch.arange(m - n, m)[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def _requantized(cache: Fp8Cache, slots: torch.Tensor) -> torch.Tensor:
    """The dense definition of `_e4m3_rows`: the rows' values rounded to e4m3 under their largest
    row scale, as values."""
    rows = dequantize(cache.data.view(-1, KVH, D)[slots], cache.scale.view(-1, KVH)[slots])
    top = cache.scale.view(-1, KVH)[slots].float().max()
    return (rows / top).to(FP8).float() * top


def test_tensor_scale_is_the_least_power_of_two_that_fits() -> None:
    g = torch.Generator().manual_seed(0)
    for mag in (1e-3, 0.7, 448.0, 3e4):
        x = torch.randn(64, 8, generator=g) * mag
        s = cudnn_fp8.tensor_scale(x).item()
        assert math.log2(s) == round(math.log2(s))
        assert x.abs().max() / s <= 448 < 2 * x.abs().max() / s
        assert torch.isfinite(cudnn_fp8.to_e4m3(x, cudnn_fp8.tensor_scale(x)).float()).all()
    assert math.isfinite(cudnn_fp8.tensor_scale(torch.zeros(4)).item())


def test_rows_rounded_under_their_largest_scale() -> None:
    cache = _cache(512, 1)
    slots = torch.randperm(512, generator=torch.Generator().manual_seed(1))[:300]
    x8, top = dense._e4m3_rows(cache, slots, exact=False)
    assert x8.shape == (cudnn_fp8.bucket(300), KVH, D) and not x8[300:].float().any()
    assert top.item() == cache.scale.view(-1, KVH)[slots].float().max().item()
    assert torch.equal(x8[:300].float() * top.reshape(()), _requantized(cache, slots))


@pytest.mark.parametrize("n,n_keys", [(300, 300), (100, 300), (260, 517)])
def test_fp8_rows_against_attention_over_the_same_rounded_values(monkeypatch, n: int, n_keys: int) -> None:
    """A whole fresh row (one causal call) and later chunks (their own keys causally, the earlier
    ones in full, merged), scattered slots, through `attend_dense` as the backend calls it."""
    monkeypatch.setattr(dense.cudnn_fp8, "available", lambda device: True)
    cache_k, cache_v = _cache(1024, 2), _cache(1024, 3)
    g = torch.Generator().manual_seed(n)
    slots = torch.randperm(1024, generator=g)[:n_keys]
    q = torch.randn(n + 5, H, D, generator=g).to(torch.bfloat16)  # 5 rows of other queries first
    out = torch.zeros(n + 5, H * D, dtype=torch.bfloat16)
    call = Float32Call()
    dense.attend_dense(q, cache_k, cache_v, slots.to(torch.int32), 5, n + 5, 0, n_keys, out, call)
    b = cudnn_fp8.bucket(n)
    assert call.calls == ([(n, b, True)] if n == n_keys else [(n, b, True), (n, n_keys - n, False)])
    sq = cudnn_fp8.tensor_scale(q[5:])
    q_rounded = cudnn_fp8.to_e4m3(q[5:], sq).float() * sq.reshape(())
    want = _reference(q_rounded, _requantized(cache_k, slots), _requantized(cache_v, slots))
    got = out[5:].view(n, H, D).float()
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-2, err
    assert not out[:5].any()


def test_refused_shapes_go_back_to_bfloat16(monkeypatch) -> None:
    monkeypatch.setattr(dense.cudnn_fp8, "available", lambda device: True)

    class Refuses(cudnn_fp8.Fp8Attention):
        def attend_e4m3(self, *args, **kwargs):
            self.usable = False
            raise cudnn_fp8.Unsupported("no graph")

    cache_k, cache_v = _cache(512, 4), _cache(512, 5)
    slots = torch.arange(200, dtype=torch.int32)
    q = torch.randn(200, H, D, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    refused, plain = (torch.zeros(200, H * D, dtype=torch.bfloat16) for _ in range(2))
    att = Refuses()
    dense.attend_dense(q, cache_k, cache_v, slots, 0, 200, 0, 200, refused, att)
    dense.attend_dense(q, cache_k, cache_v, slots, 0, 200, 0, 200, plain)
    assert not att.usable and torch.equal(refused, plain)


def test_engine_takes_fp8_attention_with_fp8_weights_and_cache_on_one_device() -> None:
    def wants(**kw) -> bool:
        return fp8_attention(EngineConfig.from_kwargs(**kw).check())

    assert wants(quantization="fp8", kv_cache_dtype="fp8")
    assert not wants(quantization="fp8", kv_cache_dtype="fp8", fp8_attention="off")
    assert not wants(kv_cache_dtype="fp8")
    assert not wants(quantization="fp8")
    assert not wants(quantization="fp8", kv_cache_dtype="fp8", emulate_tp=2)
    with pytest.raises(ValueError, match="fp8_attention"):
        EngineConfig.from_kwargs(fp8_attention="on").check()
