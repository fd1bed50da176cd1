"""The KV write of an 8-bit cache: each (token, KV head) row quantized to float8 e4m3 with its
own power-of-two scale, exactly as `attention/kv_cache.quantize` does (the rounding is done in
integer and exact float arithmetic: the Triton interpreter's own float -> e4m3 conversion does
not round as the GPU's does, and the CPU tests run the interpreter)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _pow2(e):
    """2**e for int32 e in [-126, 127], from its float32 bits (exact, no transcendental)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_rounded(y):
    """y (float32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, as float32: an
    exact value, so any conversion to e4m3 keeps it (the Triton interpreter's own rounding does
    not match the GPU's). A normal e4m3 number of exponent e has a quantum of 2**(e - 3); below
    2**-6 the subnormals share 2**-9."""
    a = tl.abs(y)  # rounded as a magnitude: what underflows keeps its sign (-0.0)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    t = a * _pow2(3 - e)  # exact: a power of two
    f = tl.floor(t)
    rest = t - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (rest > 0.5) | ((rest == 0.5) & odd)
    r = (f + tl.where(up, 1.0, 0.0)) * _pow2(e - 3)
    sign = (y.to(tl.int32, bitcast=True) >> 31) << 31  # y's sign bit (a negation of 0.0 may fold to +0.0)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows(x):
    """x [rows, D] float32 -> (e4m3 values as exact float32, float32 power-of-two scale [rows]):
    attention/kv_cache.quantize, bit for bit."""
    amax = tl.max(tl.abs(x), 1)
    bits = amax.to(tl.int32, bitcast=True)
    k = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.minimum(tl.maximum(k, -126), 126)
    y = x * _pow2(-k)[:, None]
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return _e4m3_rounded(y), _pow2(k)


@triton.jit
def kv_write_fp8_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slots_ptr,
    n_tokens, stride_kt, stride_vt,
    KVH: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """kv_write_kernel for an 8-bit cache: KV head `program_id(1)` of BLOCK_T tokens, each row
    quantized with its own scale (attention/kv_cache.py); a slot < 0 is not written."""
    tt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    dd = tl.arange(0, D)
    slot = tl.load(slots_ptr + tt, mask=tt < n_tokens, other=-1).to(tl.int64)
    t_ok = slot >= 0
    tt64 = tt.to(tl.int64)
    for which in tl.static_range(2):
        if which == 0:
            src, dst, dst_s, stride = k_ptr, k_cache_ptr, k_scale_ptr, stride_kt
        else:
            src, dst, dst_s, stride = v_ptr, v_cache_ptr, v_scale_ptr, stride_vt
        x = tl.load(src + tt64[:, None] * stride + h * D + dd[None, :], mask=t_ok[:, None], other=0.0)
        q, scale = _quantize_rows(x.to(tl.float32))
        row = slot * KVH + h
        tl.store(dst + row[:, None] * D + dd[None, :], q.to(dst.dtype.element_ty), mask=t_ok[:, None])
        tl.store(dst_s + row, scale.to(dst_s.dtype.element_ty), mask=t_ok)
