"""Tensor parallelism on two GPUs, TP=2 against TP=1 in one run (random bf16 weights, Triton).

Default (Llama-3-8B shape):
1. greedy tokens of TP=2 against TP=1 on span layouts (cold, then warm with the documents at new
   positions), for --greedy-tokens tokens, with the row-parallel sums in bf16 and in float32, and
   TP=2's against TP=1 emulating TP=2 (`emulate_tp=2`, which must give them bit for bit);
2. prefill of --prefill plain tokens, and decode at batch 1 and batch 64: TP=1 and TP=2 side by
   side (the engines one after the other in this process).

--model-shape 70b (Llama-3-70B shape, ~141 GB: only TP=2 holds it; each rank creates its own
shard on its GPU, the whole model never exists): a RAG layout of --docs documents of --doc-len
tokens, pinned, then read warm at new positions with a new question: its TTFT next to the stock
prefill of the same tokens as one plain prompt.

    NCCL_NVLS_ENABLE=0 python benchmarks/tp_gpu.py
    NCCL_NVLS_ENABLE=0 python benchmarks/tp_gpu.py --model-shape 70b
    NCCL_NVLS_ENABLE=0 python benchmarks/tp_gpu.py --kv-cache-dtype fp8 --quantization fp8 --variants tp2 tp1emu
    python benchmarks/tp_gpu.py --dry          # CPU, gloo, tiny shape: checks the script
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (inherited by workers)

import torch  # noqa: E402

from common import format_table, llama3_8b_config, median, random_tokens, tiny_llama_config, write_json  # noqa: E402

from spanserve.engine.config import EngineConfig  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.engine.layout import Segment  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.model.config import ModelConfig  # noqa: E402
from spanserve.model.shapes import llama3_70b  # noqa: E402
from spanserve.model.weights import RandomWeights  # noqa: E402


class Run:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.dev = "cpu" if args.dry else "cuda"
        self.dtype = "float32" if args.dry else args.dtype

    def sync(self) -> None:
        if self.dev == "cuda":
            torch.cuda.synchronize()

    def backend(self, v: "Variant") -> Any:
        if self.dev != "cuda":
            return None  # the reference backend (Triton's CPU interpreter is too slow for a dry run)
        from spanserve.attention.triton import TritonBackend
        tiles = self.args.decode_min_tiles if v.decode_min_tiles is None else v.decode_min_tiles
        # split_scale 2: TP=1 cuts its attention launches as TP=2's ranks do (half the KV heads each)
        return TritonBackend(decode_min_tiles=tiles).for_shards(v.split_scale)

    def engine(self, config: ModelConfig, v: "Variant", **kw: Any) -> LLMEngine:
        t0 = time.perf_counter()
        eng = LLMEngine(EngineConfig.from_kwargs(
            model=RandomWeights(config, seed=self.args.seed), device=self.dev, dtype=self.dtype,
            backend=self.backend(v), tensor_parallel_size=v.tp, emulate_tp=v.emulate,
            tp_float32_reduce=v.float32_reduce, overlap=v.overlap, tp_peer_sum=v.peer_sum,
            cuda_graphs=not self.args.no_graphs and "auto", kv_cache_dtype=self.args.kv_cache_dtype,
            quantization=self.args.quantization, **kw))
        print(f"{v.name}: engine up in {time.perf_counter() - t0:.1f} s", flush=True)
        return eng

    def close(self, eng: LLMEngine) -> None:
        eng.shutdown()
        if self.dev == "cuda":
            torch.cuda.empty_cache()

    def synced_step(self, eng: LLMEngine) -> float:
        self.sync()
        t0 = time.perf_counter()
        eng.step()
        self.sync()
        return time.perf_counter() - t0

    def drain(self, eng: LLMEngine) -> None:
        while eng.has_unfinished():
            eng.step()

    # ---- measurements ------------------------------------------------------------------------
    def greedy(self, eng: LLMEngine, vocab: int) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """Greedy tokens of span layouts (cold, then the same documents at other positions) and,
        at each, the logprob gap between the chosen token and the runner-up, taking decode steps
        one at a time; then the same layouts again in a fresh namespace with the engine's default
        (decode steps chained on the device, where it chains)."""
        gen = torch.Generator().manual_seed(7)
        t = lambda n: random_tokens(gen, n, vocab)  # noqa: E731
        docs = [t(n) for n in (300, 211, 157)]
        sys_, qs = t(23), [t(17) for _ in range(3)]
        lays = [[Segment(token_ids=sys_)] + [Segment(token_ids=docs[i], kind="plus") for i in order]
                + [Segment(token_ids=q)] for order, q in zip(([0, 1, 2], [2, 0, 1], [1, 2]), qs)]
        params = SamplingParams(max_tokens=self.args.greedy_tokens, temperature=0, ignore_eos=True, logprobs=2)
        out, gaps, chained = [], [], []
        overlap, eng.overlap = eng.overlap, False  # this pass takes its steps one at a time
        for lay in lays:  # one at a time: the later ones read the first one's cached documents
            req = eng.add_request(lay, params)
            self.drain(eng)
            out.append(list(req.output_token_ids))
            gaps.append([_gap(lp.top) for lp in req.logprobs])
        eng.overlap = overlap
        for lay in lays:
            req = eng.add_request(lay, params, namespace="chained")
            self.drain(eng)
            chained.append(list(req.output_token_ids))
        return out, gaps, chained

    def prefill(self, eng: LLMEngine, vocab: int) -> float:
        gen = torch.Generator().manual_seed(2)
        times = []
        for _ in range(3):
            eng.add_request(random_tokens(gen, self.args.prefill, vocab), SamplingParams(max_tokens=1))
            times.append(self.synced_step(eng))
            self.drain(eng)
        return median(times[1:])

    def decode(self, eng: LLMEngine, vocab: int, batch: int) -> float:
        """Seconds per decode step of `batch` requests of --context-token prompts (steady state)."""
        gen = torch.Generator().manual_seed(3 + batch)
        steps = self.args.decode_steps
        for _ in range(batch):
            eng.add_request(random_tokens(gen, self.args.context, vocab),
                            SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0))
        while any(len(r.output_token_ids) < 4 for r in eng.requests.values()) or eng.scheduler.waiting:
            eng.step()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        self.sync()
        dt = (time.perf_counter() - t0) / steps
        self.drain(eng)
        return dt

    def timings(self, eng: LLMEngine, vocab: int) -> dict[str, float]:
        res = {"prefill_s": self.prefill(eng, vocab)}
        for b in self.args.batches:
            res[f"decode_b{b}_s"] = median([self.decode(eng, vocab, b) for _ in range(self.args.decode_repeats if b == 1 else 1)])
        return res


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    tp: int
    float32_reduce: bool = False
    split_scale: int = 1
    overlap: bool | None = None  # None: the engine's default (decode steps chained on the device)
    peer_sum: bool = True  # short steps' sums through GPU peer memory (where available)
    emulate: int = 1  # TP=1 computing as this many ranks do (emulate_tp)
    decode_min_tiles: int | None = None  # None: --decode-min-tiles
    timed: bool = True  # False: greedy tokens only


VARIANTS = {"tp1": Variant("TP=1", 1), "tp2": Variant("TP=2", 2), "tp2f32": Variant("TP=2 f32-reduce", 2, True),
            "tp1split": Variant("TP=1, TP=2's attention split", 1, split_scale=2),
            "tp1step": Variant("TP=1 unchained", 1, overlap=False),
            "tp2step": Variant("TP=2 unchained", 2, overlap=False),
            "tp2nccl": Variant("TP=2 NCCL sums", 2, peer_sum=False),
            "tp1emu": Variant("TP=1 emulating TP=2", 1, emulate=2, timed=False),
            "tp1tiles1": Variant("TP=1, decode splits of >= 1 tile", 1, decode_min_tiles=1),
            "tp2tiles1": Variant("TP=2, decode splits of >= 1 tile", 2, decode_min_tiles=1)}


def _gap(top: dict[int, float]) -> float:
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def shape_8b(run: Run) -> None:
    args = run.args
    cfg = tiny_llama_config() if args.dry else llama3_8b_config()
    blocks = (args.prefill + max(args.batches) * (args.context + args.decode_steps + 16)) // 16 + 512
    kw = dict(num_blocks=blocks, max_num_batched_tokens=args.prefill + 16, max_num_seqs=max(args.batches))
    variants = [VARIANTS["tp1"]] + [VARIANTS[x] for x in args.variants]
    tokens: dict[str, list[list[int]]] = {}
    chained: dict[str, list[list[int]]] = {}
    gaps: dict[str, list[list[float]]] = {}
    res: dict[str, dict[str, float]] = {}
    for v in variants:
        name = v.name
        eng = run.engine(cfg, v, **kw)
        steps0 = eng.chained_steps
        tokens[name], gaps[name], chained[name] = run.greedy(eng, cfg.vocab_size)
        chained_steps = eng.chained_steps - steps0
        print(f"{name}: {chained_steps} decode steps chained on the device; their tokens equal the unchained "
              f"pass's: {chained[name] == tokens[name]}", flush=True)
        res[name] = run.timings(eng, cfg.vocab_size) if v.timed and not args.skip_timing else {}
        run.close(eng)
        del eng  # gone before the next engine loads
        gc.collect()
        if run.dev == "cuda":
            torch.cuda.empty_cache()
    rows = []
    base_gaps = gaps["TP=1"]
    for v in variants[1:]:
        same = [first_difference(a, b) for a, b in zip(tokens[v.name], tokens["TP=1"])]
        at = [f"{g[n]:.3g}" if n < len(g) else "-" for g, n in zip(base_gaps, same)]
        rows.append((f"{v.name} (3 layouts, cold then warm)", " / ".join(f"{n}" for n in same) + f" of {args.greedy_tokens}",
                     all(n == args.greedy_tokens for n in same), " / ".join(at)))
    emulated = "TP=1 emulating TP=2"
    if emulated in tokens and "TP=2" in tokens:  # the bitwise reference of TP=2's numerics
        same = [first_difference(a, b) for a, b in zip(tokens["TP=2"], tokens[emulated])]
        rows.append((f"TP=2 against {emulated}", " / ".join(f"{n}" for n in same) + f" of {args.greedy_tokens}",
                     all(n == args.greedy_tokens for n in same), "-"))
    print(format_table(["greedy tokens against TP=1", "equal", "all", "TP=1's top-2 gap where they part"], rows))
    print("TP=1's smallest top-2 logprob gap per layout: " + " / ".join(f"{min(g):.3g}" for g in base_gaps))
    table = []
    if not args.skip_timing:
        base = res["TP=1"]
        names = [v.name for v in variants if res[v.name]]
        metrics = [("prefill_s", f"prefill {args.prefill} tokens, tokens/s", lambda s: args.prefill / s)]
        metrics += [(f"decode_b{b}_s", f"decode batch {b} at {args.context} tokens, ms/step", lambda s: s * 1e3)
                    for b in args.batches]
        for key, label, fmt in metrics:
            row = [label] + [f"{fmt(res[n][key]):.2f}" for n in names]
            row += [f"{res[n][key] / base[key]:.3f}x time" for n in names[1:]]
            table.append(row)
        print(format_table(["", *names, *[f"{n} / TP=1" for n in names[1:]]], table))
    write_json(args.out or ("tp_gpu_dry.json" if args.dry else "tp_gpu.json"), {
        "benchmark": "tp_gpu", "shape": cfg.name, "args": vars(args), "timings_s": res, "greedy_tokens": tokens,
        "greedy_tokens_chained": chained,
        "top2_logprob_gaps": gaps,
        "checks": [list(map(str, r)) for r in rows], "table": table,
        "device": torch.cuda.get_device_name(0) if run.dev == "cuda" else "cpu"})


def shape_70b(run: Run) -> None:
    """Warm RAG TTFT next to the stock prefill of the same tokens, TP=2 only."""
    args = run.args
    cfg = tiny_llama_config() if args.dry else llama3_70b()
    n, L, qlen = args.docs, args.doc_len, 64
    total = n * L + qlen
    blocks = 2 * (total // 16 + n + 8) + 64  # the pinned documents + one whole stock request
    eng = run.engine(cfg, Variant("TP=2", 2, args.float32_reduce), num_blocks=blocks, max_num_batched_tokens=args.chunk,
                     max_num_seqs=4, pin_fraction=0.5)
    gen = torch.Generator().manual_seed(11)
    docs = [random_tokens(gen, L, cfg.vocab_size) for _ in range(n)]
    t0 = time.perf_counter()
    pin = eng.pin([Segment(token_ids=d, kind="plus", key=f"doc-{i}") for i, d in enumerate(docs)])
    run.drain(eng)
    pin_s = time.perf_counter() - t0
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ttft: dict[str, list[float]] = {"stock": [], "warm": []}
    for r in range(args.runs + 1):  # run 0 is a warm-up (kernels compile per shape)
        q = random_tokens(gen, qlen, cfg.vocab_size)
        order = torch.randperm(n, generator=gen).tolist()
        prompts = {"stock": [t for i in order for t in docs[i]] + q,
                   "warm": [Segment(token_ids=docs[i], kind="plus") for i in order] + [Segment(token_ids=q)]}
        for v, p in prompts.items():
            req = eng.add_request(p, one, namespace="" if v == "warm" else f"stock-{r}")
            run.drain(eng)
            if v == "warm":
                assert req.reuse["segment"] >= n * L - n * 16, req.reuse
            if r:
                ttft[v].append(req.first_token_time - req.arrival_time)
        print(f"run {r}: " + "  ".join(f"{v} {ttft[v][-1] * 1e3:.1f} ms" for v in ttft if r), flush=True)
    med = {v: median(x) for v, x in ttft.items()}
    rows = [(f"{cfg.name} TP=2, {n} docs x {L} tokens + {qlen}-token question ({total} tokens)",
             f"{med['stock'] * 1e3:.1f}", f"{med['warm'] * 1e3:.1f}", f"{med['stock'] / med['warm']:.1f}x",
             f"{pin_s:.1f}")]
    print(format_table(["", "stock TTFT ms", "warm TTFT ms", "stock/warm", "pinning s"], rows))
    del pin
    run.close(eng)
    write_json("tp_gpu_70b_dry.json" if args.dry else "tp_gpu_70b.json", {
        "benchmark": "tp_gpu_70b", "shape": cfg.name, "args": vars(args), "ttft_s": ttft, "median_ttft_s": med,
        "pin_s": pin_s, "table": [list(map(str, r)) for r in rows]})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-shape", choices=["8b", "70b"], default="8b")
    ap.add_argument("--prefill", type=int, default=16384)
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of each decoding request")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--decode-repeats", type=int, default=3, help="batch-1 decode runs (their median is reported)")
    ap.add_argument("--greedy-tokens", type=int, default=40)
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--doc-len", type=int, default=2857)
    ap.add_argument("--chunk", type=int, default=16384, help="max_num_batched_tokens of the 70B engine")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--float32-reduce", action="store_true", help="70B: row-parallel sums in float32")
    ap.add_argument("--no-graphs", action="store_true", help="every step eager (no CUDA graphs)")
    ap.add_argument("--variants", nargs="+", choices=[k for k in VARIANTS if k != "tp1"], default=["tp2", "tp2f32"],
                    help="engines run after TP=1: TP=2, TP=2 with float32 sums, TP=1 with TP=2's attention split "
                         "(a control), TP=1 and TP=2 taking decode steps one at a time (no chaining on the device), "
                         "TP=2 with every sum through NCCL (no peer memory), TP=1 emulating TP=2's numerics, "
                         "TP=1 and TP=2 with decode splits of at least 1 tile")
    ap.add_argument("--decode-min-tiles", type=int, default=4,
                    help="the Triton backend's decode_min_tiles (its default; the variants *tiles1 set 1)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="every engine's KV cache")
    ap.add_argument("--quantization", choices=["fp8"], default=None, help="every engine's linear weights")
    ap.add_argument("--out", help="8B: the JSON's name under benchmarks/results (default tp_gpu.json)")
    ap.add_argument("--skip-timing", action="store_true", help="8B: greedy checks only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry", action="store_true", help="CPU, gloo, tiny shape and sizes: checks the script")
    args = ap.parse_args(argv)
    if args.dry:
        args.prefill, args.context, args.batches, args.decode_steps = 128, 32, [1, 4], 4
        args.greedy_tokens, args.docs, args.doc_len, args.chunk, args.runs = 8, 4, 40, 64, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = Run(args)
    if args.model_shape == "70b":
        shape_70b(run)
    else:
        shape_8b(run)


if __name__ == "__main__":
    main(sys.argv[1:])
