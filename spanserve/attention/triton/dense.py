"""Fresh prompt rows of eager steps through torch's fused attention (cuDNN first).

A row that sees exactly its own keys, causally from position 0 and unrotated (the prefill of a
prompt with nothing cached), is plain causal self-attention: nothing about it needs the paged,
span-aware kernel. On Hopper, cuDNN's attention runs that shape ~1.5x faster than our Triton
kernel (16k tokens, Llama-3-8B heads: 3.64 vs 5.43 ms, `benchmarks/prefill_attention.py`), which
costs one gather of the row's K/V out of the paged cache, a few per cent of it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from spanserve.attention.kv_cache import Fp8Cache, read_rows

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # torch without the backend selector: its default choice
    sdpa_kernel = None

# Preferred first; the others are torch's fallbacks where cuDNN cannot take the inputs.
_ORDER = None if sdpa_kernel is None else [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                          SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    except TypeError:  # torch < 2.5 has no enable_gqa: expand the KV heads
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [1, H, n, D], k/v [1, KVH, n, D]: causal attention, [1, H, n, D]."""
    if _ORDER is None or q.device.type != "cuda":
        return _causal(q, k, v)
    try:
        ctx = sdpa_kernel(_ORDER, set_priority=True)
    except TypeError:  # torch < 2.6 has no priority order: its own
        ctx = sdpa_kernel(_ORDER)
    with ctx:
        return _causal(q, k, v)


def attend_dense(q: torch.Tensor, k_cache: "torch.Tensor | Fp8Cache", v_cache: "torch.Tensor | Fp8Cache",
                 key_slots: torch.Tensor, q_start: int, q_end: int, key_base: int, out: torch.Tensor) -> None:
    """out[q_start:q_end] = causal attention of the row's queries over its own keys, read from the
    cache (already written this step; an 8-bit one dequantized) through key_slots[key_base:key_base + n]."""
    n = q_end - q_start
    D = k_cache.shape[3]
    slots = key_slots[key_base:key_base + n].long()
    k, v = read_rows(k_cache, slots, q.dtype), read_rows(v_cache, slots, q.dtype)
    o = _sdpa(q[q_start:q_end].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
    out[q_start:q_end].view(n, -1, D).copy_(o[0].transpose(0, 1))
