"""Where a tensor-parallel decode step's time goes, TP=1 against TP=2 in one run.

Decode at batch 1 (random Llama-3-8B bf16, Triton, CUDA graphs), TP=1 and TP=2, each step taken
on its own (no chaining on the device: the phases below are what chaining hides):
   - step: `LLMEngine.step` wall time, nothing added;
   - floor: the same prepared step run back to back without scheduling, sampling or bookkeeping
     (TP=2: the step message is still sent each time), one sync at the end: what the GPU work and
     the message leave;
   - phases: each part of a step behind a CUDA sync (schedule, prepare, send, forward, LM head,
     sampler, rest), which serialises the step and so adds up to more than `step`;
   - kernels (--kernels): the floor loop under torch.profiler on rank 0, GPU time per step by
     kernel family, and the GPU's idle time per step (rank 0's first sum also waits for rank 1).

    NCCL_NVLS_ENABLE=0 python benchmarks/experiments/tp_decode.py
    NCCL_NVLS_ENABLE=0 python benchmarks/experiments/tp_decode.py --chained --kernels   # chained steps' GPU idle
    python benchmarks/experiments/tp_decode.py --dry     # CPU, gloo, tiny shape: checks the script
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (inherited by workers)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, llama3_8b_config, median, random_tokens, tiny_llama_config, write_json  # noqa: E402

import spanserve.engine.engine as engine_module  # noqa: E402
from spanserve.engine.config import EngineConfig  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.model.weights import RandomWeights  # noqa: E402


# ---- decode phases ----------------------------------------------------------------------------
class Phases:
    """Wraps the engine's parts on the instance; with `sync`, each part ends in a CUDA sync."""

    def __init__(self, eng: LLMEngine, cuda: bool):
        self.eng, self.cuda = eng, cuda
        self.cur: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.sync = False
        self.last_step: Any = None
        r = eng.executor
        self._wrap(eng.scheduler, "schedule", "schedule")
        self._wrap(engine_module, "prepare", "prepare", keep=True)  # the engine's own reference to it
        self._wrap(r, "execute", "forward")
        self._wrap(r, "logits", "lm_head")
        if eng.tp is not None:
            self._wrap(eng.tp.group, "send", "send")
        inner = eng.sampler
        phases = self

        class TimedSampler:
            def __call__(self, *a: Any, **kw: Any) -> Any:
                return phases._time("sampler", lambda: inner(*a, **kw))

            def pick(self, *a: Any, **kw: Any) -> Any:  # chained steps pick on the device
                return phases._time("sampler", lambda: inner.pick(*a, **kw))

            def __getattr__(self, name: str) -> Any:  # the rest of the sampler, untimed
                return getattr(inner, name)

        eng.sampler = TimedSampler()  # type: ignore[assignment]

    def _time(self, name: str, fn: Callable[[], Any]) -> Any:
        if self.sync and self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if self.sync and self.cuda:
            torch.cuda.synchronize()
        self.cur[name] += time.perf_counter() - t0
        return out

    def _wrap(self, obj: Any, attr: str, name: str, keep: bool = False) -> None:
        fn = getattr(obj, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            out = self._time(name, lambda: fn(*a, **kw))
            if keep:
                self.last_step = out
            return out

        setattr(obj, attr, timed)

    def step(self) -> float:
        self.cur = defaultdict(float)
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.eng.step()
        if self.cuda:
            torch.cuda.synchronize()
        total = time.perf_counter() - t0
        self.cur["rest"] = total - sum(self.cur.values())
        self.steps.append(dict(self.cur) | {"step": total})
        return total


def floor_run(eng: LLMEngine, step: Any) -> Callable[[], Any]:
    """One run of the prepared decode step: forward + LM head (+ the message under TP)."""
    r = eng.executor
    return lambda: r.run(step)


def floor_ms(eng: LLMEngine, step: Any, n: int, cuda: bool) -> float:
    """The prepared decode step run back to back, one sync at the end."""
    run = floor_run(eng, step)
    run()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        run()
    if cuda:
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / n


KERNEL_FAMILIES = [("nccl", "collectives (NCCL)"), ("peer_sum", "sums (peer memory)"), ("splitkreduce", "GEMM"), ("gemv", "GEMM"), ("gemm", "GEMM"),
                   ("sm90", "GEMM"), ("cutlass", "GEMM"), ("attention", "attention"), ("decode", "attention"),
                   ("combine", "attention"), ("rms", "norms"), ("rotary", "rotary"), ("silu", "silu*up"),
                   ("write", "KV write"), ("copy", "copies"), ("elementwise", "elementwise"), ("", "other")]


def family(name: str) -> str:
    low = name.lower()
    return next(f for key, f in KERNEL_FAMILIES if key in low)


def kernel_profile(run: Callable[[], Any], n: int) -> dict[str, Any]:
    """GPU microseconds per step by kernel family over n runs, the busiest kernels, and idle time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    fam: dict[str, float] = defaultdict(float)
    names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        fam[family(e.name)] += us / n
        names[e.name][0] += us / n
        names[e.name][1] += 1 / n
    busy = sum(fam.values())
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:12]
    return {"wall_us_per_step": 1e6 * wall / n, "busy_us_per_step": busy, "families_us": dict(fam),
            "top_kernels": [(k[:90], round(v[0], 1), round(v[1], 1)) for k, v in top]}


def chained_profile(eng: LLMEngine, args: argparse.Namespace, synced: list[float]) -> dict[str, Any]:
    """Steps chained on the device: wall time of n back-to-back engine steps, and (--kernels) the
    GPU's busy time in them: what is left of the host on the critical path is the idle."""
    cuda = eng.device.type == "cuda"

    def steps(n: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t0) / n

    out: dict[str, Any] = {"synced_step_ms": 1e3 * median(synced), "step_ms": steps(args.steps)}
    if args.kernels and cuda:
        out["kernels"] = kernel_profile(eng.step, 20)
    return out


def decode_profile(args: argparse.Namespace, tp: int) -> dict[str, Any]:
    cfg = tiny_llama_config() if args.dry else llama3_8b_config()
    dev = "cpu" if args.dry else "cuda"
    backend = None
    if not args.dry:
        from spanserve.attention.triton import TritonBackend
        backend = TritonBackend()
    eng = LLMEngine(EngineConfig.from_kwargs(
        model=RandomWeights(cfg, seed=0), device=dev, dtype="float32" if args.dry else "bfloat16",
        backend=backend, tensor_parallel_size=tp, overlap=args.chained,
        num_blocks=(args.context + 2 * args.steps + 64) // 16 + 64, max_num_seqs=4,
        max_num_batched_tokens=max(args.context, 256)))
    try:
        ph = Phases(eng, dev == "cuda")
        gen = torch.Generator().manual_seed(5)
        eng.add_request(random_tokens(gen, args.context, cfg.vocab_size),
                        SamplingParams(max_tokens=3 * args.steps + 16, ignore_eos=True, temperature=0))
        for _ in range(8):  # prefill, then decode graphs captured
            ph.step()
        ph.steps.clear()
        plain = [ph.step() for _ in range(args.steps)]
        if args.chained:  # engine steps back to back: a sync between them would undo the chaining
            return chained_profile(eng, args, plain)
        ph.steps.clear()
        ph.sync = True
        for _ in range(args.steps):
            ph.step()
        phases = {k: 1e3 * median([s.get(k, 0.0) for s in ph.steps]) for k in
                  ("schedule", "prepare", "send", "forward", "lm_head", "sampler", "rest", "step")}
        ph.sync = False
        floor = floor_ms(eng, ph.last_step, args.steps, dev == "cuda")
        out: dict[str, Any] = {"step_ms": 1e3 * median(plain), "floor_ms": floor}
        out |= {f"{k}_ms": v for k, v in phases.items()}
        if args.kernels and dev == "cuda":
            out["kernels"] = kernel_profile(floor_run(eng, ph.last_step), 20)
        return out
    finally:
        eng.shutdown()
        del eng
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--kernels", action="store_true", help="GPU time per kernel family (torch.profiler)")
    ap.add_argument("--chained", action="store_true",
                    help="decode steps chained on the device (the engine's default on a GPU): step times and "
                         "GPU busy time of back-to-back engine steps instead of the phases")
    ap.add_argument("--out", default=None, help="JSON name under benchmarks/results (default tp_decode.json)")
    ap.add_argument("--dry", action="store_true", help="CPU, gloo, tiny shape: checks the script")
    args = ap.parse_args(argv)
    if args.dry:
        args.context, args.steps = 32, 4
    out: dict[str, Any] = {"benchmark": "tp_decode", "args": vars(args)}
    variants = [("TP=1", 1), ("TP=2", 2)]
    res = out["decode_b1"] = {name: decode_profile(args, tp) for name, tp in variants}
    keys = (["synced_step", "step"] if args.chained else
            ["step", "floor", "schedule", "prepare", "send", "forward", "lm_head", "sampler", "rest"])
    print(format_table(["ms", *res], [(k, *(f"{res[n][k + '_ms']:.3f}" for n in res)) for k in keys]))
    base = res["TP=1"]["step_ms"]
    print("step / TP=1: " + ", ".join(f"{n} {r['step_ms'] / base:.3f}x" for n, r in res.items()))
    for n, r in res.items():
        if "kernels" in r:
            k = r["kernels"]
            fams = sorted(k["families_us"].items(), key=lambda kv: -kv[1])
            print(f"{n} kernels, us/step: wall {k['wall_us_per_step']:.0f}, busy {k['busy_us_per_step']:.0f}; "
                  + ", ".join(f"{f} {us:.0f}" for f, us in fams))
            for name, us, count in k["top_kernels"]:
                print(f"    {us:8.1f} us {count:5.1f}x  {name}")
    out["device"] = torch.cuda.get_device_name(0) if not args.dry else "cpu"
    name = "tp_decode_chained" if args.chained else "tp_decode"
    write_json(args.out or (f"{name}_dry.json" if args.dry else f"{name}.json"), out)


if __name__ == "__main__":
    main(sys.argv[1:])
