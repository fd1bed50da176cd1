"""Attention on the FP8 tensor cores in Triton 3.6's `tl.dot`: does it beat bfloat16?

An 8-bit cache already holds K and V as e4m3 codes with a power-of-two scale per (token, KV head)
row, so a fresh prompt's causal attention could run either product in e4m3, as FlashAttention-3
does. This script's kernel is one FlashAttention-style loop (online softmax, causal split into an
unmasked and a masked part, longest programs first) whose two products each run in e4m3 or bf16:
- QK in e4m3: Q rounded per (token, head) row with a power-of-two scale as the cache rounds its
  rows; S = (Q8 . K8^T) * q_scale[row] * k_scale[key];
- PV in e4m3: P's columns multiplied by v_scale[key] / c (c the tile's largest; powers of two, so
  exact), rounded to e4m3, against V's codes copied transposed [KVH, D, keys] (Hopper's 8-bit
  products need their operands contiguous along the reduction); O accumulates in units of c;
- either in bf16: the operand dequantized (exact: kv_cache.py).
Timed on one fresh row of `--tokens` (Llama-3-8B heads) and on its second half over all its keys
(a fresh prompt's later chunk), beside cuDNN's bf16 attention (the engine's dense rows) and the
engine's paged Triton kernel. Errors against float32 attention over the dequantized cache, with Q
as each variant multiplies it (rounded or not) and with Q as given.

    python benchmarks/experiments/fp8_dense_attention_gpu.py          # one GPU; results/fp8_dense_attention_gpu.json
    python benchmarks/experiments/fp8_dense_attention_gpu.py --dry    # CPU (Triton's interpreter), errors only
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

if "--dry" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import format_table, write_json  # noqa: E402
from spanserve.attention.kv_cache import Fp8Cache, dequantize, quantize  # noqa: E402
from spanserve.attention.triton.kv_quant import _e4m3_rounded, _quantize_rows  # noqa: E402

PRECISIONS = [(True, True), (True, False), (False, True), (False, False)]  # (QK in e4m3, PV in e4m3)
TILES = [(128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 8, 3)]  # BLOCK_M, BLOCK_N, warps, stages


@triton.jit
def _tiles(acc, l_i, m_i, u, qq, row_scale, q_pos, k_ptr, v_ptr, ks_ptr, vs_ptr, lo, hi, n_keys, stride_vd,
           D: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, EXACT: tl.constexpr,
           QK8: tl.constexpr, PV8: tl.constexpr):
    """Online softmax over key tiles [lo, hi); `CAUSAL` masks keys past each query's position.
    acc holds O * l in units of u (a power of two)."""
    dd = tl.arange(0, D)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < n_keys
        kk = tl.load(k_ptr + cols[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
        if EXACT and not QK8:  # the interpreter's 16-bit products are wrong; float32 holds theirs exactly
            kk = kk.to(tl.float32)
        s = tl.dot(qq, tl.trans(kk)) * row_scale[:, None]
        if QK8:
            s = s * tl.load(ks_ptr + cols, mask=ok, other=0.0).to(tl.float32)[None, :]
        if CAUSAL:
            s = tl.where((cols[None, :] <= q_pos[:, None]) & ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if PV8:
            vs = tl.load(vs_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            c = tl.maximum(tl.max(vs, 0), 1e-30)
            pw = p * (vs / c)[None, :]
            if EXACT:
                pw = _e4m3_rounded(pw)
            vt = tl.load(v_ptr + dd[:, None] * stride_vd + cols[None, :], mask=ok[None, :], other=0.0)
            acc = acc * (alpha * (u / c))[:, None] + tl.dot(pw.to(tl.float8e4nv), tl.trans(vt))
            u = c
        else:
            v = tl.load(v_ptr + cols[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
            pv = p.to(v.dtype)
            if EXACT:
                pv, v = pv.to(tl.float32), v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(pv, v)
        m_i = m_new
    return acc, l_i, m_i, u


@triton.jit
def fp8_dense_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr,
    n_q, n_keys, stride_qt, stride_qh, stride_ot, stride_kh, stride_vh, stride_vd, stride_sh, qk_scale,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr,
    QK8: tl.constexpr, PV8: tl.constexpr,
):
    """Program (m, h): BLOCK_M queries of head h, the last n_q of the row's n_keys positions.
    k, v and their scales [KVH, n] as `dense_operands` lays them out for QK8 / PV8; out [n_q, H * D]."""
    # Longest programs (latest queries, most keys) first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dd = tl.arange(0, D)
    row_ok = rows < n_q
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + dd[None, :], mask=row_ok[:, None], other=0.0)
    if QK8:
        qv, q_scale = _quantize_rows(q.to(tl.float32))
        qq = qv.to(tl.float8e4nv)
        row_scale = q_scale * qk_scale
    else:
        qq = q.to(tl.float32) if EXACT else q
        row_scale = tl.zeros([BLOCK_M], dtype=tl.float32) + qk_scale
    q0 = n_keys - n_q  # position of the first query
    q_pos = q0 + rows
    k_ptr += kvh.to(tl.int64) * stride_kh
    v_ptr += kvh.to(tl.int64) * stride_vh
    ks_ptr += kvh * stride_sh
    vs_ptr += kvh * stride_sh
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    u = 1.0
    # Keys before the block's first query are visible to all its rows: no mask there.
    full = ((q0 + pid_m * BLOCK_M) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(q0 + (pid_m + 1) * BLOCK_M, n_keys)
    acc, l_i, m_i, u = _tiles(acc, l_i, m_i, u, qq, row_scale, q_pos, k_ptr, v_ptr, ks_ptr, vs_ptr, 0, full,
                              n_keys, stride_vd, D, BLOCK_N, False, EXACT, QK8, PV8)
    acc, l_i, m_i, u = _tiles(acc, l_i, m_i, u, qq, row_scale, q_pos, k_ptr, v_ptr, ks_ptr, vs_ptr, full, hi,
                              n_keys, stride_vd, D, BLOCK_N, True, EXACT, QK8, PV8)
    o = acc * (u / l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * D + dd[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def dense_operands(k_cache: Fp8Cache, v_cache: Fp8Cache, slots: torch.Tensor, dtype: torch.dtype,
                   qk8: bool, pv8: bool) -> tuple[torch.Tensor, ...]:
    """The row's keys and values gathered from the cache by `slots`, as the kernel reads them: K
    [KVH, n, D] (e4m3 codes with `qk8`, else dequantized to `dtype`), V the same, or with `pv8`
    e4m3 codes transposed [KVH, D, n]; then the K and V scales [KVH, n]."""
    KVH, D = k_cache.shape[2], k_cache.shape[3]
    kc, vc = k_cache.data.view(-1, KVH, D)[slots], v_cache.data.view(-1, KVH, D)[slots]
    ks, vs = k_cache.scale.view(-1, KVH)[slots], v_cache.scale.view(-1, KVH)[slots]
    k = kc if qk8 else dequantize(kc, ks, dtype)
    v = vc.permute(1, 2, 0) if pv8 else dequantize(vc, vs, dtype).transpose(0, 1)
    return k.transpose(0, 1).contiguous(), v.contiguous(), ks.t().contiguous(), vs.t().contiguous()


def attend(q: torch.Tensor, k_cache: Fp8Cache, v_cache: Fp8Cache, key_slots: torch.Tensor,
                     q_start: int, q_end: int, key_base: int, n_keys: int, out: torch.Tensor,
                     qk8: bool, pv8: bool, tiles: tuple[int, int, int, int] = TILES[0]) -> None:
    """out[q_start:q_end] = causal attention of the row's queries (the last q_end - q_start of its
    n_keys positions) over its keys, key_slots[key_base:key_base + n_keys] of an 8-bit cache;
    `qk8` / `pv8`: which products run in e4m3."""
    n_q = q_end - q_start
    H, D = q.shape[1], q.shape[2]
    KVH = k_cache.shape[2]
    if n_q == 0:
        return
    if not 0 < n_q <= n_keys:
        raise ValueError(f"a dense row's {n_q} queries must be the last of its {n_keys} keys")
    k, v, ks, vs = dense_operands(k_cache, v_cache, key_slots[key_base:key_base + n_keys].long(), q.dtype, qk8, pv8)
    qr, o = q[q_start:q_end], out[q_start:q_end]
    # The softmax runs in base 2: fold log2(e) into the score scale.
    qk_scale = (1.0 / math.sqrt(D)) * 1.4426950408889634
    interpret = q.device.type != "cuda"
    bm, bn, warps, stages = tiles if not interpret else (16, 16, 4, 1)
    fp8_dense_kernel[(triton.cdiv(n_q, bm), H)](
        qr, k, v, ks, vs, o, n_q, n_keys, qr.stride(0), qr.stride(1), o.stride(0),
        k.stride(0), v.stride(0), v.stride(1), ks.stride(0), qk_scale,
        G=H // KVH, D=D, BLOCK_M=bm, BLOCK_N=bn, EXACT=interpret, QK8=qk8, PV8=pv8,
        num_warps=warps, num_stages=stages,
    )


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 causal attention of q [n_q, H, D] (the last n_q of the keys' positions) over k, v
    [n, KVH, D], one head at a time: [n_q, H * D]."""
    n_q, H, D = q.shape
    n, KVH = k.shape[0], k.shape[1]
    out = torch.empty(n_q, H, D, device=q.device)
    visible = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - n_q, n, device=q.device)[:, None]
    for h in range(H):
        s = (q[:, h].float() @ k[:, h * KVH // H].float().T) / math.sqrt(D)
        out[:, h] = s.masked_fill(~visible, float("-inf")).softmax(-1) @ v[:, h * KVH // H].float()
    return out.reshape(n_q, H * D)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _inputs(T: int, H: int, KVH: int, D: int, dev: torch.device, seed: int):
    """Random q, and K and V rows of magnitudes 1-4x (so their scales differ), quantized into an
    8-bit cache of 16-slot blocks."""
    g = torch.Generator(device=dev).manual_seed(seed)
    q = (torch.randn(T, H, D, generator=g, device=dev) * 2).to(torch.bfloat16)
    kv = [torch.randn(T, KVH, D, generator=g, device=dev) * (1 + 3 * torch.rand(T, KVH, 1, generator=g, device=dev))
          for _ in range(2)]
    caches = []
    for x in kv:
        c, s = quantize(x)
        caches.append(Fp8Cache(c.view(-1, 16, KVH, D), s.view(-1, 16, KVH)))
    return q, caches[0], caches[1]


def errors(T: int, H: int, KVH: int, D: int, dev: torch.device) -> list[list]:
    """Each precision's error on a fresh row and on its second half, against the reference with Q
    rounded as the variant rounds it, and with Q as given."""
    q, kc, vc = _inputs(T, H, KVH, D, dev, 1)
    slots = torch.arange(T, device=dev, dtype=torch.int32)
    k = dequantize(kc.data.view(T, KVH, D), kc.scale.view(T, KVH))
    v = dequantize(vc.data.view(T, KVH, D), vc.scale.view(T, KVH))
    q_rounded = dequantize(*quantize(q.float()))
    rows = []
    for first in (0, T // 2):
        exact = reference(q[first:], k, v)
        rounded = reference(q_rounded[first:], k, v)
        for qk8, pv8 in PRECISIONS:
            out = torch.empty(T - first, H * D, device=dev, dtype=torch.bfloat16)
            attend(q[first:], kc, vc, slots, 0, T - first, 0, T, out, qk8, pv8)
            rows.append([f"{T - first} queries over {T} keys", _name(qk8, pv8),
                         _rel(out, rounded if qk8 else exact), _rel(out, exact)])
    return rows


def _name(qk8: bool, pv8: bool) -> str:
    return f"QK {'e4m3' if qk8 else 'bf16'}, PV {'e4m3' if pv8 else 'bf16'}"


def timings(T: int, H: int, KVH: int, D: int, dev: torch.device) -> tuple[list[list], dict]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from spanserve.attention.plan import AttentionPlan, Row
    from spanserve.attention.triton import TritonBackend
    from spanserve.rope import Rotary

    q, kc, vc = _inputs(T, H, KVH, D, dev, 0)
    slots = torch.arange(T, device=dev, dtype=torch.int32)
    half = T // 2
    flops = {0: 4 * T * T / 2 * H * D, half: 4 * T * T / 2 * H * D * 3 / 4}  # the second half sees 3/4 of the scores
    rows, res = [], {}

    def timed(what: str, first: int, fn) -> None:
        fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        rows.append([what, "whole row" if first == 0 else "second half", ms, flops[first] / ms / 1e9])
        res[f"{what}, {rows[-1][1]}"] = {"ms": ms, "tflops": rows[-1][3]}

    k = dequantize(kc.data, kc.scale, torch.bfloat16)
    v = dequantize(vc.data, vc.scale, torch.bfloat16)
    kh, vh = (x.view(T, KVH, D).transpose(0, 1)[None] for x in (k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(0, 1)[None], kh, vh, is_causal=True, enable_gqa=True)
    timed("cuDNN, bf16 (the engine's fresh rows)", 0, cudnn)
    be = TritonBackend(dense_prefill=0)
    rot = Rotary(D, 500000.0, None, dev)
    for first in (0, half):
        pos = torch.arange(first, T, device=dev)
        lay = be.prepare(AttentionPlan([Row(0, T - first, pos, slots.long())], pos, pos.clone()), rot, 16)
        timed("paged Triton kernel, bf16 cache", first, lambda lay=lay, first=first: be.attend(lay, q[first:], k, v))
    for qk8, pv8 in PRECISIONS:
        timed(f"operands of {_name(qk8, pv8)}", 0, lambda qk8=qk8, pv8=pv8: dense_operands(kc, vc, slots.long(), q.dtype, qk8, pv8))
    for qk8, pv8 in PRECISIONS:
        for tiles in TILES:
            for first in (0, half):
                out = torch.empty(T - first, H * D, device=dev, dtype=torch.bfloat16)
                timed(f"this kernel, {_name(qk8, pv8)}, {tiles[0]}x{tiles[1]} w{tiles[2]} s{tiles[3]}", first,
                      lambda qk8=qk8, pv8=pv8, tiles=tiles, first=first, out=out:
                      attend(q[first:], kc, vc, slots, 0, T - first, 0, T, out, qk8, pv8, tiles))
    return rows, res


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="the row timed")
    ap.add_argument("--check-tokens", type=int, default=4096, help="the row whose errors are measured")
    ap.add_argument("--dry", action="store_true", help="CPU through Triton's interpreter: tiny shapes, errors only")
    ap.add_argument("--out", default="fp8_dense_attention_gpu.json")
    args = ap.parse_args(argv)
    if args.dry:
        err = errors(48, 4, 2, 32, torch.device("cpu"))
        print(format_table(["row", "products", "err vs reference (Q as multiplied)", "err vs reference"], err))
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --dry)")
    dev = torch.device("cuda")
    H, KVH, D = 32, 8, 128
    err = errors(args.check_tokens, H, KVH, D, dev)
    rows, res = timings(args.tokens, H, KVH, D, dev)
    print(format_table(["row", "products", "err vs reference (Q as multiplied)", "err vs reference"], err))
    print(format_table(["kernel", "queries", "ms", "TFLOP/s"], rows))
    path = write_json(args.out, {"benchmark": "fp8_dense_attention_gpu", "device": torch.cuda.get_device_name(0),
                                 "tokens": args.tokens, "check_tokens": args.check_tokens,
                                 "errors": [dict(zip(["row", "products", "err_q_as_multiplied", "err"], r)) for r in err],
                                 "timings": res})
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
