"""What bounds the batch-1 FP8 weight stream on a GPU: Llama-3-8B's projections at one row, in
TB/s of weight read, each call timed inside CUDA graphs over weight copies that overflow L2.

- `shipped`: fp8_kernels.gemv as the model calls it (tensor cores, fp8 -> fp16 in registers).
- `read only`: a kernel that only streams the same bytes (xor of int32 words): the memory
  pattern's ceiling, with the shipped tiles and with the best of finer ones.
- `fma cvt` / `fma int`: an FMA kernel (BLOCK_N rows a program, float32 partials per column lane)
  converting e4m3 with the hardware conversion, or with integer shifts alone (the e4m3 bits
  placed into a float32's; exact, subnormals too: the two are checked equal bit for bit).
- `one row`: the tensor-core kernel specialised to one row (x converted once a tile, not 16
  times), and the same launched with programmatic dependent launch (PDL).
- `bf16`: the bf16 matrix-vector kernel on the bf16 weights (twice the bytes).
Then the four projections of 32 distinct layers in one graph per variant: a decode step's weights.

    python benchmarks/experiments/fp8_gemv_bounds_gpu.py     # writes results/fp8_gemv_bounds_gpu.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, graph_us, write_json  # noqa: E402

from spanserve.model import fp8, fp8_kernels  # noqa: E402
from spanserve.model.gemv import gemv as bf16_gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
READ_TILES = [(8, 256, 4, 3), (2, 512, 4, 2), (1, 1024, 4, 2)]  # rows, int32 words, warps, stages
FMA_TILES = [(2, 1024, 4, 2), (4, 1024, 4, 2), (8, 512, 4, 2), (4, 512, 4, 3), (1, 2048, 4, 3)]
ONE_TILES = [(16, 512, 2, 4), (32, 256, 4, 4), (32, 512, 4, 3), (32, 1024, 4, 3)]
# e4m3 bits into float32's (value times 2^-120): four packed bytes, three integer ops each
_E4M3_TO_F32 = tl.constexpr("""{
.reg .b32 t0, t1, t2;
shl.b32 t0, $4, 24;
shl.b32 t1, $4, 16;
shl.b32 t2, $4, 8;
shr.s32 t0, t0, 4;
shr.s32 t1, t1, 4;
shr.s32 t2, t2, 4;
shr.s32 $3, $4, 4;
and.b32 $0, t0, 0x87F00000;
and.b32 $1, t1, 0x87F00000;
and.b32 $2, t2, 0x87F00000;
and.b32 $3, $3, 0x87F00000;
}""")


@triton.jit
def _read_kernel(q_ptr, y_ptr, KW, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    p = q_ptr + rows.to(tl.int64)[:, None] * KW + cols[None, :]
    for k in range(0, KW, BLOCK_W):
        acc ^= tl.load(p + k)
    tl.store(y_ptr + rows, tl.xor_sum(acc, axis=1))


@triton.jit
def _fma_kernel(x_ptr, q_ptr, s_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * K
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k + cols).to(tl.float32)
        w = tl.load(q_rows + k + cols[None, :], mask=rmask[:, None], other=0)
        if INT:
            wf = tl.inline_asm_elementwise(_E4M3_TO_F32, "=r,=r,=r,=r,r", [w], dtype=tl.int32, is_pure=True,
                                           pack=4).to(tl.float32, bitcast=True)
            acc += wf * (x * 18446744073709551616.0)[None, :]  # 2^64 here, 2^56 at the end
        else:
            acc += w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1) * tl.load(s_ptr + rows, mask=rmask, other=0.0)
    if INT:
        y = y * 72057594037927936.0
    tl.store(y_ptr + rows, y, mask=rmask)


@triton.jit
def _one_row_kernel(x_ptr, q_ptr, s_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    q_rows = q_ptr + rows.to(tl.int64)[:, None] * K
    if PDL:
        tl.extra.cuda.gdc_wait()
    for k in range(0, K, BLOCK_K):
        x = (tl.load(x_ptr + k + cols).to(tl.float32) * 0.015625).to(tl.float16)
        w = tl.load(q_rows + k + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float16)
        acc = tl.dot(w, tl.trans(tl.broadcast_to(x[None, :], (16, BLOCK_K))), acc)
    y = tl.sum(tl.where(tl.arange(0, 16)[None, :] == 0, acc, 0.0), axis=1)
    tl.store(y_ptr + rows, y * tl.load(s_ptr + rows, mask=rmask, other=0.0) * 64.0, mask=rmask)


def read_only(q: torch.Tensor, y: torch.Tensor, tile: tuple[int, int, int, int]) -> None:
    bn, bw, warps, stages = tile
    _read_kernel[(q.shape[0] // bn,)](q.view(torch.int32), y, q.shape[1] // 4, BLOCK_N=bn, BLOCK_W=bw,
                                      num_warps=warps, num_stages=stages)


def fma(x: torch.Tensor, wt: fp8.Fp8Weight, tile: tuple[int, int, int, int], integer: bool) -> torch.Tensor:
    (N, K), (bn, bk, warps, stages) = wt.shape, tile
    y = torch.empty(N, dtype=torch.float32, device=x.device)
    _fma_kernel[(triton.cdiv(N, bn),)](x, wt.q.view(torch.uint8), wt.scale, y, N, K, BLOCK_N=bn, BLOCK_K=bk,
                                       INT=integer, num_warps=warps, num_stages=stages)
    return y


def one_row(x: torch.Tensor, wt: fp8.Fp8Weight, tile: tuple[int, int, int, int], pdl: bool = False) -> torch.Tensor:
    (N, K), (bn, bk, warps, stages) = wt.shape, tile
    y = torch.empty(N, dtype=torch.float32, device=x.device)
    _one_row_kernel[(triton.cdiv(N, bn),)](x, wt.q, wt.scale, y, N, K, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl,
                                           num_warps=warps, num_stages=stages, launch_pdl=pdl)
    return y


def best(times: dict[tuple, float]) -> tuple[tuple, float]:
    tile = min(times, key=times.__getitem__)
    return tile, times[tile]


def shape_row(name: str, N: int, K: int, gen: torch.Generator) -> tuple[dict, dict]:
    dev = torch.device("cuda")
    n = max(2, min(32, int(1e9 // (N * K))))  # ~1 GB of FP8 weight copies
    wts = [fp8.quantize_weight(torch.randn(N, K, generator=gen, device=dev)) for _ in range(n)]
    xs = [torch.randn(1, K, generator=gen, device=dev).bfloat16() for _ in range(n)]
    gb = N * K / 1e9
    tbs = lambda us: gb / us * 1e3  # noqa: E731
    ref = fp8_kernels.gemv(xs[0], wts[0].q, wts[0].scale, None, torch.float32)[0]
    e: dict[str, float] = {"shipped": tbs(graph_us(lambda i: fp8_kernels.gemv(xs[i], wts[i].q, wts[i].scale), n))}
    y32 = torch.empty(N, dtype=torch.int32, device=dev)
    cfg = fp8_kernels.config_for(K)
    e["read only, shipped tiles"] = tbs(graph_us(lambda i: read_only(wts[i].q, y32, (cfg.block_n, cfg.block_k // 4,
                                                                                      cfg.num_warps, cfg.num_stages)), n))
    reads = {t: graph_us(lambda i, t=t: read_only(wts[i].q, y32, t), n) for t in READ_TILES if (K // 4) % t[1] == 0}
    e["read only, best tiles"] = tbs(best(reads)[1])
    picks: dict[str, tuple] = {}
    for integer in (False, True):
        times = {}
        for t in FMA_TILES:
            if K % t[1]:
                continue
            got = fma(xs[0], wts[0], t, integer)
            assert ((got - ref).norm() / ref.norm()).item() < 1e-4
            if integer:  # the integer conversion is exact: the same products, the same sums
                assert torch.equal(got, fma(xs[0], wts[0], t, False))
            times[t] = graph_us(lambda i, t=t: fma(xs[i], wts[i], t, integer), n)
        key = "fma int" if integer else "fma cvt"
        picks[key], us = best(times)
        e[key] = tbs(us)
    times = {}
    for t in ONE_TILES:
        if K % t[1] == 0:
            assert ((one_row(xs[0], wts[0], t) - ref).norm() / ref.norm()).item() < 1e-4
            times[t] = graph_us(lambda i, t=t: one_row(xs[i], wts[i], t), n)
    picks["one row"], us = best(times)
    e["one row"] = tbs(us)
    e["one row + PDL"] = tbs(graph_us(lambda i: one_row(xs[i], wts[i], picks["one row"], True), n))
    del wts
    wb = [torch.randn(N, K, generator=gen, device=dev).bfloat16() for _ in range(max(2, n // 2))]
    e["bf16"] = 2 * gb / graph_us(lambda i: bf16_gemv(xs[i], wb[i]), len(wb)) * 1e3
    del wb
    torch.cuda.empty_cache()
    return e, picks


def decode_projections(picks: dict[str, dict[str, tuple]], gen: torch.Generator) -> dict[str, float]:
    """ms for the four projections of 32 distinct layers, one graph per variant (best tiles per shape)."""
    dev = torch.device("cuda")
    layers = [{k: fp8.quantize_weight(torch.randn(N, K, generator=gen, device=dev)) for k, (N, K) in SHAPES.items()}
              for _ in range(32)]
    xk = {K: torch.randn(1, K, generator=gen, device=dev).bfloat16() for K in (4096, 14336)}
    variants = {
        "shipped": lambda x, w, k: fp8_kernels.gemv(x, w.q, w.scale),
        "fma int": lambda x, w, k: fma(x, w, picks[k]["fma int"], True),
        "one row": lambda x, w, k: one_row(x, w, picks[k]["one row"]),
        "one row + PDL": lambda x, w, k: one_row(x, w, picks[k]["one row"], True),
    }
    out = {}
    for name, f in variants.items():
        us = graph_us(lambda i, f=f: [f(xk[K], layers[i][k], k) for k, (N, K) in SHAPES.items()], 32)
        out[name] = us * 32 / 1e3
    return out


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="fp8_gemv_bounds_gpu.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes, picks = {}, {}
    for name, (N, K) in SHAPES.items():
        shapes[name], picks[name] = shape_row(name, N, K, gen)
        print(name, {k: round(v, 2) for k, v in shapes[name].items()}, flush=True)
    cols = list(shapes["qkv"])
    print(format_table(["W", *cols], [(n, *(shapes[n][c] for c in cols)) for n in shapes]))
    print("TB/s of weight read (bf16: of its own, twice the bytes)")
    steps = decode_projections(picks, gen)
    gb = 32 * sum(N * K for N, K in SHAPES.values()) / 1e9
    print(format_table(["variant", "ms", "TB/s"], [(k, v, gb / v) for k, v in steps.items()]))
    path = write_json(args.out, {"benchmark": "fp8_gemv_bounds_gpu", "device": torch.cuda.get_device_name(0),
                                 "tb_per_s": shapes, "tiles": {n: {k: list(t) for k, t in p.items()} for n, p in picks.items()},
                                 "decode_projections_ms": steps, "decode_projection_gb": gb})
    print(f"wrote {path.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
