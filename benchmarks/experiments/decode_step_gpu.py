"""Where a batch-256 decode step's GPU time goes, and whether a Triton GEMM beats cuBLAS at M=256.

1. Chained decode steps of 256 rows (128-token prompts), random Llama-3-8B bf16 on one GPU, CUDA
   graphs on: the step's wall time and a `torch.profiler` kernel table grouped by kind.
2. Llama-3-8B's four projections at M=256 (weights rotated over copies, so no run reads from L2):
   cuBLAS through F.linear against a plain Triton GEMM and a split-K one that writes float32
   partials [split, M, N] (their sum, which a consumer would fuse, is not timed).

    python benchmarks/experiments/decode_step_gpu.py [--batch 256]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, llama3_8b_config, write_json  # noqa: E402

KINDS = (("gemm", ("nvjet", "gemm", "gemv")), ("attention", ("attention_kernel", "combine")),
         ("elementwise", ("_rms", "silu", "rotary", "kv_write")))


def profile_step(batch: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from spanserve.engine.config import EngineConfig
    from spanserve.engine.engine import LLMEngine
    from spanserve.engine.params import SamplingParams
    from spanserve.model.weights import RandomWeights

    eng = LLMEngine(EngineConfig.from_kwargs(model=RandomWeights(llama3_8b_config(), seed=0)))
    eng.detokenize = False  # as the engine core runs
    g = torch.Generator().manual_seed(0)
    for n_out in (48, 256):  # the first batch captures the graphs
        for _ in range(batch):
            eng.add_request(torch.randint(3, 100000, (128,), generator=g).tolist(),
                            SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0))
        if n_out == 48:
            while eng.has_unfinished():
                eng.advance()
    while len(eng.scheduler.running) < batch or any(len(r.main.todo or ()) > 1 for r in eng.scheduler.running):
        eng.advance()
    for _ in range(60):
        eng.advance()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(40):
        eng.advance()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / 40 * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            eng.advance()
        torch.cuda.synchronize()
    layers = eng.model.config.num_layers
    steps = max(e.count for e in prof.key_averages() if e.key == "attention_kernel") / layers
    kinds = {k: 0.0 for k, _ in KINDS} | {"other": 0.0}
    for e in prof.key_averages():
        if e.self_device_time_total <= 0 or e.key.startswith("cuda"):
            continue
        kind = next((k for k, names in KINDS if any(n in e.key for n in names)), "other")
        kinds[kind] += e.self_device_time_total / steps / 1e3
    eng.shutdown()
    return {"batch": batch, "step_ms": step_ms, "device_ms_per_step": kinds, "profiled_steps": steps}


@triton.jit
def _mm(x_ptr, w_ptr, p_ptr, M, N, K, sxm, swn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        SPLIT: tl.constexpr):
    """p[s] = x[:, share s of K] @ w[:, share s of K].T in float32 (SPLIT 1: the whole product)."""
    n_m = tl.cdiv(M, BM)
    pid_n, pid_m, s = tl.program_id(0) // n_m, tl.program_id(0) % n_m, tl.program_id(1)
    kper = K // SPLIT
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = s * kper + tl.arange(0, BK)
    xp = x_ptr + rm[:, None] * sxm + rk[None, :]
    wp = w_ptr + rn[:, None] * swn + rk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, kper, BK):
        acc = tl.dot(tl.load(xp, mask=rm[:, None] < M, other=0.0), tl.trans(tl.load(wp)), acc)
        xp += BK
        wp += BK
    tl.store(p_ptr + (s * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc, mask=rm[:, None] < M)


# (BM, BN, BK, SPLIT, warps, stages): the best of a wider sweep on an H100 for these shapes
TRITON_CFGS = [(128, 128, 64, 1, 8, 5), (64, 128, 128, 1, 4, 4), (128, 256, 64, 1, 8, 4), (128, 256, 64, 2, 8, 4),
               (128, 128, 64, 2, 4, 4), (128, 128, 128, 2, 4, 3), (256, 128, 64, 4, 8, 4)]
SHAPES = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))


def gemms(M: int) -> list[dict]:
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")  # noqa: E731
    rows = []
    for name, N, K in SHAPES:
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(max(2, 400_000_000 // (N * K * 2)))]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        part = torch.empty(8 * M * N, device="cuda", dtype=torch.float32)
        it = iter(range(1 << 60))
        nxt = lambda: ws[next(it) % len(ws)]  # noqa: E731
        ref = torch.nn.functional.linear(x.float(), ws[0].float())
        row = {"name": name, "N": N, "K": K, "cublas_us": 1e3 * bench(lambda: torch.nn.functional.linear(x, nxt()))}
        best = None
        for bm, bn, bk, split, warps, stages in TRITON_CFGS:
            def run(w: torch.Tensor) -> None:
                _mm[(triton.cdiv(M, bm) * (N // bn), split)](x, w, part, M, N, K, x.stride(0), w.stride(0), BM=bm,
                                                             BN=bn, BK=bk, SPLIT=split, num_warps=warps, num_stages=stages)
            run(ws[0])
            got = part[:split * M * N].view(split, M, N).sum(0)
            if not ((got - ref).norm() / ref.norm()).item() < 1e-2:
                raise AssertionError(f"{name} {bm, bn, bk, split}: wrong product")
            us = 1e3 * bench(lambda: run(nxt()))
            if best is None or us < best[0]:
                best = (us, [bm, bn, bk, split, warps, stages])
        row.update(triton_us=best[0], triton_cfg=best[1], weight_tb_s=N * K * 2 / row["cublas_us"] / 1e6)
        rows.append(row)
        del ws
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args()
    step = profile_step(a.batch)
    print(f"decode step at batch {a.batch}: {step['step_ms']:.2f} ms wall")
    print(format_table(["kernels", "ms per step"], [[k, v] for k, v in step["device_ms_per_step"].items()]))
    rows = gemms(a.batch)
    print(format_table(["GEMM", "cuBLAS us", "TB/s", "Triton best us", "BM,BN,BK,split,warps,stages"],
                       [[r["name"], r["cublas_us"], r["weight_tb_s"], r["triton_us"], r["triton_cfg"]] for r in rows]))
    write_json("decode_step_gpu.json", {"device": torch.cuda.get_device_name(), "step": step, "gemms": rows})


if __name__ == "__main__":
    main()
