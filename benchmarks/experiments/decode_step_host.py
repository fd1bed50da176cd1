"""Host time of a batch-64 decode step, split by phase, through the offline engine and the
the engine client (the server's path).

On a GPU the engine step is synchronous: while the host schedules, samples, detokenizes and
publishes, the GPU idles, so every host millisecond of a decode step adds to it. Here a tiny
random model (tests/tiny_models.py, with its byte-level tokenizer) runs on the CPU, where the
forward is cheap and host work dominates. 64 requests decode together, sampled (temperature 0.8,
top_p 0.95, as chat traffic) or greedy; each phase is timed with perf_counter around the engine's
own methods, on decode-only steps at the full batch:

    schedule   Scheduler.schedule
    runner     ModelRunner.run (host prep + the tiny forward on a CPU)
    sampler    the structured-output mask + Sampler (penalties, filters, draws, .tolist())
    post       the rest of LLMEngine.step: _append (detokenization, stop checks), publish, outputs
    async      client wall per step minus its engine.step time (hand-off to the event loop,
               the consumers' wake-ups, GIL contention with them)

    .venv/bin/python benchmarks/experiments/decode_step_host.py                 # CPU, writes results/decode_step_host.json
    python benchmarks/experiments/decode_step_host.py --gpu                     # random Llama-3-8B bf16, batch 64
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import math
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from common import format_table, llama3_8b_config, random_model, set_threads, weight_shapes, write_json  # noqa: E402

from spanserve.engine.client import RequestSpec  # noqa: E402
from spanserve.engine.inproc import inproc_client  # noqa: E402
from spanserve.engine.config import EngineConfig  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.worker.storage import bytes_per_block  # noqa: E402

PHASES = ("schedule", "runner", "sampler", "post")
MODES = {"sampled": dict(temperature=0.8, top_p=0.95), "greedy": dict(temperature=0.0)}


@dataclasses.dataclass
class PhaseClock:
    """Wraps an engine's step and its parts on the instance (nothing in spanserve changes) and
    keeps per-phase seconds of every decode-only step at the full batch."""

    batch: int
    steps: list[dict[str, float]] = dataclasses.field(default_factory=list)
    _cur: dict[str, float] = dataclasses.field(default_factory=lambda: defaultdict(float))
    _decode: bool = False

    def attach(self, eng: LLMEngine) -> None:
        self._wrap(eng.scheduler, "schedule", "schedule", self._note_schedule)
        self._wrap(eng.runner, "run", "runner")
        self._wrap(eng.grammars, "mask", "sampler")
        self._wrap_call(eng, "sampler", "sampler")
        step = eng.step

        def timed_step() -> Any:
            self._cur = defaultdict(float)
            t0 = time.perf_counter()
            out = step()
            total = time.perf_counter() - t0
            if self._decode:
                cur = dict(self._cur)
                cur["post"] = total - sum(cur.get(p, 0.0) for p in PHASES[:3])
                cur["step"] = total
                self.steps.append(cur)
            return out

        eng.step = timed_step  # type: ignore[method-assign]

    def _note_schedule(self, sched: Any) -> None:
        chunks = sched.chunks
        self._decode = (len(chunks) == self.batch
                        and all(len(c.positions) == 1 and c.recompute is None for c in chunks))

    def _wrap(self, obj: Any, name: str, phase: str, after: Callable[[Any], None] | None = None) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self._cur[phase] += time.perf_counter() - t0
            if after is not None:
                after(out)
            return out

        setattr(obj, name, timed)

    def _wrap_call(self, obj: Any, attr: str, phase: str) -> None:
        inner = getattr(obj, attr)
        clock = self

        class Timed:
            def __call__(self, *a: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                out = inner(*a, **kw)
                clock._cur[phase] += time.perf_counter() - t0
                return out

        setattr(obj, attr, Timed())

    def summary(self, skip: int) -> dict[str, float]:
        rows = self.steps[skip:] or self.steps
        return {k: 1e3 * statistics.median(r.get(k, 0.0) for r in rows) for k in (*PHASES, "step")} | {
            "steps": len(rows)}


def make_engine(args: argparse.Namespace) -> LLMEngine:
    if args.gpu:
        model = random_model(llama3_8b_config(), "cuda", torch.bfloat16)
        kv = bytes_per_block(model.config, 16, torch.bfloat16) * (args.batch * (args.prompt_len + args.tokens) // 16 + 256)
        return LLMEngine(EngineConfig.from_kwargs(
            model=model, device="cuda", dtype="bfloat16", backend="triton", max_num_seqs=args.batch,
            max_num_batched_tokens=max(2048, args.batch * args.prompt_len), kv_cache_memory=kv))
    from tiny_models import make_tiny_model

    path, _ = make_tiny_model("llama", Path(tempfile.mkdtemp(prefix="decode-step-host-")))
    return LLMEngine(EngineConfig.from_kwargs(
        model=str(path), device="cpu", dtype="float32",
        num_blocks=args.batch * (-(-(args.prompt_len + args.tokens) // 16) + 1) + 64,
        max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.prompt_len))


def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]


def params_for(mode: str, args: argparse.Namespace, i: int) -> SamplingParams:
    # chat traffic sends no seed: the sampled rows use the global RNG
    return SamplingParams(max_tokens=args.tokens, ignore_eos=True, **MODES[mode])


def run_offline(eng: LLMEngine, mode: str, args: argparse.Namespace) -> dict[str, float]:
    clock = PhaseClock(args.batch)
    clock.attach(eng)
    for i, p in enumerate(prompts(args, eng.config.vocab_size)):
        eng.add_request(p, params_for(mode, args, i))
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    wall = time.perf_counter() - t0
    return clock.summary(args.warmup) | {"wall_s": wall}


def run_async(eng: LLMEngine, mode: str, args: argparse.Namespace) -> dict[str, float]:
    clock = PhaseClock(args.batch)
    clock.attach(eng)
    specs = [RequestSpec(p, params_for(mode, args, i), f"{mode}-{i}")
             for i, p in enumerate(prompts(args, eng.config.vocab_size))]

    async def main() -> tuple[float, int]:
        aeng = inproc_client(eng)
        aeng.start()
        try:
            streams = await aeng.add_requests(specs)
            first: list[float] = []

            async def consume(s: Any) -> float:
                n = 0
                async for out in s:
                    n += 1
                    if n == 2:
                        first.append(time.perf_counter())
                return time.perf_counter()

            ends = await asyncio.gather(*(consume(s) for s in streams))
            return max(ends) - max(first), args.tokens - 2
        finally:
            await aeng.shutdown()

    wall, steps = asyncio.run(main())
    summ = clock.summary(args.warmup)
    summ["async_step"] = 1e3 * wall / steps
    summ["async"] = max(0.0, summ["async_step"] - 1e3 * statistics.mean(r["step"] for r in clock.steps))
    return summ


def per_call_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - t0) / reps


def side_by_side(eng: LLMEngine, args: argparse.Namespace, reps: int = 30) -> list[dict[str, Any]]:
    """The replaced host functions against their replacements, per batch-`batch` step, in this run:
    the final unit's token copy, the uniform draws of unseeded sampled rows, detokenization."""
    from spanserve.cache.manager import Unit, _follow
    from spanserve.cache.table import slot_array, tail_slots
    from spanserve.engine.sampling import _uniforms

    def per_step(fn: Callable[[], Any]) -> float:
        return per_call_ms(fn, reps)

    ctx, b, dev = args.context, args.batch, eng.device
    rows = [list(range(ctx)) for _ in range(b)]
    units = [Unit(seed=1, start=16, local_start=16, plus=False, final=True, tokens=r[16:]) for r in rows]

    def copy_old() -> None:
        for u, r in zip(units, rows):
            u.tokens = r[u.start:]

    def copy_new() -> None:
        for u, r in zip(units, rows):
            r.append(7)  # generation appends one token per step
            _follow(u, r)

    table = np.stack([np.arange(ctx // 16), np.zeros(ctx // 16, np.int64), np.full(ctx // 16, 16)], 1)
    cached = [slot_array(table, 16) for _ in range(b)]

    def slots_old() -> None:
        for _ in range(b):
            slot_array(table, 16)

    def slots_new() -> None:
        for s in cached:
            np.concatenate([s, tail_slots(table, 1, 16)])

    vocab = eng.config.vocab_size
    gens = [None] * b

    def draw_old() -> None:
        u = torch.empty((b, vocab), dtype=torch.float64, device=dev)
        for i, g in enumerate(gens):
            u[i].uniform_(generator=g)
        u[-1, -1].item()

    def draw_new() -> None:
        _uniforms(torch.Size((b, vocab)), dev, gens)[-1, -1].item()

    out = [{"what": f"final unit tokens, context {ctx}", "old_ms": per_step(copy_old), "new_ms": per_step(copy_new)},
           {"what": f"key slots, context {ctx}", "old_ms": per_step(slots_old), "new_ms": per_step(slots_new)},
           {"what": f"uniforms, {b} unseeded rows x {vocab}", "old_ms": per_step(draw_old),
            "new_ms": per_step(draw_new)}]
    if eng.tokenizer is not None:
        ids = [torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(b)]
        old = lambda: [eng.tokenizer.decode(x[-6:], skip_special_tokens=True) for x in ids for _ in (0, 1)]  # noqa: E731
        new = lambda: [eng._decode(x[-6:]) for x in ids for _ in (0, 1)]  # noqa: E731
        out.append({"what": f"detokenize windows, 2 per row x {b}", "old_ms": per_step(old), "new_ms": per_step(new)})
    return out


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--context", type=int, default=2048, help="context of the token-copy comparison")
    ap.add_argument("--warmup", type=int, default=3, help="decode steps left out of the medians")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gpu", action="store_true", help="random Llama-3-8B bf16 on cuda, ~100 decode steps")
    ap.add_argument("--gbps", type=float, default=2740.0, help="measured HBM bandwidth for the roofline")
    ap.add_argument("--phases-only", action="store_true",
                    help="skip the side-by-side comparison (to time an older spanserve on PYTHONPATH)")
    ap.add_argument("--out", default="decode_step_host.json")
    args = ap.parse_args(argv)
    if args.gpu and args.tokens == 64:
        args.tokens = 110
    set_threads(args.threads)
    results: dict[str, dict[str, float]] = {}
    sbs: list[dict[str, Any]] = []
    for mode in MODES:
        for path, fn in (("offline", run_offline), ("async", run_async)):
            eng = make_engine(args)
            results[f"{path}/{mode}"] = fn(eng, mode, args)
            if not sbs and not args.phases_only:  # on a finished engine: its device, vocabulary, tokenizer
                sbs = side_by_side(eng, args)
            eng.shutdown()
            del eng
            free_device_memory()
    headers = ["path/mode", "steps", *PHASES, "async", "step ms"]
    rows = [[k, int(v["steps"]), *(v[p] for p in PHASES), v.get("async", 0.0),
             v.get("async_step", v["step"])] for k, v in results.items()]
    print(f"decode steps at batch {args.batch}, median ms per step by phase")
    print(format_table(headers, rows))
    if sbs:
        print(f"\nreplaced vs replacing host functions, ms per step at batch {args.batch} (same run)")
        print(format_table(["what", "old ms", "new ms"], [[r["what"], r["old_ms"], r["new_ms"]] for r in sbs]))
    payload: dict[str, Any] = {"args": vars(args), "phases_ms": results, "side_by_side": sbs}
    if args.gpu:
        payload["roofline"] = roofline(args)
        print(f"roofline (weights + KV over {args.gbps:.0f} GB/s): {payload['roofline']['roofline_ms']:.2f} ms")
    print("wrote", write_json(args.out, payload))


def roofline(args: argparse.Namespace) -> dict[str, float]:
    cfg = llama3_8b_config()
    weights = 2 * sum(math.prod(s) for s in weight_shapes(cfg).values())
    kv_tok = bytes_per_block(cfg, 16, torch.bfloat16) / 16
    mean_ctx = args.prompt_len + args.tokens / 2
    nbytes = weights + args.batch * mean_ctx * kv_tok
    return {"weight_bytes": weights, "kv_bytes_per_token": kv_tok, "roofline_ms": 1e3 * nbytes / (args.gbps * 1e9)}


if __name__ == "__main__":
    main()
