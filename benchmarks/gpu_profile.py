"""Where the time goes on a GPU, in one call (diagnostics for docs/gpu.md, not a benchmark):

1. prefill of --prefill plain tokens, random Llama-3-8B bf16: wall time of the engine step and the
   CUDA kernels' total by name (torch.profiler);
2. decode at batch 1: wall per step against the sum of its kernels' time (the host gap);
3. the warm RAG request of rag_ttft.py --gpu on a tiny model (benchmarks/host_profile.py): host time.

    python benchmarks/gpu_profile.py [--prefill 16384] [--skip-host]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import llama3_8b_config, median, random_model, write_json  # noqa: E402

from spanserve.engine.config import EngineConfig  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.engine.sampling import SamplingParams  # noqa: E402


def kernel_table(prof, top: int = 25) -> tuple[str, float]:
    rows = []
    total = 0.0
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if e.device_type is not None and str(e.device_type).endswith("CUDA") and t > 0:
            rows.append((t, e.count, e.key))
            total += t
    rows.sort(reverse=True)
    lines = [f"{t / 1e3:10.2f} ms {c:6d}x  {k[:100]}" for t, c, k in rows[:top]]
    return "\n".join(lines), total / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=16384)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--skip-host", action="store_true")
    ap.add_argument("--out", default="gpu_profile.json")
    args = ap.parse_args()
    from spanserve.attention.triton import TritonBackend
    res: dict = {}
    model = random_model(llama3_8b_config(), "cuda", torch.bfloat16)
    n = args.prefill
    eng = LLMEngine(EngineConfig.from_kwargs(model=model, device="cuda", dtype="bfloat16", max_num_batched_tokens=n + 16,
                                             num_blocks=(n // 16) * 3 + 64, backend=TritonBackend()))
    gen = torch.Generator().manual_seed(2)
    toks = lambda k: torch.randint(3, 128000, (k,), generator=gen).tolist()  # noqa: E731
    for _ in range(2):  # compile + warm
        eng.add_request(toks(n), SamplingParams(max_tokens=1))
        eng.step()
    torch.cuda.synchronize()
    eng.add_request(toks(n), SamplingParams(max_tokens=1))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    table, total = kernel_table(prof)
    print(f"== prefill {n}: step wall {wall * 1e3:.1f} ms, kernels {total:.1f} ms\n{table}\n", flush=True)
    import cProfile
    import io
    import pstats
    eng.add_request(toks(n), SamplingParams(max_tokens=1))
    cp = cProfile.Profile()
    torch.cuda.synchronize()
    cp.enable()
    eng.step()
    torch.cuda.synchronize()
    cp.disable()
    buf = io.StringIO()
    pstats.Stats(cp, stream=buf).sort_stats("tottime").print_stats(25)
    print(buf.getvalue()[-7000:], flush=True)
    res["prefill"] = {"wall_ms": wall * 1e3, "kernels_ms": total, "table": table}

    eng.add_request(toks(512), SamplingParams(max_tokens=args.decode_steps + 8, ignore_eos=True))
    for _ in range(4):
        eng.step()
    torch.cuda.synchronize()
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.decode_steps):
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
    table, total = kernel_table(prof)
    per = total / args.decode_steps
    print(f"== decode b=1: step wall median {median(walls) * 1e3:.2f} ms, kernels {per:.2f} ms/step\n{table}\n", flush=True)
    cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    print(cpu[-6000:], flush=True)
    res["decode"] = {"wall_ms": median(walls) * 1e3, "kernels_ms_per_step": per, "table": table, "cpu_table": cpu}
    del eng, model
    torch.cuda.empty_cache()
    write_json(args.out, {"benchmark": "gpu_profile", **res})
    if not args.skip_host:
        import host_profile
        host_profile.main(["--device", "cuda", "--backend", "triton", "--top", "25", "--out", "host_profile_gpu.json"])


if __name__ == "__main__":
    main()
