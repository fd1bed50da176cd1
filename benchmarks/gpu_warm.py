"""Where a warm span request's time goes on a GPU, and what split launches and the rotation mode
change (diagnostics for docs/gpu.md; the headline numbers come from rag_ttft.py --gpu and
nested_gen.py --gpu).

1. The warm RAG request of rag_ttft.py --gpu (N documents x 2857 tokens pinned, a new order and a
   64-token question), random Llama-3-8B bf16: TTFT for each attention variant (split launches
   on/off x prerotated/fused rotation), side by side, then the phases of one request (host
   admission, plan, forward) and its kernels by name.
2. A judge over F candidates of --inner tokens (the nested_gen.py --gpu shape, candidates made by
   forcing random tokens instead of sampling them): its TTFT per variant and its phases.

    python benchmarks/gpu_warm.py [--n 32] [--fanout 24] [--inner 512] [--runs 5]
    python benchmarks/gpu_warm.py --dry        # CPU, tiny model and sizes: the script runs
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

DRY = "--dry" in sys.argv
if DRY:  # tiny shapes on the CPU through Triton's interpreter: checks that the script runs
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, llama3_8b_config, median, random_model, random_tokens, write_json  # noqa: E402
from gpu_profile import kernel_table  # noqa: E402

from spanserve.attention.triton import TritonBackend  # noqa: E402
from spanserve.cache import manager as manager_mod  # noqa: E402
from spanserve.engine import runner as runner_mod  # noqa: E402
from spanserve.engine.config import EngineConfig  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.engine.layout import Segment  # noqa: E402
from spanserve.engine.sampling import SamplingParams  # noqa: E402

VARIANTS: dict[str, Callable[[], TritonBackend]] = {
    "split, prerotate": lambda: TritonBackend(),
    "split, fused": lambda: TritonBackend(prerotate_prefill=False),
    "no split, prerotate": lambda: TritonBackend(split_programs=0),
    "no split, fused": lambda: TritonBackend(split_programs=0, prerotate_prefill=False),
}
PHASES: dict[str, float] = {}


def timed_phase(obj: Any, name: str, label: str, sync: bool) -> None:
    f = getattr(obj, name)

    @functools.wraps(f)
    def g(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        r = f(*a, **k)
        if sync:
            torch.cuda.synchronize()
        PHASES[label] = PHASES.get(label, 0.0) + time.perf_counter() - t0
        return r
    setattr(obj, name, g)


def ttft(eng: LLMEngine, layout: list[Segment]) -> float:
    req = eng.add_request(layout, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    return req.first_token_time - req.arrival_time


def compare(eng: LLMEngine, make: Callable[[], list[Segment]], runs: int, label: str, rows: list) -> dict:
    out: dict[str, list[float]] = {v: [] for v in VARIANTS}
    backends = {v: mk() for v, mk in VARIANTS.items()}
    for r in range(runs + 1):
        for v, b in backends.items():
            eng.runner.backend = b
            t = ttft(eng, make())
            if r:
                out[v].append(t)
    base = median(out["no split, prerotate"])
    for v, ts in out.items():
        rows.append((label, v, f"{median(ts) * 1e3:.1f} ms", f"{base / median(ts):.2f}x"))
    eng.runner.backend = backends["split, prerotate"]
    return {v: ts for v, ts in out.items()}


def phases(eng: LLMEngine, make: Callable[[], list[Segment]], label: str, report: list[str]) -> dict:
    ttft(eng, make())
    PHASES.clear()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = ttft(eng, make())
    table, total = kernel_table(prof, 20)
    PHASES.clear()
    timed_ttft = ttft(eng, make())
    ph = dict(PHASES)
    line = " ".join(f"{k}={v * 1e3:.1f}" for k, v in sorted(ph.items()))
    report.append(f"== {label}: TTFT {timed_ttft * 1e3:.1f} ms (profiled {t * 1e3:.1f}), kernels {total:.1f} ms; "
                  f"phases (synced) {line}\n{table}\n")
    return {"ttft_ms": timed_ttft * 1e3, "kernels_ms": total, "phases_ms": {k: v * 1e3 for k, v in ph.items()},
            "table": table}


def cprofiled(eng: LLMEngine, make: Callable[[], list[Segment]], label: str) -> str:
    import cProfile
    import io
    import pstats
    ttft(eng, make())
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    t = ttft(eng, make())
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
    text = buf.getvalue()
    print(f"== cProfile of one {label} request (TTFT {t * 1e3:.1f} ms under the profiler)\n{text[-5500:]}", flush=True)
    return text


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--doc-len", type=int, default=2857)
    ap.add_argument("--fanout", type=int, default=24)
    ap.add_argument("--inner", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="gpu_warm.json")
    ap.add_argument("--dry", action="store_true")
    ap.add_argument("--skip-variants", action="store_true")
    ap.add_argument("--cprofile", action="store_true", help="also a cProfile of one request of each kind")
    args = ap.parse_args()
    cfg, dev, dtype = llama3_8b_config(), "cuda", torch.bfloat16
    if args.dry:
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=64, intermediate_size=64, num_layers=2,
                                  num_heads=4, num_kv_heads=2, head_dim=16)
        dev, dtype = "cpu", torch.float32
        args.n, args.doc_len, args.fanout, args.inner, args.runs, args.out = 3, 200, 3, 40, 1, "gpu_warm_dry.json"
        torch.cuda.synchronize = lambda *a: None  # type: ignore[assignment]
    model = random_model(cfg, dev, dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    docs = [random_tokens(gen, args.doc_len, vocab) for _ in range(args.n)]
    blocks = 3 * args.n * -(-args.doc_len // 16) + 4096
    eng = LLMEngine(EngineConfig.from_kwargs(model=model, device=dev, dtype=dtype, num_blocks=blocks,
                                             pin_fraction=0.9, max_num_batched_tokens=16384, backend=TritonBackend()))
    eng.pin([Segment(token_ids=d, kind="plus", key=f"d{i}") for i, d in enumerate(docs)])
    while eng.has_unfinished():
        eng.step()

    def rag() -> list[Segment]:
        perm = torch.randperm(args.n, generator=gen).tolist()
        return [Segment(token_ids=docs[i], kind="plus") for i in perm] + [Segment(token_ids=random_tokens(gen, 64, vocab))]

    # Judge: F candidate conversations (standalone segments, as the executed query leaves them
    # cached) after a fixed system header, then a ~40-token question.
    system = random_tokens(gen, 12, vocab)
    cands = [random_tokens(gen, 64 + args.inner, vocab) for _ in range(args.fanout)]
    eng.pin([Segment(token_ids=c, kind="plus", key=f"c{i}") for i, c in enumerate(cands)])
    while eng.has_unfinished():
        eng.step()

    def judge() -> list[Segment]:
        return ([Segment(token_ids=system, kind="cross")] + [Segment(token_ids=c, kind="plus") for c in cands]
                + [Segment(token_ids=random_tokens(gen, 40, vocab))])

    rows: list = []
    res: dict[str, Any] = {"args": vars(args)}
    if not args.skip_variants:
        res["rag_variants_s"] = compare(eng, rag, args.runs, f"warm RAG N={args.n}", rows)
        res["judge_variants_s"] = compare(eng, judge, args.runs, f"judge F={args.fanout}x{args.inner}", rows)
        print(format_table(["request", "attention", "TTFT median", "vs no split"], rows), flush=True)
    if args.cprofile:
        for name, make in (("rag", rag), ("judge", judge)):
            res[f"{name}_cprofile"] = cprofiled(eng, make, name)
    for obj, name, label in ((LLMEngine, "add_request", "add_request"), (manager_mod.CacheManager, "admit", "admit"),
                             (runner_mod, "build_plan", "build_plan"), (runner_mod.ModelRunner, "run", "runner.run")):
        timed_phase(obj, name, label, sync=name == "run")
    report: list[str] = []
    res["rag_phases"] = phases(eng, rag, f"warm RAG N={args.n}", report)
    res["judge_phases"] = phases(eng, judge, f"judge F={args.fanout}x{args.inner}", report)
    print("\n".join(report))
    print(format_table(["request", "attention", "TTFT median", "vs no split"], rows))
    write_json(args.out, {"benchmark": "gpu_warm", **res, "rows": rows})


if __name__ == "__main__":
    main()
