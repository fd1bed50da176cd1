"""Fresh prompt rows of eager steps through torch's fused attention (cuDNN first).

A row whose queries are the last of its keys, seen causally from position 0 and unrotated (the
prefill of a prompt with nothing cached, or a later chunk of one), is plain causal attention:
nothing about it needs the paged, span-aware kernel. On Hopper, cuDNN's attention runs that shape
~1.5x faster than our Triton kernel (16k tokens, Llama-3-8B heads: 3.71 vs 5.41 ms,
`benchmarks/experiments/prefill_attention.py`), which costs one gather of the row's K/V out of the
paged cache, a few per cent of it.

torch's causal mask is aligned to the first key, so a later chunk (queries at positions
first..n-1) is two calls: its own keys causally, the keys before it in full, merged by their
log-sum-exps. cuDNN returns those through a private torch op; where that op is missing or refuses
the inputs, the chunk goes through SDPA with an explicit mask instead (slower, same result).
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
_CUDNN_LSE = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
# What this torch's cuDNN op takes, learnt from the first chunk that tries: grouped heads in the
# call, and the call at all. Without it every layer of every chunk would raise again.
_cudnn_takes = {"call": _CUDNN_LSE is not None, "grouped": True}


def _gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V with their heads repeated up to Q's (for calls without enable_gqa)."""
    g = q.shape[1] // k.shape[1]
    return (k, v) if g == 1 else (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    except TypeError:  # torch < 2.5 has no enable_gqa: expand the KV heads
        return F.scaled_dot_product_attention(q, *_gqa(q, k, v), is_causal=True)


def _preferred():
    if _ORDER is None:
        return None
    try:
        return sdpa_kernel(_ORDER, set_priority=True)
    except TypeError:  # torch < 2.6 has no priority order: its own
        return sdpa_kernel(_ORDER)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [1, H, n, D], k/v [1, KVH, n, D]: causal attention, [1, H, n, D]."""
    ctx = _preferred() if q.device.type == "cuda" else None
    if ctx is None:
        return _causal(q, k, v)
    with ctx:
        return _causal(q, k, v)


def _with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN attention of q over k/v (causal from the first key or full) and each query's natural
    log-sum-exp of scores, [1, H, n, D] and float32 [1, H, n]."""
    out = None
    if _cudnn_takes["grouped"]:
        try:
            out = _CUDNN_LSE(q, k, v, None, True, 0.0, causal, False)
        except RuntimeError:  # not with grouped heads in the call: expand them, here and from now on
            _cudnn_takes["grouped"] = False
    if out is None:
        out = _CUDNN_LSE(q, *_gqa(q, k, v), None, True, 0.0, causal, False)
    return out[0], out[1].reshape(q.shape[:3]).float()


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [1, H, m, D], the last m of k/v's [1, KVH, n, D] positions: causal attention through an
    explicit mask."""
    m, n = q.shape[2], k.shape[2]
    pos = torch.arange(n, device=q.device)
    visible = pos[None, :] <= pos[n - m:, None]
    return F.scaled_dot_product_attention(q, *_gqa(q, k, v), attn_mask=visible)


def _tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """As `_masked`: on CUDA its own keys causally and the earlier ones in full through cuDNN,
    merged by their log-sum-exps."""
    first = k.shape[2] - q.shape[2]
    if q.device.type != "cuda" or not _cudnn_takes["call"]:
        return _masked(q, k, v)
    try:
        o_own, lse_own = _with_lse(q, k[:, :, first:], v[:, :, first:], True)
        o_pre, lse_pre = _with_lse(q, k[:, :, :first], v[:, :, :first], False)
    except RuntimeError:  # this torch's cuDNN op takes other arguments: the mask from now on
        _cudnn_takes["call"] = False
        return _masked(q, k, v)
    return merge(o_own, lse_own.unsqueeze(-1), o_pre, lse_pre.unsqueeze(-1)).to(q.dtype)


def merge(o_own: torch.Tensor, lse_own: torch.Tensor, o_pre: torch.Tensor, lse_pre: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint key sets from each one's output and natural log-sum-exps of
    scores (shaped to broadcast against the output): float32."""
    top = torch.maximum(lse_own, lse_pre)
    w_own, w_pre = (lse_own - top).exp_(), (lse_pre - top).exp_()
    total = w_own + w_pre
    return torch.addcmul(o_own.float() * (w_own / total), o_pre.float(), w_pre / total)


def attend_dense(q: torch.Tensor, k_cache: "torch.Tensor | Fp8Cache", v_cache: "torch.Tensor | Fp8Cache",
                 key_slots: torch.Tensor, q_start: int, q_end: int, key_base: int, n_keys: int,
                 out: torch.Tensor) -> None:
    """out[q_start:q_end] = causal attention of the row's queries, the last of its n_keys
    positions, over its keys read from the cache (already written this step; an 8-bit one
    dequantized) through key_slots[key_base:key_base + n_keys]."""
    n = q_end - q_start
    D = k_cache.shape[3]
    slots = key_slots[key_base:key_base + n_keys].long()
    k, v = read_rows(k_cache, slots, q.dtype), read_rows(v_cache, slots, q.dtype)
    qh, kh, vh = q[q_start:q_end].transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    o = _sdpa(qh, kh, vh) if n == n_keys else _tail(qh, kh, vh)
    out[q_start:q_end].view(n, -1, D).copy_(o[0].transpose(0, 1))
