"""RAG time to first token versus the number of retrieved documents (the span-query paper's §5.6
microbenchmark): a stock prompt, a span layout encoded cold, and the same layout warm.

    .venv/bin/python benchmarks/rag_ttft.py            # CPU: SmolLM2 float32, L=512, N in 1..16
    .venv/bin/python benchmarks/rag_ttft.py --quick    # CPU smoke: L=128, N in 1,2,4, 2 runs
    python benchmarks/rag_ttft.py --gpu                # CUDA: random Llama-3-8B bf16, L=2857, N in 1..32

N documents of L random tokens and a 64-token random question (a new one each run). Every TTFT
is the engine's metrics["ttft"] (arrival to first token) of one request run alone, with one
generated token:

  stock  a plain prompt: the documents concatenated in a new random order, then the question;
         each run uses a cache namespace of its own, so nothing of an earlier run is reused
         (earlier runs' blocks stay in the pool, evictable, as in a live server)
  cold   [plus doc_1, ..., plus doc_N, cross question], each run in a fresh namespace, so every
         segment is encoded (position-free) and the question read over them
  warm   the same layout in a new random order, the documents already cached (pinned before the
         runs at each N): only the question is computed

The variants of a run go back to back, their order rotating from run to run; medians of --runs.
The warm documents are pinned while their N is measured, and the KV pool holds them plus one
whole request, so LRU eviction only ever drops blocks of earlier stock/cold runs; every run's
reuse counters are checked (stock and cold: nothing cached, warm: every document token).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from common import (
    format_table,
    llama3_8b_config,
    median,
    random_model,
    random_tokens,
    rotated,
    save_figure,
    set_threads,
    write_json,
)

from spanserve.attention.kv_cache import cache_dtype
from spanserve.engine.layout import Segment
from spanserve.engine.params import SamplingParams
from spanserve.llm import LLM
from spanserve.model.loader import LoadedModel, load_model
from spanserve.model.weights import RandomWeights
from spanserve.worker.storage import bytes_per_block

VARIANTS = ("stock", "cold", "warm")
BLOCK_SIZE = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="CUDA, random Llama-3-8B-shaped weights, bf16")
    ap.add_argument("--ns", type=int, nargs="+", default=None, help="document counts (default 1 2 4 8 16 [32 on GPU])")
    ap.add_argument("--doc-len", type=int, default=None, help="tokens per document (default 512, 2857 on GPU)")
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--discard", type=int, default=None,
                    help="untimed runs before the timed ones at each N (default 0 on CPU, 1 on GPU: "
                         "kernels may compile per shape)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU; 0 = torch's default")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="0 = enough for the largest prompt")
    ap.add_argument("--kv-gib", type=float, default=0.0, help="KV pool size; 0 = the pinned docs + one whole request")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPU: one process per GPU)")
    ap.add_argument("--quick", action="store_true", help="smoke run: L=128, N in 1 2 4, 2 runs")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--out", default=None, help="file name under benchmarks/results/")
    args = ap.parse_args(argv)
    if args.quick:
        args.doc_len, args.ns, args.runs = args.doc_len or 128, args.ns or [1, 2, 4], 2
    args.ns = sorted(args.ns or ([1, 2, 4, 8, 16, 32] if args.gpu else [1, 2, 4, 8, 16]))
    args.doc_len = args.doc_len or (2857 if args.gpu else 512)
    args.discard = (1 if args.gpu else 0) if args.discard is None else args.discard
    if args.out is None:
        fp8 = ("_fp8kv" if args.kv_cache_dtype == "fp8" else "") + ("_fp8w" if args.quantization else "")
        args.out = ("rag_ttft" + ("_gpu" if args.gpu else "") + (f"_tp{args.tp}" if args.tp > 1 else "") + fp8
                    + ("_quick" if args.quick else "") + ".json")
    return args


def attention_backend() -> Any:
    """The Triton backend when it exists and imports; otherwise None (the engine's reference)."""
    try:
        from spanserve.attention.triton import TritonBackend
    except Exception as e:  # not written yet, or triton missing: time the reference backend
        warnings.warn(f"TritonBackend unavailable ({type(e).__name__}: {e}); using the reference backend, "
                      "which materializes dense masks and will not scale to long GPU prompts")
        return None
    return TritonBackend()


def build_llm(model: "LoadedModel | RandomWeights", args: argparse.Namespace, device: str, dtype: torch.dtype) -> LLM:
    longest = max(args.ns) * args.doc_len + args.question_len
    config = model.config
    if longest >= config.max_position_embeddings:
        # SmolLM2 has 8192 positions, one short of 16 x 512 + 64. RoPE is defined at any position
        # and these are random tokens, so lifting the limit changes nothing about the timing.
        print(f"note: the longest prompt ({longest} tokens) exceeds {config.name}'s "
              f"{config.max_position_embeddings} positions; lifting the limit for this benchmark")
        model = dataclasses.replace(model, config=dataclasses.replace(config, max_position_embeddings=2 * longest))
    per_block = bytes_per_block(model.config, BLOCK_SIZE, cache_dtype(args.kv_cache_dtype, dtype))
    # Pinned warm documents + one whole request (a stock or cold run evicts earlier runs' blocks).
    doc_blocks = max(args.ns) * -(-args.doc_len // BLOCK_SIZE)
    request_blocks = doc_blocks + -(-args.question_len // BLOCK_SIZE) + 2
    blocks = doc_blocks + request_blocks + 64
    kv = int(args.kv_gib * 2**30) if args.kv_gib else blocks * per_block
    pin_fraction = min(1.0, (doc_blocks + 1) / (kv // per_block))
    mbt = args.max_num_batched_tokens or longest
    print(f"KV pool {kv / 2**30:.2f} GiB ({kv // per_block} blocks), max_num_batched_tokens {mbt}", flush=True)
    extra: dict[str, Any] = {}
    if device == "cuda":
        extra["backend"] = attention_backend()
    dtype_name = str(dtype).removeprefix("torch.")
    if args.tp > 1:  # each rank holds 1/tp of every block
        extra["tensor_parallel_size"] = args.tp
    return LLM(model, device=device, dtype=dtype_name, block_size=BLOCK_SIZE, kv_cache_memory=kv // args.tp,
               max_num_batched_tokens=mbt, max_num_seqs=4, pin_fraction=pin_fraction,
               kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, **extra)


class Bench:
    def __init__(self, llm: LLM, question_len: int, seed: int):
        self.llm = llm
        self.question_len = question_len
        self.gen = torch.Generator().manual_seed(seed)
        self.params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.vocab = llm.engine.config.vocab_size

    def tokens(self, n: int) -> list[int]:
        return random_tokens(self.gen, n, self.vocab)

    def order(self, n: int) -> list[int]:
        return torch.randperm(n, generator=self.gen).tolist()

    def run(self, prompt: Any, namespace: str) -> dict[str, Any]:
        out = self.llm.generate(prompt, self.params, namespace=namespace)[0]
        return out.metrics

    def variant(self, name: str, docs: list[list[int]], question: list[int], tag: str) -> dict[str, Any]:
        perm = [docs[i] for i in self.order(len(docs))]
        if name == "stock":
            return self.run([t for d in perm for t in d] + question, f"stock-{tag}")
        layout = [Segment(token_ids=d, kind="plus") for d in perm] + [Segment(token_ids=question)]
        return self.run(layout, f"cold-{tag}" if name == "cold" else "warm")


def measure(bench: Bench, n: int, doc_len: int, runs: int, tag: str, discard: int = 0,
            quiet: bool = False) -> tuple[dict[str, list[float]], dict[str, dict[str, int]]]:
    """TTFTs of `runs` interleaved runs of every variant over the same N documents, after
    `discard` untimed ones."""
    docs = [bench.tokens(doc_len) for _ in range(n)]
    # The warm documents are pinned (encoded now, never evicted until unpinned), so the stock and
    # cold runs in between, which fill the pool, cannot push them out whatever the run order.
    keys = [f"doc-{tag}-{i}" for i in range(n)]
    bench.llm.pin([Segment(token_ids=d, kind="plus", key=k) for d, k in zip(docs, keys)], namespace="warm")
    ttft: dict[str, list[float]] = {v: [] for v in VARIANTS}
    reuse: dict[str, dict[str, int]] = {}
    for r in range(-discard, runs):
        # A new question each run (shared by the three variants): with one or two documents a
        # "new order" can repeat an old one, and a repeated question would then hit the cache.
        question = bench.tokens(bench.question_len)
        for v in rotated(VARIANTS, r):
            m = bench.variant(v, docs, question, f"{tag}-{r}")
            check(v, m, n * doc_len)
            if r >= 0:
                ttft[v].append(m["ttft"])
                reuse[v] = m["reuse"]
        if not quiet and r >= 0:
            print(f"N={n:>2} run {r}: " + "  ".join(f"{v} {ttft[v][-1] * 1e3:9.1f} ms" for v in VARIANTS), flush=True)
    bench.llm.unpin(keys, namespace="warm")
    return ttft, reuse


def check(name: str, m: dict[str, Any], doc_tokens: int) -> None:
    """The reuse each variant is meant to have; anything else would time the wrong thing."""
    cached = m["cached_tokens"]
    ok = cached == doc_tokens if name == "warm" else cached == 0
    if not ok:
        raise RuntimeError(f"{name}: {cached} cached tokens (reuse {m['reuse']}), expected "
                           f"{doc_tokens if name == 'warm' else 0}")


def plot(ns: list[int], med: dict[str, list[float]], title: str, name: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for v, style in zip(VARIANTS, ("o-", "s-", "^-")):
        ax.plot(ns, [1e3 * t for t in med[v]], style, label={"stock": "stock (plain prompt)",
                                                            "cold": "span cold", "warm": "span warm"}[v])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("documents N")
    ax.set_ylabel("TTFT (ms, median)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    path = save_figure(fig, name)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (workers inherit it)
    if args.gpu:
        device, dtype = "cuda", torch.bfloat16
        # Under TP every rank creates its own shard on its GPU (the same function as TP=1's model).
        weights = (RandomWeights(llama3_8b_config(), args.seed) if args.tp > 1
                   else random_model(llama3_8b_config(), device, dtype, args.seed))
        llm = build_llm(weights, args, device, dtype)
        model_name = "random Llama-3-8B bf16 CUDA" + (f", tensor parallel {args.tp}" if args.tp > 1 else "")
    else:
        set_threads(args.threads)
        device, dtype = "cpu", torch.float32
        llm = build_llm(load_model("smollm2", dtype, device), args, device, dtype)
        model_name = f"SmolLM2-135M f32 CPU, {torch.get_num_threads()} thread(s)"
    backend = type(llm.engine.executor.backend).__name__
    print(f"{model_name}, attention backend {backend}", flush=True)
    bench = Bench(llm, args.question_len, args.seed)

    # Warm-up (untimed): one round at the smallest N, so first-call costs (allocator growth,
    # kernel compilation) stay out of the timings.
    measure(bench, min(args.ns), args.doc_len, 1, "warmup", quiet=True)
    ttft: dict[str, dict[int, list[float]]] = {v: {} for v in VARIANTS}
    reuse: dict[str, dict[int, dict[str, int]]] = {v: {} for v in VARIANTS}
    for n in args.ns:
        ttft_n, reuse_n = measure(bench, n, args.doc_len, args.runs, str(n), args.discard)
        for v in VARIANTS:
            ttft[v][n], reuse[v][n] = ttft_n[v], reuse_n[v]

    med = {v: [median(ttft[v][n]) for n in args.ns] for v in VARIANTS}
    rows = []
    for i, n in enumerate(args.ns):
        s, c, w = med["stock"][i], med["cold"][i], med["warm"][i]
        rows.append([n, n * args.doc_len + args.question_len, f"{s * 1e3:.1f}", f"{c * 1e3:.1f}", f"{w * 1e3:.1f}",
                     f"{s / c:.2f}x", f"{s / w:.1f}x"])
    print(f"\nTTFT medians of {args.runs} runs, {model_name}, L={args.doc_len}, question {args.question_len} tokens")
    print(format_table(["N", "prompt tokens", "stock ms", "cold ms", "warm ms", "stock/cold", "stock/warm"], rows))
    if 8 in args.ns:
        i = args.ns.index(8)
        print(f"\nN=8: warm is {med['stock'][i] / med['warm'][i]:.1f}x faster than stock, "
              f"cold {med['stock'][i] / med['cold'][i]:.2f}x")

    png = plot(args.ns, med, f"RAG TTFT, {model_name}, L={args.doc_len}", Path(args.out).stem + ".png")
    path = write_json(args.out, {
        "benchmark": "rag_ttft", "args": vars(args), "model": model_name, "backend": backend, "ns": args.ns,
        "ttft_s": {v: {str(n): ttft[v][n] for n in args.ns} for v in VARIANTS},
        "median_ttft_s": med, "last_run_reuse": {v: {str(n): reuse[v][n] for n in args.ns} for v in VARIANTS},
        "engine_counters": dict(llm.engine.counters), "plot": "docs/" + Path(png).name,  # no machine paths
    })
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main(sys.argv[1:])
