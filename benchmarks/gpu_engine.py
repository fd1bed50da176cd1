"""GPU checks and roofline numbers for the whole engine (issue: GPU backend), in one run:

1. the engine on CUDA (reference and Triton backends) against the CPU engine: greedy tokens of a
   tiny random model on span layouts with non-zero deltas, and logits;
2. Triton vs reference backend on the Llama-3-8B shape (random bf16 weights), span layouts;
3. prefill of 16k plain tokens: achieved TFLOP/s vs the measured bf16 matmul peak;
4. decode at batch 1: step time vs the weight-bandwidth bound (weights bytes / measured copy BW);
5. decode at batch 1 over a long context (--long-context, 16k): the decode launch split along keys
   (the default: 8 programs, one per KV head, would leave 124 SMs idle) against unsplit.

    python benchmarks/gpu_engine.py [--prefill 16384] [--decode-steps 32]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import format_table, llama3_8b_config, median, random_model, write_json  # noqa: E402

from spanserve import LLM, SamplingParams, Segment  # noqa: E402
from spanserve.engine.config import EngineConfig  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.model.config import ModelConfig  # noqa: E402

DEV = "cuda"


def TritonBackend(**kw):  # noqa: N802 - a dry run on CPU times the reference backend instead
    if DEV != "cuda":
        return None
    from spanserve.attention.triton import TritonBackend as T
    return T(**kw)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def peaks() -> tuple[float, float]:
    import triton.testing as tt
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = tt.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    tflops = 2 * 8192 ** 3 / ms / 1e9
    x = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    y = torch.empty_like(x)
    ms = tt.do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
    return tflops, 2 * x.numel() * 2 / ms / 1e6  # GB/s: bytes read + written per ms / 1e6


def layouts(gen: torch.Generator, vocab: int, doc: list[int]) -> list[list[Segment]]:
    t = lambda n: torch.randint(3, vocab, (n,), generator=gen).tolist()  # noqa: E731
    return [
        [Segment(token_ids=t(11)), Segment(token_ids=doc, kind="plus"), Segment(token_ids=t(30), kind="plus"), Segment(token_ids=t(7))],
        [Segment(token_ids=t(29)), Segment(token_ids=t(13), kind="plus", anchor="prefix"), Segment(token_ids=doc, kind="plus"), Segment(token_ids=t(5))],
        t(50),
    ]


def check_tiny(rows: list) -> None:
    """CPU engine vs CUDA engine (reference, Triton) on a tiny random llama, float32."""
    from tiny_models import make_tiny_model
    path, _ = make_tiny_model("llama", Path(tempfile.mkdtemp()), layers=4)
    gen = torch.Generator().manual_seed(0)
    doc = torch.randint(3, 384, (37,), generator=gen).tolist()
    lays = layouts(gen, 384, doc)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs, steps = {}, {}
    for name, dev, be in [("cpu", "cpu", None), ("cuda-reference", DEV, None), ("cuda-triton", DEV, TritonBackend())]:
        llm = LLM(str(path), device=dev, dtype="float32", block_size=16, num_blocks=256, backend=be or "reference")
        first = [o.token_ids for o in llm.generate(lays, params)]
        second = [o.token_ids for o in llm.generate(lays[::-1], params)][::-1]  # warm, other order
        outs[name] = (first, second)
        sg = llm.engine.runner.step_graphs
        if sg is not None:
            steps[name] = f" ({sg.replays} step-graph replays)"
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    for dev in ("cpu", DEV):  # per-request generators live on the engine's device
        LLM(str(path), device=dev, dtype="float32", block_size=16, num_blocks=64).generate(lays[2], seeded)
    rows.append(("seeded sampling runs on", DEV, True))
    for name in ("cuda-reference", "cuda-triton"):
        same = outs[name][0] == outs["cpu"][0] and outs[name][1] == outs["cpu"][0]
        rows.append(("tiny greedy tokens == CPU (cold, warm)", name + steps.get(name, ""), same))


def check_8b(model, rows: list) -> None:
    """Triton vs reference on the 8B shape: final logits of span layouts, relative error."""
    gen = torch.Generator().manual_seed(1)
    doc = torch.randint(3, 128000, (700,), generator=gen).tolist()
    lays = layouts(gen, 128000, doc)
    logits = {}
    for name, be in [("reference", None), ("triton", TritonBackend()), ("triton-eager-ops", TritonBackend())]:
        eng = LLMEngine(EngineConfig.from_kwargs(model=model, device=DEV, dtype="bfloat16", num_blocks=2048,
                                                 backend=be))
        if name == "triton-eager-ops":
            from spanserve.model.llama import _Eager
            eng.model.ops = _Eager
        got = []
        for lay in lays + lays:  # cold then warm
            eng.add_request(lay, SamplingParams(max_tokens=1))
            sched = eng.scheduler.schedule()
            while not any(c.task.sample and c.positions[-1] == len(c.task.tokens) - 1 for c in sched.chunks):
                eng.runner.run(sched.chunks)
                sched = eng.scheduler.schedule()
            lg, r = eng.runner.run(sched.chunks)
            got.append(lg[[x for x in r if x >= 0][-1]].float())
            while eng.has_unfinished():
                for rid in list(eng.requests):
                    eng.abort(rid)
        logits[name] = got
        del eng
        if DEV == "cuda":
            torch.cuda.empty_cache()
    errs = [((a - b).norm() / b.norm()).item() for a, b in zip(logits["triton"], logits["reference"])]
    rows.append(("8B bf16 logits rel err triton vs reference (max over 6)", "", f"{max(errs):.2e}"))
    errs = [((a - b).norm() / b.norm()).item() for a, b in zip(logits["triton"], logits["triton-eager-ops"])]
    rows.append(("8B bf16 logits rel err fused vs eager elementwise ops (max over 6)", "", f"{max(errs):.2e}"))


def check_graphs(model, rows: list) -> None:
    """Steps through CUDA graphs give the eager engine's greedy tokens (8B, span layouts): decode
    at batch 3, then warm requests one at a time, whose short prefill steps (new questions over
    the cached documents, at new positions) replay step graphs."""
    gen = torch.Generator().manual_seed(3)
    doc = torch.randint(3, 128000, (300,), generator=gen).tolist()
    lays = layouts(gen, 128000, doc)
    warm = layouts(gen, 128000, doc)[:2] + layouts(gen, 128000, doc)[:2]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    toks, first = {}, {}
    for name, graphs in (("graphs", "auto"), ("eager", False), ("reference", False)):
        be = None if name == "reference" else TritonBackend()
        eng = LLMEngine(EngineConfig.from_kwargs(model=model, device=DEV, dtype="bfloat16", num_blocks=1024,
                                                 backend=be, cuda_graphs=graphs))
        reqs = [eng.add_request(p, params) for p in lays]
        while eng.has_unfinished():
            eng.step()
        for p in warm:
            reqs.append(eng.add_request(p, params))
            sched = eng.scheduler.schedule()  # the warm prefill: keep its logits to compare
            lg, r = eng.runner.run(sched.chunks)
            first.setdefault(name, []).append(lg[[x for x in r if x >= 0][-1]].float())
            for rid in list(eng.requests):
                eng.abort(rid)
            reqs[-1] = eng.add_request(p, params)
            while eng.has_unfinished():
                eng.step()
        toks[name] = [r.output_token_ids for r in reqs]
        if name == "graphs":
            replays = eng.runner.graphs.replays if eng.runner.graphs is not None else 0
            step_replays = eng.runner.step_graphs.replays if eng.runner.step_graphs is not None else 0
        del eng
    rows.append(("8B greedy tokens, CUDA-graph decode == eager", f"{replays} replays", toks["graphs"][:3] == toks["eager"][:3]))
    # Greedy tokens of random bf16 weights follow rounding: padded GEMMs and the in-kernel rotation
    # round differently from the eager step, so compare both with the reference backend instead.
    rows.append(("8B greedy tokens, warm short prefill graphs == eager", f"{step_replays} step replays",
                 toks["graphs"][3:] == toks["eager"][3:]))
    for name in ("graphs", "eager"):
        errs = [((a - b).norm() / b.norm()).item() for a, b in zip(first[name], first["reference"])]
        rows.append((f"8B warm prefill logits rel err vs reference, {name} (max over 4)", "", f"{max(errs):.2e}"))


def synced_step(eng: LLMEngine) -> float:
    """Seconds of one engine step with the device idle before and after it."""
    sync()
    t0 = time.perf_counter()
    eng.step()
    sync()
    return time.perf_counter() - t0


def itl_loop(eng: LLMEngine, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Seconds per decode step of an uninterrupted run at batch 1, after prefill and 4 steps, and
    the greedy tokens."""
    req = eng.add_request(prompt, SamplingParams(max_tokens=steps + 6, ignore_eos=True, temperature=0))
    for _ in range(4):
        eng.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    while eng.has_unfinished():
        eng.step()
    return dt, req.output_token_ids


