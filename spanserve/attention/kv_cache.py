"""A layer's paged KV cache, in the model's dtype or in 8 bits (float8 e4m3 with a scale per row).

An 8-bit cache holds each (slot, KV head) row of D values as e4m3 numbers and one scale, a power of
two, the smallest that brings the row's largest magnitude within e4m3's 448. Why per row and not
per block: decode appends one token at a time, so a block's later rows are not known when its first
are written, and a block-wide scale would have to grow by rewriting rows other requests may be
reading. Why a power of two: dividing by it is exact, so a row is rounded once (to e4m3, to nearest
even), its dequantized values q * scale are exact in bfloat16, and a kernel that folds the scale
into its scores or probabilities multiplies the very numbers it multiplies on the dequantized cache.
A scale costs 2 bytes per row (1.6% of a 128-wide row): 1.97x the tokens of bfloat16 per byte.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPE = torch.bfloat16
SCALE_BYTES = 2  # SCALE_DTYPE's
KV_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class Fp8Cache:
    """data [blocks, block_size, KVH, D] e4m3 and scale [blocks, block_size, KVH] bfloat16: a row
    reads data.float() * scale."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def scale_exponents(amax: torch.Tensor) -> torch.Tensor:
    """int32 k per row, the least with amax <= 448 * 2**k (within [-126, 126]), read from the
    float32 bits: amax = f * 2**e with f in [1, 2) needs k = e - 8, or e - 7 when f > 1.75."""
    bits = amax.float().view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127
    k = e - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    return k.clamp(-126, 126)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (e4m3 [..., D], bfloat16 scale [...]) with x ~ q * scale: the dense reference
    of what every write to an 8-bit cache stores."""
    xf = x.float()
    scale = torch.pow(2.0, scale_exponents(xf.abs().amax(-1)).float())
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.to(SCALE_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[..., None]).to(dtype)


def packed_dtype(dtype: torch.dtype) -> torch.dtype:
    """The element type of a pool of `dtype`'s blocks away from the device (tiers, tensor-parallel
    transfers): an 8-bit pool's rows are bytes, the D values then the scale's."""
    return torch.uint8 if dtype == FP8 else dtype


def packed_row(head_dim: int, dtype: torch.dtype) -> int:
    """Elements (of `packed_dtype`) in one packed (slot, KV head) row of a pool of `dtype`."""
    return head_dim + SCALE_BYTES if dtype == FP8 else head_dim


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of a pool asked for as `kv_cache_dtype` by a model of `model_dtype`."""
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return FP8 if kv_cache_dtype == "fp8" else model_dtype


def read_rows(cache: "torch.Tensor | Fp8Cache", slots: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The rows at flat `slots`, [n, KVH, D], dequantized (in `dtype`, default: the cache's own, or
    float32 for an 8-bit cache)."""
    KVH, D = cache.shape[2], cache.shape[3]
    if isinstance(cache, Fp8Cache):
        q = cache.data.view(-1, KVH, D)[slots]
        return dequantize(q, cache.scale.view(-1, KVH)[slots], dtype or torch.float32)
    rows = cache.view(-1, KVH, D)[slots]
    return rows if dtype is None else rows.to(dtype)


def write_rows(cache: "torch.Tensor | Fp8Cache", slots: torch.Tensor, x: torch.Tensor) -> None:
    """Store x [n, KVH, D] at flat `slots` (quantized for an 8-bit cache)."""
    KVH, D = cache.shape[2], cache.shape[3]
    if isinstance(cache, Fp8Cache):
        q, s = quantize(x)
        cache.data.view(-1, KVH, D)[slots] = q
        cache.scale.view(-1, KVH)[slots] = s
    else:
        cache.view(-1, KVH, D)[slots] = x
