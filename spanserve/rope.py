"""RoPE math shared by the model (rotating queries and keys at their positions), attention backends
(rotating a cached key by its entry's delta when it is read) and the cache (eager repositioning).
A low module: it imports nothing from spanserve."""
from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: linear, llama3")


class Rotary:
    """RoPE by explicit positions. The same rotation serves queries, keys at write time and the
    deferred rotation of a cached key by its entry's delta (RoPE composes additively)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device):
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
