"""Judge/generator on a GPU (span-query paper §5.7 at 8B scale): TTFT of the judge call, stock
versus span query, random Llama-3-8B-shaped bf16 weights (outputs are meaningless; the work is
real). Stock = the same judge prompt read as one causal prompt (policy "full"), so prefix
caching can reuse only its leading run; span = the executed query, whose judge reads the inner
conversations from the cache.

    python benchmarks/nested_gen_gpu.py [--fanouts 1,4,8,24] [--temperature 0.5] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import format_table, llama3_8b_config, median, random_model, write_json  # noqa: E402
from tiny_models import make_tiny_tokenizer  # noqa: E402

from spanserve import LLM, SamplingParams  # noqa: E402
from spanserve.query import cross, g, plus, repeat, system, user  # noqa: E402
from spanserve.query.execute import EngineRunner, Executor  # noqa: E402
from spanserve.query.plan import Planner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fanouts", default="1,4,8,24")
    ap.add_argument("--temperature", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="file under benchmarks/results/ (default nested_gen_gpu.json)")
    ap.add_argument("--phases", action="store_true", help="print where each judge's TTFT went")
    ap.add_argument("--profile-admission", action="store_true", help="with --phases: cProfile each judge's admission")
    args = ap.parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    cfg = llama3_8b_config()
    if dev != "cuda":  # a dry run of the script on CPU
        cfg = dataclasses.replace(cfg, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    model = dataclasses.replace(random_model(cfg, dev, dtype), tokenizer=make_tiny_tokenizer())
    backend = None
    if dev == "cuda":
        from spanserve.attention.triton import TritonBackend
        backend = TritonBackend()
    llm = LLM(model, device=dev, dtype=str(dtype).removeprefix("torch."), num_blocks=12000 if dev == "cuda" else 4000,
              max_num_batched_tokens=16384, backend=backend)
    events = trace_phases(llm, args.profile_admission) if args.phases else None
    rows, results = [], []
    task = "the cat sat on the mat and the dog ran on the mat " * 3
    for f in [int(x) for x in args.fanouts.split(",")]:
        span_t, stock_t = [], []
        for r in range(args.repeats + 1):
            inner = g(user(f"{r} {task}"), temperature=args.temperature, max_tokens=args.max_tokens)
            q = g(cross(system("the judge"), plus(repeat(f, inner)), user("the best is ?")), max_tokens=2)
            ex = Executor(EngineRunner(llm.engine), llm.tokenizer, seed=r)
            out = ex.execute(q)
            judge = out.outputs[()]
            if events is not None:
                sg = llm.engine.runner.step_graphs
                print(f"judge {r}: " + judge_phases(events, judge.request_id)
                      + ("" if sg is None else f", step graph captures so far {sg.captured}"), flush=True)
            # stock: the same judge prompt (same inner texts) as one causal prompt
            flat = llm.engine.add_request(list(judge.prompt_token_ids), SamplingParams(max_tokens=2, ignore_eos=True),
                                          namespace="stock")
            while llm.engine.has_unfinished():
                for o in llm.engine.step():
                    if o.finished and o.request_id == flat.request_id:
                        stock = o
            if r == 0:
                continue  # warm-up
            span_t.append(judge.metrics["ttft"])
            stock_t.append(stock.metrics["ttft"])
        s, k = median(span_t), median(stock_t)
        rows.append((f, len(judge.prompt_token_ids), judge.metrics["reuse"]["segment"], f"{k * 1e3:.1f}", f"{s * 1e3:.1f}", f"{k / s:.1f}x"))
        results.append({"fanout": f, "prompt_tokens": len(judge.prompt_token_ids), "stock_s": k, "span_s": s,
                        "speedup": k / s, "judge_reuse": judge.metrics["reuse"], "stock_reuse": stock.metrics["reuse"]})
        print(rows[-1], flush=True)
    print(format_table(["fan-out", "judge prompt", "segment hits", "stock ms", "span ms", "speedup"], rows))
    write_json(args.out or ("nested_gen_gpu.json" if dev == "cuda" else "nested_gen_gpu_dry.json"),
               {"args": vars(args), "results": results})


def trace_phases(llm: LLM, profile: bool = False) -> dict:
    """Wall-clock marks (device-synced) of every request's arrival, admission and model step."""
    import time

    eng = llm.engine
    events: dict = {"req": {}, "admit": {}, "run": []}
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    add, admit, run = eng.add_request, eng.scheduler.admit, eng.runner.run

    def add_request(*a, **k):
        req = add(*a, **k)
        events["req"][req.request_id] = req
        return req

    def admit_(req):
        t0 = time.monotonic()
        if profile and len(req.current_pieces()) > 8:  # a judge: profile its admission
            import cProfile
            import pstats
            prof = cProfile.Profile()
            ok = prof.runcall(admit, req)
            events["admit"][req.request_id] = (t0, time.monotonic())
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)
            return ok
        ok = admit(req)
        events["admit"][req.request_id] = (t0, time.monotonic())
        return ok

    def run_(chunks, *prepared):
        t0 = time.monotonic()
        out = run(chunks, *prepared)
        sync()
        events["run"].append((t0, time.monotonic(), sum(len(c.positions) for c in chunks),
                              {c.request.request_id for c in chunks}))
        return out

    eng.add_request, eng.scheduler.admit, eng.runner.run = add_request, admit_, run_
    return events


def judge_phases(events: dict, rid: str) -> str:
    req = events["req"][rid]
    a0, a1 = events["admit"][rid]
    r0, r1, n, _ = next(e for e in events["run"] if rid in e[3])
    ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
    return (f"arrival->admit {ms(a0 - req.arrival_time)} ms, admit {ms(a1 - a0)}, admit->run {ms(r0 - a1)}, "
            f"run ({n} tokens, synced) {ms(r1 - r0)}, run->first token {ms(req.first_token_time - r1)}, "
            f"ttft {ms(req.first_token_time - req.arrival_time)}")


if __name__ == "__main__":
    main()
