"""Triton kernels behind `fp8.fp8_linear` on CUDA: the weight-only product of a small decode step
(up to 16 rows), and the per-token quantization of the activations for torch._scaled_mm.

The product streams q once: each program reads BLOCK_N whole rows, BLOCK_K columns at a time, and
multiplies them with x's rows (padded to 16 with zeros) on the tensor cores, W [BLOCK_N, BLOCK_K]
@ x.T, accumulating in float32; the row scale comes last. Why tensor cores for a matrix-vector
product: the FMA kernel (gemv.py's, with FP8 loads) reached 1.4-1.9 TB/s of weight on an H100;
converted to fp16 and fed to the tensor cores the same weights stream at 1.6-2.6 TB/s, as fast at
16 rows as at one. Neither is bound by its conversions: an FMA kernel converting with integer
shifts alone is no faster, and on qkv, o and gate_up this kernel is within 2-9% of one that only
reads its tiles (benchmarks/experiments/fp8_gemv_bounds_gpu.py). fp16 holds e4m3 exactly; x is
scaled by X_SHIFT (a power of two, undone with the row scale) so that fp16's range holds it
exactly (|x| from 2^-8 to 2^22; smaller values lose low bits). x stays unquantized: a small
step's time is the weight's bytes. No split along K: one launch, and a weight row's result
depends on K and the tile only, so a column-parallel shard's outputs equal the whole's."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8_MAX: tl.constexpr = tl.constexpr(448.0)
INV_FP8_MAX: tl.constexpr = tl.constexpr(1.0 / 448.0)  # multiplied, as torch divides by a scalar on CUDA
# x times this is in fp16's normal range for |x| from 2^-8 up to 2^22
X_SHIFT: tl.constexpr = tl.constexpr(2.0 ** -6)


@triton.jit
def _scale_of(amax):
    # fp8.quantize_rows' arithmetic: amax times 1/448; an all-zero row gets scale 1
    return tl.where(amax > 0, amax * INV_FP8_MAX, 1.0)


@triton.jit
def _codes(x, scale):
    # x / scale divided exactly (div_rn) and clamped: the e4m3 values as float32, ready to store
    return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)


@triton.jit
def quantize_tile(x):
    """Each row of x [R, C] (float32; masked columns zero) over its own amax: (the e4m3 values as
    float32, clamped, ready to store; the scales [R]), as fp8.quantize_rows computes them."""
    scale = _scale_of(tl.max(tl.abs(x), axis=1))
    return _codes(x, scale[:, None]), scale


@triton.jit
def _gemv_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, HAS_BIAS: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    ms = tl.arange(0, 16)
    mmask = ms < M
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * K
    x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            xmask = mmask[:, None]
            wmask = rmask[:, None]
        else:
            kmask = (k + cols) < K
            xmask = mmask[:, None] & kmask[None, :]
            wmask = rmask[:, None] & kmask[None, :]
        x = (tl.load(x_rows + k + cols[None, :], mask=xmask, other=0.0).to(tl.float32) * X_SHIFT).to(tl.float16)
        w = tl.load(q_rows + k + cols[None, :], mask=wmask, other=0.0).to(tl.float16)
        acc = tl.dot(w, tl.trans(x), acc)
    y = acc * (tl.load(s_ptr + rows, mask=rmask, other=0.0) * (1.0 / X_SHIFT))[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    out = y_ptr + ms.to(tl.int64)[None, :] * stride_ym + rows[:, None]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & mmask[None, :])


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    # One program per row: its amax, then the row divided by amax / 448 (_scale_of, _codes): the
    # bytes equal fp8.quantize_rows'.
    # ONE_PASS: the whole row is one tile, held between the two steps (read once, not twice).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    if ONE_PASS:
        kmask = cols < K
        x = tl.load(x_row + cols[None, :], mask=kmask[None, :], other=0.0).to(tl.float32)
        q, scale = quantize_tile(x)
        tl.store(s_ptr + row + tl.arange(0, 1), scale)
        tl.store(q_ptr + row * K + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=kmask[None, :])
    else:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            x = tl.load(x_row + k + cols, mask=(k + cols) < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = _scale_of(tl.max(amax, axis=0))
        tl.store(s_ptr + row, scale)
        for k in range(0, K, BLOCK_K):
            kmask = (k + cols) < K
            x = tl.load(x_row + k + cols, mask=kmask, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * K + k + cols, _codes(x, scale).to(q_ptr.dtype.element_ty), mask=kmask)


@dataclass(frozen=True)
class Fp8GemvConfig:
    block_n: int = 32  # at least 16: the tensor cores' smallest tile
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


# Measured on an H100 over Llama-3-8B's projections at one row (benchmarks/experiments/
# fp8_linear_gpu.py --tune and a wider sweep of the same kind): 256
# columns a step in four stages is best or within 3% for K = 4096; down's K = 14336 wants 1024.
SHORT_K = Fp8GemvConfig()
LONG_K = Fp8GemvConfig(block_k=1024)


def config_for(K: int) -> Fp8GemvConfig:
    return LONG_K if K > 8192 else SHORT_K


def gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, cfg: Fp8GemvConfig | None = None) -> torch.Tensor:
    """(x [M, K] @ q[N, K].T) * scale (+ bias) -> [M, N], M <= 16; q float8_e4m3fn contiguous."""
    M, K = x.shape
    N = q.shape[0]
    if M > 16 or q.shape[1] != K or not q.is_contiguous():
        raise ValueError(f"fp8 gemv takes up to 16 rows against a contiguous [N, {K}] weight; got x {tuple(x.shape)}, "
                         f"q {tuple(q.shape)}")
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = cfg or config_for(K)
    _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](
        x, q, scale, bias if bias is not None else scale, y, M, N, K, x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=K % cfg.block_k == 0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def quantize_rows(x: torch.Tensor, block_k: int = 1024, one_pass_max: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_rows in one launch: (q [M, K] float8_e4m3fn, scale [M, 1] float32). Rows of up
    to `one_pass_max` columns are read once (a 16k prefill's 256 calls: 21.6 ms when every row was
    read twice, on an H100); longer ones in tiles of `block_k`, twice."""
    M, K = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        whole = triton.next_power_of_2(K)
        one_pass = whole <= one_pass_max
        tile = whole if one_pass else min(block_k, whole)
        _quantize_rows_kernel[(M,)](x, q, s, K, x.stride(0), BLOCK_K=tile, ONE_PASS=one_pass,
                                    num_warps=max(4, min(16, tile // 1024)))
    return q, s
