"""Why the attention kernel reads an 8-bit cache's prefill tiles from bfloat16 copies: one warm-RAG
layer (96 query tokens x 32 heads, G = 4 query heads per KV head, 91,424 keys gathered through a
shuffled slot list, 8 KV heads, D = 128, split 17 ways along keys) in a kernel shaped like
kernels.attention_kernel, with K and V tiles:
- bf16 (what the staged copies give);
- e4m3, converted in registers to bf16 (the cache as stored) or to fp16 (the one conversion the
  hardware does in one step; Q and P go fp16 too);
- bf16 K with e4m3 V (keys staged, values read as stored), to bf16 or fp16;
- e4m3, with the next tile's loads issued a tile ahead into registers (num_stages 1).
Each time is the median over a layer; registers and spills from the compiled kernel.
DISABLE_MMA_V3=1 in the environment makes Triton use mma.sync instead of wgmma.

    python benchmarks/experiments/fp8_attention_tiles_gpu.py    # writes results/fp8_attention_tiles_gpu.json
    DISABLE_MMA_V3=1 python benchmarks/experiments/fp8_attention_tiles_gpu.py --configs 64,4,3 64,4,2 32,4,3 \
        64,8,3 128,8,3 128,4,2 --out fp8_attention_tiles_mma_v2_gpu.json
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, write_json  # noqa: E402

KVH, G, D, BS = 8, 4, 128, 16
N_KEYS, N_Q, SPLIT = 91424, 96, 17
CONFIGS = [(64, 4, 3), (128, 8, 3)]  # keys a tile, warps, stages
VARIANTS = {  # name: (K 8-bit, V 8-bit, prefetch, fp16 operands)
    "bf16 K, V": (0, 0, 0, 0), "e4m3 K, V -> bf16": (1, 1, 0, 0), "e4m3 K, V -> fp16": (1, 1, 0, 1),
    "bf16 K, e4m3 V -> bf16": (0, 1, 0, 0), "bf16 K, e4m3 V -> fp16": (0, 1, 0, 1),
    "e4m3 K, V -> bf16, prefetched": (1, 1, 1, 0),
}


@triton.jit
def block_start(q_ptr, n_keys, tiles_per_share, KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program of the layer: its KV head, its rows (BLOCK_M // G query tokens x the G heads that
    share the KV head), their offsets in Q [token, head] and their queries, its share's tiles
    [j0, j1), and the running output, max and sum."""
    share = tl.program_id(0) % SPLIT
    kvh = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    dd = tl.arange(0, D)
    tok = (tl.program_id(0) // SPLIT) * (BLOCK_M // G) + rows // G
    q_rows = tok * (KVH * G) + kvh * G + rows % G
    q = tl.load(q_ptr + q_rows[:, None] * D + dd[None, :])
    j0 = share * tiles_per_share
    j1 = tl.minimum(j0 + tiles_per_share, tl.cdiv(n_keys, BLOCK_N))
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    return kvh, rows, dd, q_rows, q, j0, j1, acc, m_i, l_i


@triton.jit
def softmax_step(s, m_i, l_i):
    """Online softmax over one tile of log2-domain scores: probabilities, the rescale of what came
    before, the new running max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _tile(k_ptr, v_ptr, ks_ptr, vs_ptr, slot, col, kvh, KVH: tl.constexpr, D: tl.constexpr, ok):
    row = slot[:, None] * (KVH * D) + col[None, :]
    return (tl.load(k_ptr + row, mask=ok, other=0.0), tl.load(v_ptr + row, mask=ok, other=0.0),
            tl.load(ks_ptr + slot * KVH + kvh, mask=ok, other=0.0), tl.load(vs_ptr + slot * KVH + kvh, mask=ok, other=0.0))


@triton.jit
def _attn(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, slots_ptr, out_ptr, n_keys, tiles_per_share, scale,
          KVH: tl.constexpr, G: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_N: tl.constexpr, K8: tl.constexpr, V8: tl.constexpr, AHEAD: tl.constexpr, F16: tl.constexpr):
    kvh, rows, dd, q_rows, q, j0, j1, acc, m_i, l_i = block_start(q_ptr, n_keys, tiles_per_share, KVH, G, D, SPLIT,
                                                                   BLOCK_M, BLOCK_N)
    if F16 and K8:
        q = q.to(tl.float16)
    col = kvh * D + dd
    nn = tl.arange(0, BLOCK_N)
    if AHEAD:  # tile j0 now, tile j0 + 1's slots too: each loop turn loads the next tile
        kn, vn, ksn, vsn = _tile(k_ptr, v_ptr, ks_ptr, vs_ptr, tl.load(slots_ptr + j0 * BLOCK_N + nn).to(tl.int64),
                                 col, kvh, KVH, D, j0 < j1)
        sn = tl.load(slots_ptr + (j0 + 1) * BLOCK_N + nn).to(tl.int64)
    for j in range(j0, j1):
        if AHEAD:
            kt, vt, ks, vs = kn, vn, ksn, vsn
            kn, vn, ksn, vsn = _tile(k_ptr, v_ptr, ks_ptr, vs_ptr, sn, col, kvh, KVH, D, j + 1 < j1)
            sn = tl.load(slots_ptr + (j + 2) * BLOCK_N + nn).to(tl.int64)
        else:
            kt, vt, ks, vs = _tile(k_ptr, v_ptr, ks_ptr, vs_ptr, tl.load(slots_ptr + j * BLOCK_N + nn).to(tl.int64),
                                   col, kvh, KVH, D, j < j1)
        if K8:
            s = tl.dot(q, tl.trans(kt.to(q.dtype))) * (ks * scale)[None, :]
        else:
            s = tl.dot(q, tl.trans(kt)) * scale
        p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
        if V8:
            p = p * vs[None, :]
            if F16:
                pv = tl.dot(p.to(tl.float16), vt.to(tl.float16))
            else:
                pv = tl.dot(p.to(tl.bfloat16), vt.to(tl.bfloat16))
        else:
            pv = tl.dot(p.to(tl.bfloat16), vt)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    dst = (tl.program_id(0) * KVH + kvh) * BLOCK_M * D + rows[:, None] * D + dd[None, :]
    tl.store(out_ptr + dst, acc / l_i[:, None])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="fp8_attention_tiles_gpu.json")
    ap.add_argument("--configs", nargs="+", default=[",".join(map(str, c)) for c in CONFIGS],
                    help="keys a tile,warps,stages")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args(argv)
    configs = [tuple(int(x) for x in c.split(",")) for c in args.configs]
    variants = {name: VARIANTS[name] for name in args.variants}
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    block_m = 128
    q = torch.randn(N_Q, KVH * G, D, generator=gen, device=dev).bfloat16()
    nslots = -(-N_KEYS // BS) * BS
    blocks = torch.randperm(nslots // BS, generator=gen, device=dev)
    slots = (blocks[:, None] * BS + torch.arange(BS, device=dev)[None, :]).reshape(-1)[:N_KEYS]
    slots = torch.cat([slots, torch.zeros(4 * 128, dtype=slots.dtype, device=dev)]).int()  # tiles read ahead past the end
    kb = torch.randn(nslots, KVH, D, generator=gen, device=dev).bfloat16()
    vb = torch.randn(nslots, KVH, D, generator=gen, device=dev).bfloat16()
    k8, v8 = kb.to(torch.float8_e4m3fn), vb.to(torch.float8_e4m3fn)
    ones = torch.ones(nslots, KVH, device=dev)
    qblocks = N_Q * G // block_m
    res, rows = {}, []
    for block_n, warps, stages in configs:
        tiles = -(-triton.cdiv(N_KEYS, block_n) // SPLIT)
        out = torch.empty(qblocks * SPLIT * KVH * block_m * D, device=dev)
        ref = None
        for name, (k_8, v_8, ahead, f16) in variants.items():
            kc, vc = (k8 if k_8 else kb), (v8 if v_8 else vb)

            def go(kc=kc, vc=vc, k_8=k_8, v_8=v_8, ahead=ahead, f16=f16):
                return _attn[(qblocks * SPLIT, KVH)](
                    q, kc, vc, ones, ones, slots, out, N_KEYS, tiles, 1.4426950408889634 / D ** 0.5, KVH=KVH, G=G, D=D,
                    SPLIT=SPLIT, BLOCK_M=block_m, BLOCK_N=block_n, K8=k_8, V8=v_8, AHEAD=ahead, F16=f16,
                    num_warps=warps, num_stages=1 if ahead else stages)
            kernel = go()
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(go, warmup=20, rep=200, return_mode="median")
            if ref is None:
                ref = out.clone()
            # against the bf16 tiles' result: the e4m3 rounding of random K and V, nothing else
            err = ((out - ref).norm() / ref.norm()).item()
            e = {"us": ms * 1e3, "registers": kernel.n_regs, "spills": kernel.n_spills, "diff_vs_bf16": err}
            res[f"{block_n} keys, {warps} warps: {name}"] = e
            base = res.get(f"{block_n} keys, {warps} warps: bf16 K, V", e)["us"]
            rows.append((block_n, warps, name, e["us"], e["us"] / base,
                         e["registers"], e["spills"], f"{err:.1e}"))
            print(rows[-1], flush=True)
    print(format_table(["keys/tile", "warps", "tiles", "us/layer", "x bf16", "regs", "spills", "diff"], rows))
    path = write_json(args.out, {"benchmark": "fp8_attention_tiles_gpu", "device": torch.cuda.get_device_name(0),
                                 "mma_v3": os.environ.get("DISABLE_MMA_V3", "0") in ("", "0"),
                                 "layout": {"keys": N_KEYS, "queries": N_Q, "kv_heads": KVH, "group": G,
                                            "head_dim": D, "split": SPLIT}, "variants": res})
    print(f"wrote {path.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
