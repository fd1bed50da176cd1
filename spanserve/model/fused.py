"""Fused Triton kernels for the Llama elementwise ops: each is a drop-in for the eager op in
spanserve.model.layers, spanserve.rope or llama.py that reads every input once and writes every
output once.

All math is float32; results are rounded to the storage dtype only where the eager op rounds too
(rms_norm) or once at the end (the rest). Row strides are free so that views of the fused qkv and
gate_up projections need no copy; the last dimension must be unit-stride.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from spanserve.model.fp8 import Fp8Rows
from spanserve.model.fp8_kernels import quantize_tile

try:
    from triton import knobs

    _INTERPRET = bool(knobs.runtime.interpret)
except ImportError:  # triton < 3.4 reads the environment directly
    _INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _round(x, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    # The interpreter truncates float32 -> bfloat16 (and its "rtne" mode drops the carry), while
    # GPUs round to nearest even; emulating that in integer ops keeps CPU tests faithful to CUDA.
    if EMULATE_BF16 and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _rms_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, q_ptr, s_ptr, n_rows, inner, sxo, sxi, sro, sri, N, eps,
                HAS_RES: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, EMU: tl.constexpr,
                QUANT: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cmask = cols < N
    mask = (rows < n_rows)[:, None] & cmask[None, :]
    # Leading dims collapse to at most two (outer, inner) so strided head views need no copy.
    ro, ri = rows // inner, rows % inner
    x = tl.load(x_ptr + (ro * sxo + ri * sxi)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dst = rows[:, None] * N + cols[None, :]
    if HAS_RES:
        r_src = r_ptr + (ro * sro + ri * sri)[:, None] + cols[None, :]
        r = tl.load(r_src, mask=mask, other=0.0).to(tl.float32)
        # Normalise the rounded sum, exactly what eager code sees after `residual + x`.
        s = _round(x + r, x_ptr.dtype.element_ty, EMU)
        tl.store(sum_ptr + dst, s, mask=mask)
        x = s.to(tl.float32)
    # One division per row: the correctly rounded form costs nothing and matches torch's 1/sqrt.
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) / N + eps))
    normed = _round(x * inv[:, None], x_ptr.dtype.element_ty, EMU).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    out = _round(normed * w[None, :], out_ptr.dtype.element_ty, EMU)
    if QUANT:
        # the rounded rows, quantized as the FP8 product would quantize them after reading them back
        q, scale = quantize_tile(tl.where(mask, out.to(tl.float32), 0.0))
        tl.store(q_ptr + dst, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + rows, scale, mask=rows < n_rows)
    else:
        tl.store(out_ptr + dst, out, mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, sxt, sxh, sct, sst, HALF,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, EMU: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    mask = (hs < H)[:, None] & dmask[None, :]
    src = x_ptr + t * sxt + hs.to(tl.int64)[:, None] * sxh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # Both halves of cos/sin are read: callers may pass tables whose halves differ.
    c1 = tl.load(cos_ptr + t * sct + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * sct + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * sst + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * sst + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    dst = out_ptr + (t * H + hs.to(tl.int64))[:, None] * (2 * HALF) + d[None, :]
    dt = out_ptr.dtype.element_ty
    tl.store(dst, _round(x1 * c1 - x2 * s1, dt, EMU), mask=mask)
    tl.store(dst + HALF, _round(x2 * c2 + x1 * s2, dt, EMU), mask=mask)


@triton.jit
def _silu_times(g, u):
    # float32 in and out; both SiLU kernels, so the quantizing one quantizes the plain one's values
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, sgt, BLOCK: tl.constexpr, EMU: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(gu_ptr + t * sgt + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * sgt + I + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * I + cols, _round(_silu_times(g, u), out_ptr.dtype.element_ty, EMU), mask=mask)


@triton.jit
def _silu_mul_quant_kernel(gu_ptr, q_ptr, s_ptr, I, sgt, BLOCK: tl.constexpr, EMU: tl.constexpr):
    # One program per row: the row's amax needs all of it.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)[None, :]
    mask = cols < I
    g = tl.load(gu_ptr + t * sgt + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * sgt + I + cols, mask=mask, other=0.0).to(tl.float32)
    out = _round(_silu_times(g, u), gu_ptr.dtype.element_ty, EMU).to(tl.float32)
    q, scale = quantize_tile(out)
    tl.store(q_ptr + t * I + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + t + tl.arange(0, 1), scale)


def _check_last(name: str, t: torch.Tensor) -> None:
    if t.dim() == 0 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        raise ValueError(f"{name} must have a unit-stride last dimension, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")


def _row_layout(*ts: torch.Tensor) -> tuple[int, list[tuple[int, int]]]:
    """Collapse the leading dims of same-shape tensors into (outer, inner) with one stride pair
    per tensor; returns the inner size and the (outer, inner) strides."""
    groups: list[tuple[int, list[int]]] = []  # innermost first: (size, stride per tensor)
    for i in reversed(range(ts[0].dim() - 1)):
        size, st = ts[0].shape[i], [t.stride(i) for t in ts]
        if size == 1:
            continue
        if groups and all(s == gs * groups[-1][0] for s, gs in zip(st, groups[-1][1])):
            groups[-1] = (groups[-1][0] * size, groups[-1][1])
        else:
            groups.append((size, st))
    if len(groups) > 2:
        raise ValueError(f"leading dims of shape {tuple(ts[0].shape)} with strides "
                         f"{[t.stride() for t in ts]} do not collapse to two row strides")
    groups += [(1, [0] * len(ts))] * (2 - len(groups))
    return groups[0][0], [(o, i) for o, i in zip(groups[1][1], groups[0][1])]


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float, quant: bool = False) -> "tuple[torch.Tensor | Fp8Rows, torch.Tensor | None]":
    _check_last("x", x)
    N = x.shape[-1]
    if weight.shape != (N,) or (N > 1 and weight.stride(0) != 1):
        raise ValueError(f"weight must be a unit-stride [{N}] vector, got shape {tuple(weight.shape)}")
    if residual is not None:
        _check_last("residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                             f"x {tuple(x.shape)} {x.dtype}")
    # Same promotion as the eager `weight * normed`.
    dtype = torch.promote_types(x.dtype, weight.dtype)
    n_rows = x.numel() // max(N, 1)
    rows = None
    if quant:
        rows = Fp8Rows(torch.empty(n_rows, N, dtype=torch.float8_e4m3fn, device=x.device),
                       torch.empty(n_rows, 1, dtype=torch.float32, device=x.device), dtype)
        out = torch.empty(1, dtype=dtype, device=x.device)  # not written: gives the kernel the rows' dtype
    else:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if n_rows == 0 or N == 0:
        return rows if rows is not None else out, summed
    inner, strides = _row_layout(x, *([residual] if residual is not None else []))
    (sxo, sxi), (sro, sri) = strides[0], strides[-1]
    BLOCK = triton.next_power_of_2(N)
    ROWS = max(1, min(16, 1024 // BLOCK))  # keep small-N programs (per-head norms) busy
    q, s = (rows.q, rows.scale) if rows is not None else (out, out)
    _rms_kernel[(triton.cdiv(n_rows, ROWS),)](
        x, residual if residual is not None else x, weight, out, summed if summed is not None else out, q, s,
        n_rows, inner, sxo, sxi, sro, sri, N, eps, HAS_RES=residual is not None, BLOCK=BLOCK,
        ROWS=ROWS, EMU=_INTERPRET, QUANT=quant, num_warps=min(8, max(1, BLOCK * ROWS // 256)))
    return rows if rows is not None else out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quant: bool = False) -> "torch.Tensor | Fp8Rows":
    """layers.rms_norm; x [..., N] with free leading strides (collapsible to two). Contiguous out;
    with `quant`, its rows [n, N] quantized for an FP8 projection instead (fp8.rows_of of it)."""
    return _norm(x, None, weight, eps, quant)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, quant: bool = False) -> "tuple[torch.Tensor | Fp8Rows, torch.Tensor]":
    """(rms_norm(residual + x), residual + x), both new contiguous tensors; inputs untouched.
    `quant`: the first quantized, as rms_norm's."""
    out, summed = _norm(x, residual, weight, eps, quant)
    assert summed is not None
    return out, summed


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope.apply_rotary; x [T, heads, D] (free T/head strides), cos/sin [T, D]. Contiguous out."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, heads, head_dim], got shape {tuple(x.shape)}")
    T, H, D = x.shape
    if D % 2:
        raise ValueError(f"head_dim must be even, got {D}")
    _check_last("x", x)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (T, D):
            raise ValueError(f"{name} must be [{T}, {D}], got shape {tuple(t.shape)}")
        _check_last(name, t)
    if cos.dtype != sin.dtype:
        raise ValueError(f"cos and sin dtypes differ: {cos.dtype} vs {sin.dtype}")
    out = torch.empty((T, H, D), dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    if out.numel() == 0:
        return out
    BLOCK_D = triton.next_power_of_2(D // 2)
    BLOCK_H = min(triton.next_power_of_2(H), max(1, 2048 // BLOCK_D))
    _rotary_kernel[(T, triton.cdiv(H, BLOCK_H))](
        x, cos, sin, out, H, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), D // 2,
        BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, EMU=_INTERPRET, num_warps=4)
    return out


def silu_mul(gate_up: torch.Tensor, quant: bool = False) -> "torch.Tensor | Fp8Rows":
    """silu(gate) * up for gate_up [T, 2*I] = [gate | up] (free row stride). Contiguous [T, I];
    with `quant`, quantized for an FP8 projection instead (fp8.rows_of of it)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2*I], got shape {tuple(gate_up.shape)}")
    _check_last("gate_up", gate_up)
    T, I = gate_up.shape[0], gate_up.shape[1] // 2
    if quant:
        rows = Fp8Rows(torch.empty(T, I, dtype=torch.float8_e4m3fn, device=gate_up.device),
                       torch.empty(T, 1, dtype=torch.float32, device=gate_up.device), gate_up.dtype)
        if T and I:
            BLOCK = triton.next_power_of_2(I)
            # a warp per 512 columns: at 14336 columns (Llama-3-8B) 32 warps take 231 us for 8192 rows
            # on an H100, 16 take 254, the plain kernel 247
            _silu_mul_quant_kernel[(T,)](gate_up, rows.q, rows.scale, I, gate_up.stride(0), BLOCK=BLOCK,
                                         EMU=_INTERPRET, num_warps=max(4, min(32, BLOCK // 512)))
        return rows
    out = torch.empty((T, I), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    BLOCK = min(1024, triton.next_power_of_2(I))
    _silu_mul_kernel[(T, triton.cdiv(I, BLOCK))](
        gate_up, out, I, gate_up.stride(0), BLOCK=BLOCK, EMU=_INTERPRET, num_warps=4)
    return out