def prefill_and_decode(model, n_prefill: int, steps: int, peak_tflops: float, bw: float, rows: list) -> dict:
    c = model.config
    eng = LLMEngine(EngineConfig.from_kwargs(model=model, device=DEV, dtype="bfloat16",
                                             max_num_batched_tokens=n_prefill + 16,
                                             num_blocks=(n_prefill // 16) * 3 + 64, backend=TritonBackend()))
    gen = torch.Generator().manual_seed(2)
    times = []
    for i in range(3):
        toks = torch.randint(3, 128000, (n_prefill,), generator=gen).tolist()
        eng.add_request(toks, SamplingParams(max_tokens=1))
        times.append(synced_step(eng))
    t = median(times[1:])
    matmul_params = sum(v.numel() for k, v in model.weights.items() if k.endswith("proj.weight")) + c.vocab_size * c.hidden_size / n_prefill
    attn = 2 * 2 * c.num_layers * c.num_heads * c.head_dim * n_prefill * n_prefill / 2
    flops = 2 * matmul_params * n_prefill + attn
    achieved = flops / t / 1e12
    rows.append((f"prefill {n_prefill} plain tokens", f"{t * 1e3:.1f} ms", f"{achieved:.0f} TFLOP/s = {achieved / peak_tflops:.0%} of peak"))
    # Decode at batch 1, two ways: each step between device syncs (host and device strictly in
    # series), and the inter-token latency of an uninterrupted run of steps (what a user sees;
    # the engine itself syncs once per step to read the sampled token).
    eng.add_request(torch.randint(3, 128000, (512,), generator=gen).tolist(), SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    step_t = []
    while eng.has_unfinished():
        step_t.append(synced_step(eng))
    d = median(step_t[3:])
    itl = median([itl_loop(eng, torch.randint(3, 128000, (512,), generator=gen).tolist(), steps)[0] for _ in range(3)])
    weight_bytes = sum(v.numel() * v.element_size() for k, v in model.weights.items() if k != "model.embed_tokens.weight")
    bound = weight_bytes / (bw * 1e9)
    rows.append(("decode batch 1 step (synced each step)", f"{d * 1e3:.2f} ms", f"bound {bound * 1e3:.2f} ms ({d / bound:.2f}x)"))
    rows.append(("decode batch 1 inter-token latency", f"{itl * 1e3:.2f} ms", f"bound {bound * 1e3:.2f} ms ({itl / bound:.2f}x)"))
    return {"prefill_s": t, "prefill_tflops": achieved, "decode_step_s": d, "decode_itl_s": itl, "decode_bound_s": bound}


def long_decode(model, n_ctx: int, steps: int, rows: list) -> dict:
    """Batch-1 decode over an n_ctx-token context: the backend's split decode launch against one
    never split, the two engines taking turns (median of 3 runs each); and the split graphs'
    greedy tokens against the same split run eagerly (same kernels and shares: equal tokens). Both
    token lists come from a cold run: a repeated prompt hits the prefix cache, and its last
    position, recomputed in a one-token step, rounds differently from the long prefill's."""
    def engine(split: int | None, graphs: bool = True) -> LLMEngine:
        return LLMEngine(EngineConfig.from_kwargs(
            model=model, device=DEV, dtype="bfloat16", max_num_batched_tokens=n_ctx + 16,
            num_blocks=n_ctx // 16 + 64, backend=TritonBackend(split_programs=split), cuda_graphs=graphs))

    engines = {"split": engine(None), "unsplit": engine(0)}
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 128000, (n_ctx,), generator=gen).tolist()
    times: dict[str, list[float]] = {k: [] for k in engines}
    toks = {}
    for _ in range(3):
        for name, eng in engines.items():
            dt, out = itl_loop(eng, prompt, steps)
            toks.setdefault(name, out)  # the first run's: cold, as the eager engine's below
            times[name].append(dt)
    res = {k: median(v) for k, v in times.items()}
    ways = sorted(w for _, w in engines["split"].runner.graphs.buffers[1].static._layouts)
    rows.append((f"decode batch 1 over {n_ctx} keys, inter-token latency", f"split {res['split'] * 1e3:.2f} ms, "
                 f"unsplit {res['unsplit'] * 1e3:.2f} ms", f"{res['unsplit'] / res['split']:.2f}x; ways {ways}"))
    del engines
    _, eager = itl_loop(engine(None, graphs=False), prompt, steps)
    rows.append((f"8B greedy tokens over {n_ctx} keys, split graphs == split eager", f"{len(eager)} tokens",
                 eager == toks["split"]))
    return {f"long_decode_{k}_s": v for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=16384)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--long-context", type=int, default=16384)
    ap.add_argument("--skip-checks", action="store_true", help="timings only")
    ap.add_argument("--out", default="gpu_engine.json")
    ap.add_argument("--dry", action="store_true", help="CPU, small model: checks the script, not the GPU")
    args = ap.parse_args()
    global DEV
    rows: list = []
    if args.dry:
        DEV = "cpu"
        args.prefill, args.decode_steps = 256, 4
        peak, bw = 1.0, 1.0
    else:
        peak, bw = peaks()
    rows.append(("bf16 matmul peak (8192^3)", f"{peak:.0f} TFLOP/s", ""))
    rows.append(("device copy bandwidth", f"{bw:.0f} GB/s", ""))
    if not args.skip_checks:
        check_tiny(rows)
    cfg = llama3_8b_config()
    if args.dry:
        cfg = ModelConfig(**{**cfg.__dict__, "hidden_size": 128, "intermediate_size": 256, "num_layers": 2,
                             "num_heads": 4, "num_kv_heads": 2, "head_dim": 32})
    model = random_model(cfg, DEV, torch.bfloat16)
    if not args.skip_checks:
        check_8b(model, rows)
        if not args.dry:
            check_graphs(model, rows)
    res = prefill_and_decode(model, args.prefill, args.decode_steps, peak, bw, rows)
    if not args.dry and args.long_context:
        res.update(long_decode(model, args.long_context, args.decode_steps, rows))
    print(format_table(["check", "value", "note"], rows))
    write_json(args.out if not args.dry else "gpu_engine_dry.json", {"rows": [list(map(str, r)) for r in rows], "peak_tflops": peak, "copy_gbps": bw, **res})


if __name__ == "__main__":
    main()
