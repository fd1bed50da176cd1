"""x @ W.T for one row (batch-1 decode) as a Triton kernel that streams W once.

At batch 1 a projection is a matrix-vector product: all time is reading W. cuBLAS picks split-K
kernels (and a second pass that adds the splits) for the mid-sized matrices a tensor-parallel rank
holds, and reaches about two thirds of the bandwidth it reaches on the whole model's matrices.
Here each program reads BLOCK_N whole rows of W, BLOCK_K columns at a time, and keeps a float32
partial per (row, column lane); one tree sum over the lanes ends it. No split along K, so one
launch, and a row's result depends only on K and the tile shape: a column-parallel shard's outputs
equal the unsharded matrix's bit for bit."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from spanserve.model.layers import mm_float32


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k + cols).to(tl.float32)
        w = tl.load(w_rows + k + cols[None, :], mask=rmask[:, None], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rmask)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 2
    block_k: int = 1024
    num_warps: int = 4
    num_stages: int = 2


# H100, Llama-3-8B's projections whole and at TP=2 (benchmarks/gemv_gpu.py): 1.06-1.27x cuBLAS.
# One tile for every shape, so that a row's result never depends on how many rows W has.
DEFAULT = GemvConfig()


def gemv(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig = DEFAULT, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [1, K] @ w[N, K].T -> [1, N]; K a multiple of cfg.block_k, both contiguous."""
    N, K = w.shape
    assert x.shape == (1, K) and x.is_contiguous() and w.is_contiguous() and K % cfg.block_k == 0
    y = torch.empty(1, N, dtype=out_dtype or x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, cfg.block_n),)](x, w, y, N, K, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def fits(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig = DEFAULT) -> bool:
    """Whether `linear` takes the kernel: one row of a 2-byte type on a GPU, K a whole number of tiles."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and w.dtype == x.dtype and x.is_contiguous() and w.is_contiguous() and x.shape[1] == w.shape[1]
            and x.shape[1] % cfg.block_k == 0)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the kernel for a single row."""
    if bias is None and fits(x, w):
        return gemv(x, w)
    return F.linear(x, w, bias)


def linear_float32(x: torch.Tensor, w: torch.Tensor, native: bool) -> torch.Tensor:
    """x @ w.T with a float32 result (the LM head's logits; `mm_float32`)."""
    if fits(x, w):
        return gemv(x, w, out_dtype=torch.float32)
    return mm_float32(x, w.t(), native)
