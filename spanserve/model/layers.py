"""Small numeric building blocks of the Llama family: RMSNorm (RoPE is in `spanserve/rope.py`)."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 whatever the storage dtype, as the reference models do.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
