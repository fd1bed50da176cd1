"""KV hit ratio of a Zipf RAG trace under a fixed KV budget: deferred rotation versus eager
repositioning (LazyAttention's capacity argument). Pure cache simulation, no model.

    .venv/bin/python benchmarks/zipf_hits.py           # 2000 requests, 200 docs x 512 tokens
    .venv/bin/python benchmarks/zipf_hits.py --quick   # 300 requests, 50 docs

Each request retrieves k distinct documents, drawn with Zipf(alpha) popularity from the corpus,
and places them at k distinct slots out of --slots chosen at random. The trace is replayed
against the engine's BlockPool (LRU over released blocks) holding a budget of blocks:

  deferred  one position-free copy per document: block keys chain from hashing.seed(ns) over the
            document's tokens, so a document hits wherever it is placed (RoPE applied on read)
  eager     one copy per (document, slot): the slot goes into the chain seed, so a document
            cached at another slot is a miss

Per request: look up every block of every document (a hit is a block found; hits are held
first so the request's own allocations cannot evict them), allocate and register the misses,
hold everything for the request, release at the end (blocks stay cached, evictable LRU).
Hit ratio = hit tokens / requested document tokens over the whole trace (cold start included).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from dataclasses import dataclass

import numpy as np

from common import ROOT, format_table, save_figure, write_json
from common.traces import zipf_trace
from spanserve.cache import hashing
from spanserve.cache.block_pool import Block, BlockPool

MODES = ("deferred", "eager")


@dataclass
class DocBlocks:
    keys: list[int]
    tokens: list[tuple[int, ...]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--docs", type=int, default=200, help="corpus size")
    ap.add_argument("--doc-len", type=int, default=512, help="tokens per document")
    ap.add_argument("--k", type=int, default=4, help="documents per request")
    ap.add_argument("--slots", type=int, default=20, help="positions a document can take in a prompt")
    ap.add_argument("--alphas", type=float, nargs="+", default=[1.1, 2.1])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.05, 0.10, 0.25, 0.50],
                    help="KV budget as a fraction of the corpus size in blocks")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 300 requests over 50 documents")
    ap.add_argument("--out", default="zipf_hits.json", help="file name under benchmarks/results/")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.docs = 300, 50
        if args.out == "zipf_hits.json":
            args.out = "zipf_hits_quick.json"
    if args.k > min(args.docs, args.slots):
        ap.error("--k must be at most --docs and --slots")
    return args


class Simulator:
    def __init__(self, corpus: list[list[int]], block_size: int, mode: str):
        self.mode = mode
        self.block_size = block_size
        self.corpus = corpus
        self._cache: dict[tuple[int, int], DocBlocks] = {}  # (doc, slot or -1) -> its blocks

    def blocks(self, doc: int, slot: int) -> DocBlocks:
        """Block keys of `doc` placed at `slot`: the slot is part of the key only when eager."""
        pos = slot if self.mode == "eager" else -1
        got = self._cache.get((doc, pos))
        if got is None:
            toks = self.corpus[doc]
            seed = hashing.seed("zipf", "slot", pos) if self.mode == "eager" else hashing.seed("zipf")
            bs = self.block_size
            got = DocBlocks(hashing.chain_keys(seed, toks, bs, include_partial=True),
                            [tuple(toks[i:i + bs]) for i in range(0, len(toks), bs)])
            self._cache[(doc, pos)] = got
        return got

    def replay(self, trace: list[list[tuple[int, int]]], num_blocks: int) -> tuple[int, int]:
        """(hit tokens, requested tokens) of the whole trace on a pool of num_blocks."""
        pool = BlockPool(num_blocks)
        hit_tokens = total_tokens = 0
        for request in trace:
            held: list[Block] = []
            misses: list[tuple[int, tuple[int, ...]]] = []
            for doc, slot in request:  # look everything up first and hold the hits
                db = self.blocks(doc, slot)
                for key, toks in zip(db.keys, db.tokens):
                    total_tokens += len(toks)
                    b = pool.lookup(key, toks)
                    if b is None:
                        misses.append((key, toks))
                    else:
                        pool.acquire(b)
                        held.append(b)
                        hit_tokens += len(toks)
            for key, toks in misses:  # then compute (allocate + publish) what missed
                b = pool.allocate()
                pool.register(b, key, toks)
                held.append(b)
            for b in held:
                pool.release(b)
        return hit_tokens, total_tokens


def plot(results: list[dict], alphas: list[float], title: str, name: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(alphas), figsize=(4.5 * len(alphas), 3.5), squeeze=False)
    for ax, alpha in zip(axes[0], alphas):
        rows = [r for r in results if r["alpha"] == alpha]
        for mode, style in zip(MODES, ("o-", "s--")):
            ax.plot([100 * r["budget"] for r in rows], [r[mode] for r in rows], style, label=mode)
        for r in rows:
            ax.annotate(f"{r['ratio']:.2f}x", (100 * r["budget"], r["deferred"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=8)
        ax.set_title(f"Zipf alpha = {alpha}")
        ax.set_xlabel("KV budget (% of corpus)")
        ax.set_ylabel("hit ratio (tokens)")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    path = save_figure(fig, name)
    plt.close(fig)
    return str(path.relative_to(ROOT))  # no machine paths in results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    corpus = [rng.integers(100, 50000, size=args.doc_len).tolist() for _ in range(args.docs)]
    doc_blocks = -(-args.doc_len // args.block_size)
    corpus_blocks = args.docs * doc_blocks
    min_blocks = args.k * doc_blocks  # one request must fit
    sims = {m: Simulator(corpus, args.block_size, m) for m in MODES}

    results: list[dict] = []
    for alpha in args.alphas:
        trace = zipf_trace(args.requests, args.docs, args.k, args.slots, alpha, rng)
        distinct_docs = len({d for req in trace for d, _ in req})
        distinct_pairs = len({p for req in trace for p in req})
        for budget in args.budgets:
            blocks = max(min_blocks, round(budget * corpus_blocks))
            row: dict = {"alpha": alpha, "budget": budget, "blocks": blocks,
                         "distinct_docs": distinct_docs, "distinct_doc_slot_pairs": distinct_pairs}
            for mode in MODES:
                hit, total = sims[mode].replay(trace, blocks)
                row[mode] = hit / total
            row["ratio"] = row["deferred"] / row["eager"] if row["eager"] else float("inf")
            results.append(row)
            print(f"alpha {alpha} budget {budget:.0%}: deferred {row['deferred']:.3f} eager {row['eager']:.3f}",
                  flush=True)

    print(f"\n{args.requests} requests x {args.k} docs from {args.docs} docs of {args.doc_len} tokens "
          f"({corpus_blocks} blocks of {args.block_size}), {args.slots} slots")
    print(format_table(
        ["alpha", "budget", "blocks", "docs seen", "(doc,slot) seen", "deferred hit", "eager hit", "deferred/eager"],
        [[r["alpha"], f"{r['budget']:.0%}", r["blocks"], r["distinct_docs"], r["distinct_doc_slot_pairs"],
          f"{r['deferred']:.3f}", f"{r['eager']:.3f}", f"{r['ratio']:.2f}x"] for r in results]))
    smallest = min(args.budgets)
    for alpha in args.alphas:
        r = next(x for x in results if x["alpha"] == alpha and x["budget"] == smallest)
        print(f"alpha {alpha}, smallest budget {smallest:.0%}: deferred/eager = {r['ratio']:.2f}x")

    title = (f"{args.requests} requests, k={args.k} of {args.docs} docs x {args.doc_len} tok, "
             f"{args.slots} slots, BlockPool LRU")
    png = plot(results, args.alphas, title, Path(args.out).stem + ".png")
    path = write_json(args.out, {"benchmark": "zipf_hits", "args": vars(args), "corpus_blocks": corpus_blocks,
                                 "results": results, "plot": png})
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main(sys.argv[1:])
