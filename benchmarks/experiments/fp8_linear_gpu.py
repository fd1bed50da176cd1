"""FP8 weights (spanserve/model/fp8.py) against bf16 on Llama-3-8B's projections at M = 1 to 16384
rows: bf16 F.linear (cuBLAS) and, at M = 1, the bf16 Triton matrix-vector kernel, against
fp8_linear as the model calls it and through each of its two paths: weight-only (the Triton FP8
kernel, up to 16 rows) and W8A8 (per-token activation quantization + torch._scaled_mm), with the
quantization and _scaled_mm also timed apart. Each call is timed inside CUDA graphs walking distinct
weight copies (about 2 GB of bf16: nothing stays in L2); errors are relative norms against a
float64 product of the unquantized weights.

    python benchmarks/experiments/fp8_linear_gpu.py            # writes results/fp8_linear_gpu.json
    python benchmarks/experiments/fp8_linear_gpu.py --quick    # two shapes, M = 1 and 256
    python benchmarks/experiments/fp8_linear_gpu.py --tune     # the FP8 kernel's tiles, M = 1
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, graph_us, write_json  # noqa: E402

from spanserve.model import fp8, fp8_kernels  # noqa: E402
from spanserve.model.gemv import gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
ROWS = (1, 16, 64, 256, 4096, 16384)
ERR_ROWS = 64  # rows of x whose outputs are checked (a row's result does not depend on the others)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def measure(N: int, K: int, M: int, gen: torch.Generator) -> dict[str, float | None]:
    dev = torch.device("cuda")
    # copies: ~2 GB of bf16 weights while the weights dominate; two where the rows do (large M)
    n = max(2, min(32, int(2e9 // (N * K * 2)))) if M <= 256 else 2
    ws = [(torch.randn(N, K, generator=gen, device=dev) / K ** 0.5).bfloat16() for _ in range(n)]
    wts = [fp8.quantize_weight(w) for w in ws]
    xs = [torch.randn(M, K, generator=gen, device=dev).bfloat16() for _ in range(n)]
    xqs = [fp8_kernels.quantize_rows(x) for x in xs]
    e: dict[str, float | None] = {}
    e["bf16_us"] = graph_us(lambda i: F.linear(xs[i], ws[i]), n)
    e["bf16_gemv_us"] = graph_us(lambda i: gemv(xs[i], ws[i]), n) if M == 1 and K % 1024 == 0 else None
    e["fp8_us"] = graph_us(lambda i: fp8.fp8_linear(xs[i], wts[i]), n)
    e["fp8_weight_only_us"] = (graph_us(lambda i: fp8.weight_only_linear(xs[i], wts[i], None, torch.bfloat16), n)
                               if M <= fp8.WEIGHT_ONLY_ROWS else None)
    e["fp8_w8a8_us"] = graph_us(lambda i: fp8.scaled_linear(xs[i], wts[i], None, torch.bfloat16), n)
    e["act_quant_us"] = graph_us(lambda i: fp8_kernels.quantize_rows(xs[i]), n)
    if fp8.scaled_mm_supported(dev, torch.bfloat16):
        e["scaled_mm_us"] = graph_us(lambda i: torch._scaled_mm(
            xqs[i][0], wts[i].q.t(), scale_a=xqs[i][1], scale_b=wts[i].scale.view(1, N), out_dtype=torch.bfloat16), n)
    x, w, wt = xs[0][:ERR_ROWS], ws[0], wts[0]
    ref = x.double() @ w.double().t()
    e["bf16_rel_err"] = rel_err(F.linear(xs[0], w)[:ERR_ROWS], ref)
    e["fp8_rel_err"] = rel_err(fp8.fp8_linear(xs[0], wt)[:ERR_ROWS], ref)
    if M <= fp8.WEIGHT_ONLY_ROWS:
        e["fp8_weight_only_rel_err"] = rel_err(fp8.weight_only_linear(x, wt, None, torch.bfloat16), ref)
    e["fp8_w8a8_rel_err"] = rel_err(fp8.scaled_linear(xs[0], wt, None, torch.bfloat16)[:ERR_ROWS], ref)
    del ws, wts, xs, xqs
    torch.cuda.empty_cache()
    return e


TUNE = [fp8_kernels.Fp8GemvConfig(*c) for c in (
    (32, 512, 4, 3), (16, 512, 2, 3), (32, 512, 4, 4), (32, 1024, 4, 3), (32, 512, 2, 3), (32, 256, 2, 4),
    (16, 512, 2, 4), (16, 1024, 2, 3), (64, 256, 4, 2), (32, 256, 4, 4), (32, 1024, 4, 4), (32, 256, 4, 2))]
TUNE_SHAPES = dict(SHAPES, **{f"{k} TP=2": (N // 2, K) if k in ("qkv", "gate_up") else (N, K // 2)
                              for k, (N, K) in SHAPES.items()})


def tune() -> None:
    """Microseconds per call of each tile config of the FP8 kernel, per shape, one row (graph-timed;
    up to 16 rows take the same time: the tensor cores' tile holds 16)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, (N, K) in TUNE_SHAPES.items():
        n = max(2, min(32, int(2e9 // (N * K * 2))))
        wts = [fp8.quantize_weight(torch.randn(N, K, generator=gen, device=dev)) for _ in range(n)]
        for M in (1,):
            xs = [torch.randn(M, K, generator=gen, device=dev).bfloat16() for _ in range(n)]
            times = [graph_us(lambda i, c=c: fp8_kernels.gemv(xs[i], wts[i].q, wts[i].scale, None, torch.bfloat16, c), n)
                     for c in TUNE]
            best = min(range(len(TUNE)), key=times.__getitem__)
            rows.append((name, M, *(f"{t:.1f}" for t in times), f"{N * K / times[best] / 1e6:.2f}", best))
            del xs
        del wts
        torch.cuda.empty_cache()
    print(format_table(["W", "M", *(f"{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}" for c in TUNE),
                        "best TB/s", "best"], rows))


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fp8_linear_gpu.json")
    ap.add_argument("--quick", action="store_true", help="qkv and down at M = 1 and 256 only")
    ap.add_argument("--tune", action="store_true", help="only time the FP8 kernel's tile configs (M = 1)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if args.tune:
        return tune()
    dev = torch.device("cuda")
    fp8.probe(dev, (torch.bfloat16,))  # before the graphs: the W8A8 path's choice is made once
    shapes = {k: SHAPES[k] for k in ("qkv", "down")} if args.quick else SHAPES
    rows_list = (1, 256) if args.quick else ROWS
    gen = torch.Generator(device=dev).manual_seed(0)
    res: dict[str, dict[str, dict[str, float | None]]] = {}
    rows = []
    for name, (N, K) in shapes.items():
        res[name] = {}
        for M in rows_list:
            e = res[name][str(M)] = measure(N, K, M, gen)
            best_bf16 = min(t for t in (e["bf16_us"], e["bf16_gemv_us"]) if t is not None)
            tflops = 2 * M * N * K / (e["fp8_us"] * 1e-6) / 1e12
            weight_tbs = N * K / (e["fp8_us"] * 1e-6) / 1e12  # FP8 weight bytes read per second
            rows.append((name, f"{N}x{K}", M, e["bf16_us"], e["bf16_gemv_us"] or "-", e["fp8_us"],
                         e["fp8_weight_only_us"] or "-", e["fp8_w8a8_us"], e["act_quant_us"],
                         e.get("scaled_mm_us") or "-", f"{best_bf16 / e['fp8_us']:.2f}x", f"{weight_tbs:.2f}",
                         f"{tflops:.0f}", f"{e['bf16_rel_err']:.1e}", f"{e['fp8_rel_err']:.1e}"))
            print(name, M, {k: round(v, 2) if isinstance(v, float) else v for k, v in e.items()}, flush=True)
    headers = ["W", "N x K", "M", "bf16 us", "bf16 gemv us", "fp8 us", "fp8 w-only us", "fp8 w8a8 us",
               "act quant us", "scaled_mm us", "speedup", "fp8 W TB/s", "fp8 TFLOP/s", "bf16 err", "fp8 err"]
    print(format_table(headers, rows))
    path = write_json(args.out, {"benchmark": "fp8_linear_gpu", "device": torch.cuda.get_device_name(0),
                                 "weight_only_rows": fp8.WEIGHT_ONLY_ROWS,
                                 "gemv_config": {"short_k": dataclasses.asdict(fp8_kernels.SHORT_K),
                                                 "long_k": dataclasses.asdict(fp8_kernels.LONG_K)},
                                 "shapes": res, "table": [list(map(str, r)) for r in rows]})
    print(f"wrote {path.name}")


if __name__ == "__main__":
    main(sys.argv[1:])
