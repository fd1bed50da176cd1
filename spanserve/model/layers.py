"""Small numeric building blocks of the Llama family: RMSNorm, float32 products of reduced-precision
operands (RoPE is in `spanserve/rope.py`)."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 whatever the storage dtype, as the reference models do.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def has_mm_out_dtype(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether torch.mm takes out_dtype=float32 for `dtype` operands here (cuBLAS does; probed
    once, outside any CUDA graph capture, where an exception would spoil the capture)."""
    a = torch.ones(2, 2, dtype=dtype, device=device)
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def mm_float32(a: torch.Tensor, b: torch.Tensor, native: bool) -> torch.Tensor:
    """a @ b with a float32 result from reduced-precision inputs: `native` (the GEMM's float32
    accumulator is kept, not rounded), else the rounded product in float32."""
    return torch.mm(a, b, out_dtype=torch.float32) if native else torch.mm(a, b).float()
