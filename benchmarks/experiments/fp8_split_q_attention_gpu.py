"""Attention over an 8-bit cache on the FP8 tensor cores without rounding Q or P to 3 mantissa
bits: each is split into a high and a low e4m3 part (x = hi * s_hi + lo * s_lo, per-row
power-of-two scales), so a product in e4m3 costs two FP8 matrix instructions, the time of one in
bf16, and K (and V) are read as stored. One warm-RAG layer (96 query tokens x 32 heads, G = 4 query
heads per KV head, 91,424 keys through a shuffled slot list, 8 KV heads, D = 128, split 17 ways
along keys), in a kernel shaped like kernels.attention_kernel. Variants:
- bf16 K and V (the staged copies of today's kernel: K contiguous, V through the slots);
- QK in e4m3 with Q rounded once, or split hi + lo, K as stored (through the slots); PV in bf16
  over V staged contiguously;
- as above with PV in e4m3 too: V's codes staged transposed (keys contiguous, 1 byte a value), P
  times V's scale over the tile's largest, rounded once or split hi + lo.
The bf16 variant reads K and V dequantized from the same e4m3 codes, so `diff` is the error the
products add. Times are medians over a layer.

    python benchmarks/experiments/fp8_split_q_attention_gpu.py   # writes results/fp8_split_q_attention_gpu.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, write_json  # noqa: E402
from fp8_attention_tiles_gpu import block_start, softmax_step  # noqa: E402  (the kernel's frame)
from spanserve.attention.kv_cache import dequantize, quantize  # noqa: E402

KVH, G, D, BS = 8, 4, 128, 16
N_KEYS, N_Q, SPLIT = 91424, 96, 17
# name: (QK mode, PV mode); QK: 0 bf16, 1 e4m3 Q once, 2 e4m3 Q hi+lo, 3 / 4 the same read from a
# pass before (operands in shared memory, not registers); PV: 0 bf16, 1 e4m3 P once, 2 hi+lo
VARIANTS = {"bf16 QK, bf16 PV": (0, 0),
            "e4m3 QK (Q hi+lo read), bf16 PV": (3, 0), "e4m3 QK (Q once read), bf16 PV": (4, 0),
            "e4m3 QK (Q hi+lo read), e4m3 PV (P hi+lo)": (3, 2), "e4m3 QK (Q hi+lo read), e4m3 PV (P once)": (3, 1), "e4m3 QK (Q once), bf16 PV": (1, 0), "e4m3 QK (Q hi+lo), bf16 PV": (2, 0),
            "e4m3 QK (Q hi+lo), e4m3 PV (P once)": (2, 1), "e4m3 QK (Q hi+lo), e4m3 PV (P hi+lo)": (2, 2),
            "e4m3 QK (Q once), e4m3 PV (P once)": (1, 1)}
CONFIGS = [(64, 4, 3), (128, 8, 3), (64, 8, 3), (64, 4, 2)]  # keys a tile, warps, stages


@triton.jit
def _pow2_above(amax, top):
    """The least power of two s with amax <= top * s (amax > 0)."""
    return tl.exp2(tl.ceil(tl.log2(tl.maximum(amax, 1.0e-30) / top)))


@triton.jit
def _split(x, LO: tl.constexpr):
    """x (float32 rows) as e4m3 hi * s_hi (+ lo * s_lo when LO), per-row power-of-two scales."""
    s_hi = _pow2_above(tl.max(tl.abs(x), 1), 448.0)
    hi = (x / s_hi[:, None]).to(tl.float8e4nv)
    if LO:
        r = x - hi.to(tl.float32) * s_hi[:, None]
        s_lo = _pow2_above(tl.max(tl.abs(r), 1), 448.0)
        lo = (r / s_lo[:, None]).to(tl.float8e4nv)
    else:
        lo = hi
        s_lo = s_hi
    return hi, s_hi, lo, s_lo


@triton.jit
def _attn(q_ptr, qh_ptr, ql_ptr, qs_ptr, k8_ptr, v8t_ptr, kb_ptr, vb_ptr, vbs_ptr, ks_ptr, vs_ptr, slots_ptr, out_ptr, n_keys, n_pad,
          tiles_per_share, scale, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr):
    kvh, rows, dd, q_rows, q, j0, j1, acc, m_i, l_i = block_start(q_ptr, n_keys, tiles_per_share, KVH, G, D, SPLIT,
                                                                   BLOCK_M, BLOCK_N)
    if QK == 1 or QK == 2:
        q_hi, s_hi, q_lo, s_lo = _split(q.to(tl.float32), QK == 2)
    if QK >= 3:  # rounded by a pass before: [token, head, D] codes and [token, head, 2] scales
        q_hi = tl.load(qh_ptr + q_rows[:, None] * D + dd[None, :])
        q_lo = tl.load(ql_ptr + q_rows[:, None] * D + dd[None, :])
        s_hi = tl.load(qs_ptr + q_rows * 2)
        s_lo = tl.load(qs_ptr + q_rows * 2 + 1)
    col = kvh * D + dd
    nn = tl.arange(0, BLOCK_N)
    for j in range(j0, j1):
        kk = j * BLOCK_N + nn
        kin = kk < n_keys
        slot = tl.load(slots_ptr + kk).to(tl.int64)
        if QK == 0:  # today's bf16 path: K prerotated into a contiguous scratch
            kt = tl.load(kb_ptr + kk.to(tl.int64)[:, None] * (KVH * D) + col[None, :], mask=kin[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kt)) * scale
        else:
            kt = tl.load(k8_ptr + slot[:, None] * (KVH * D) + col[None, :], mask=kin[:, None], other=0.0)
            ks = tl.load(ks_ptr + slot * KVH + kvh, mask=kin, other=0.0)
            s = tl.dot(q_hi, tl.trans(kt)) * s_hi[:, None]
            if QK == 2 or QK == 3:
                s += tl.dot(q_lo, tl.trans(kt)) * s_lo[:, None]
            s = s * (ks * scale)[None, :]
        s = tl.where(kin[None, :], s, float("-inf"))
        p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
        if PV == 0:
            if QK == 0:  # values through the slots
                vt = tl.load(vb_ptr + slot[:, None] * (KVH * D) + col[None, :], mask=kin[:, None], other=0.0)
            else:  # values staged contiguously
                vt = tl.load(vbs_ptr + kk.to(tl.int64)[:, None] * (KVH * D) + col[None, :], mask=kin[:, None], other=0.0)
            pv = tl.dot(p.to(tl.bfloat16), vt)
        else:
            vs = tl.load(vs_ptr + slot * KVH + kvh, mask=kin, other=0.0)
            top = tl.max(vs, 0)
            pw = p * (vs / top)[None, :]  # exact: powers of two
            # [D, BLOCK_N] codes, keys contiguous: the K-major operand FP8 wgmma takes
            v8 = tl.load(v8t_ptr + (kvh * D + dd).to(tl.int64)[:, None] * n_pad + kk[None, :])
            p_hi, sp_hi, p_lo, sp_lo = _split(pw, PV == 2)
            pv = tl.dot(p_hi, tl.trans(v8)) * sp_hi[:, None]
            if PV == 2:
                pv += tl.dot(p_lo, tl.trans(v8)) * sp_lo[:, None]
            pv = pv * top
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    dst = (tl.program_id(0) * KVH + kvh) * BLOCK_M * D + rows[:, None] * D + dd[None, :]
    tl.store(out_ptr + dst, acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="fp8_split_q_attention_gpu.json")
    ap.add_argument("--configs", nargs="+", default=[",".join(map(str, c)) for c in CONFIGS],
                    help="keys a tile,warps,stages")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--keys", type=int, default=N_KEYS)
    args = ap.parse_args(argv)
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs]
    dev = torch.device(args.device)
    n_keys = args.keys
    gen = torch.Generator(device=dev).manual_seed(0)
    block_m = 128
    q = torch.randn(N_Q, KVH * G, D, generator=gen, device=dev).bfloat16()
    nslots = -(-n_keys // BS) * BS
    n_pad = nslots + 128
    blocks = torch.randperm(nslots // BS, generator=gen, device=dev)
    slots = (blocks[:, None] * BS + torch.arange(BS, device=dev)[None, :]).reshape(-1)[:n_keys]
    slots = torch.cat([slots, torch.zeros(n_pad - n_keys, dtype=slots.dtype, device=dev)]).int()
    # codes and power-of-two scales of the sort kv_cache.quantize writes (here one per row, random)
    k8 = torch.randn(nslots, KVH, D, generator=gen, device=dev).to(torch.float8_e4m3fn)
    v8 = torch.randn(nslots, KVH, D, generator=gen, device=dev).to(torch.float8_e4m3fn)
    ks = torch.exp2(torch.randint(-6, -2, (nslots, KVH), generator=gen, device=dev).float())
    vs = torch.exp2(torch.randint(-6, -2, (nslots, KVH), generator=gen, device=dev).float())
    kd = (k8.float() * ks[..., None]).bfloat16()  # exact
    vd = (v8.float() * vs[..., None]).bfloat16()
    sl = slots[:n_keys].long()
    kb = torch.zeros(n_pad, KVH, D, device=dev, dtype=torch.bfloat16)
    kb[:n_keys] = kd[sl]  # the prerotated scratch (delta 0 here)
    vbs = torch.zeros_like(kb)
    vbs[:n_keys] = vd[sl]  # values staged contiguously
    v8t = torch.zeros(KVH, D, n_pad, device=dev, dtype=torch.float8_e4m3fn)
    v8t[:, :, :n_keys] = v8[sl].permute(1, 2, 0)
    qblocks = N_Q * G // block_m
    # the pass before: Q's parts rounded as the cache rounds its rows (power-of-two scale per row)
    q_hi, s_hi = quantize(q.float())
    q_lo, s_lo = quantize(q.float() - dequantize(q_hi, s_hi))
    q_s = torch.stack([s_hi.float(), s_lo.float()], -1).contiguous()
    res, rows = {}, []
    for block_n, warps, stages in configs:
        tiles = -(-triton.cdiv(n_keys, block_n) // SPLIT)
        out = torch.empty(qblocks * SPLIT * KVH * block_m * D, device=dev)
        ref = None
        for name, (qk, pv) in VARIANTS.items():
            def go(qk=qk, pv=pv):
                return _attn[(qblocks * SPLIT, KVH)](
                    q, q_hi, q_lo, q_s, k8, v8t, kb, vd, vbs, ks, vs, slots, out, n_keys, n_pad, tiles, 1.4426950408889634 / D ** 0.5,
                    KVH=KVH, G=G, D=D, SPLIT=SPLIT, BLOCK_M=block_m, BLOCK_N=block_n, QK=qk, PV=pv,
                    num_warps=warps, num_stages=stages)
            out.fill_(float("nan"))
            try:
                kernel = go()
            except Exception as e:  # a variant Triton cannot build is reported, not fatal
                print(name, block_n, warps, "failed:", str(e).splitlines()[0][:200], flush=True)
                continue
            if dev.type == "cuda":
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(go, warmup=20, rep=200, return_mode="median")
                regs, spills = kernel.n_regs, kernel.n_spills
            else:
                ms, regs, spills = float("nan"), 0, 0
            if ref is None:
                ref = out.clone()
            err = ((out - ref).norm() / ref.norm()).item()
            e = {"us": ms * 1e3, "registers": regs, "spills": spills, "diff_vs_bf16": err}
            res[f"{block_n} keys, {warps} warps, {stages} stages: {name}"] = e
            base = res[f"{block_n} keys, {warps} warps, {stages} stages: bf16 QK, bf16 PV"]["us"]
            rows.append((block_n, warps, stages, name, e["us"], e["us"] / base, regs, spills, f"{err:.1e}"))
            print(rows[-1], flush=True)
    print(format_table(["keys/tile", "warps", "stages", "products", "us/layer", "x bf16", "regs", "spills", "diff"], rows))
    path = write_json(args.out, {"benchmark": "fp8_split_q_attention_gpu", "device": torch.cuda.get_device_name(0)
                                 if dev.type == "cuda" else "cpu",
                                 "layout": {"keys": n_keys, "queries": N_Q, "kv_heads": KVH, "group": G,
                                            "head_dim": D, "split": SPLIT}, "variants": res})
    print(f"wrote {path.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
