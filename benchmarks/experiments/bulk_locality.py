"""Bulk execution order vs. KV-cache hit ratio: 64 RAG queries over a 32-document corpus.

    .venv/bin/python benchmarks/experiments/bulk_locality.py --quick     # pool = 25% of the corpus, 2 seeds
    .venv/bin/python benchmarks/experiments/bulk_locality.py             # pool fractions 1/8..1, 5 seeds

Corpus: ``topics`` x ``docs_per_topic`` random documents (8 x 4 = 32). Each query reads
``per_query`` (3) documents of one topic as a plus, in random order, after a shared system prompt
and before its own question; every topic gets the same number of queries, and the submission
order is shuffled. Each run uses a fresh LLM on a tiny random model (tests/tiny_models.py) whose
KV pool holds ``pool_fraction`` of the corpus blocks plus room for one query, and runs the
queries with ``Executor.execute_many(queries, order=...)`` for ``order`` in {"locality",
"submission"}.

Hit ratio = sum over queries of segment-hit tokens (the judge output's metrics["reuse"]["segment"])
/ sum over queries of plus-document tokens (the plus segments of the query's layout).

With 8 queries of 3 reads per topic, reading each document once is unavoidable: the best possible
ratio is about 1 - 32/192 = 0.83 (weighted by document length). The pool fraction counts document
blocks only; each query's own blocks (its question and output, unique to it) are cached too and
compete for the pool, so even at fraction 1 submission order loses documents to eviction.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from spanserve import LLM  # noqa: E402
from spanserve.engine.layout import resolve  # noqa: E402
from spanserve.query import cross, g, plus, system, user  # noqa: E402
from spanserve.query.execute import EngineRunner, Executor  # noqa: E402
from spanserve.query.ir import Node  # noqa: E402
from spanserve.query.plan import Planner  # noqa: E402

WORDS = ("hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran")
SYSTEM = "answer the question from the documents ."


@dataclass(frozen=True)
class Workload:
    docs: tuple[str, ...]  # doc i belongs to topic i // docs_per_topic
    queries: tuple[Node, ...]  # in submission order
    doc_ids: tuple[tuple[int, ...], ...]  # the documents each query reads
    max_tokens: int


def make_workload(seed: int = 0, topics: int = 8, docs_per_topic: int = 4, n_queries: int = 64,
                  per_query: int = 3, doc_words: int = 40, max_tokens: int = 2) -> Workload:
    """Deterministic for a given seed: every random choice comes from one random.Random(seed)."""
    if n_queries % topics:
        raise ValueError("n_queries must be a multiple of topics (same number of queries per topic)")
    if per_query > docs_per_topic:
        raise ValueError("per_query cannot exceed docs_per_topic")
    rng = random.Random(seed)
    docs: list[str] = []
    while len(docs) < topics * docs_per_topic:
        # A numbered head keeps documents distinct even if the random words ever coincide.
        text = f"doc {len(docs)} : " + " ".join(rng.choice(WORDS) for _ in range(doc_words))
        docs.append(text)
    picks: list[tuple[int, ...]] = []
    for t in range(topics):
        pool = range(t * docs_per_topic, (t + 1) * docs_per_topic)
        for _ in range(n_queries // topics):
            picks.append(tuple(rng.sample(pool, per_query)))  # random subset, random plus order
    rng.shuffle(picks)
    queries = tuple(
        g(cross(system(SYSTEM), plus(*(user(docs[i]) for i in ids)), user(f"question {q} : what sat on the mat ?")),
          max_tokens=max_tokens, temperature=0.0)
        for q, ids in enumerate(picks)
    )
    return Workload(tuple(docs), queries, tuple(picks), max_tokens)


def _blocks(n_tokens: int, block_size: int) -> int:
    return -(-n_tokens // block_size)


def pool_size(tokenizer: Any, encode: Any, wl: Workload, block_size: int, fraction: float) -> dict[str, int]:
    """Blocks for ``fraction`` of the corpus (each document as a standalone plus unit) plus the
    blocks the largest query needs while it runs (its units, with room for its output)."""
    planner = Planner(tokenizer)
    corpus = sum(_blocks(len(encode(planner.turn(user(d)))), block_size) for d in wl.docs)
    one_query = 0
    for q in wl.queries:
        pieces = resolve(planner.layout(q.input), encode, "none")
        need = sum(_blocks(len(p.tokens) + (wl.max_tokens if i == len(pieces) - 1 else 0), block_size)
                   for i, p in enumerate(pieces))
        one_query = max(one_query, need)
    cached = math.ceil(fraction * corpus)
    return {"corpus_blocks": corpus, "query_blocks": one_query, "cache_blocks": cached,
            "num_blocks": cached + one_query + 1}


def plus_tokens(planner: Planner, query: Node) -> int:
    return sum(len(s.token_ids) for s in planner.layout(query.input) if s.kind == "plus")


def run_order(model_path: str, wl: Workload, order: str, fraction: float, block_size: int = 4) -> dict[str, Any]:
    """Execute the workload on a fresh LLM in ``order``; return the hit ratio and details."""
    llm = LLM(model_path, block_size=block_size, num_blocks=2)  # only its tokenizer, to size the pool
    sizes = pool_size(llm.tokenizer, llm.engine.encode, wl, block_size, fraction)
    llm = LLM(model_path, block_size=block_size, num_blocks=sizes["num_blocks"])
    ex = Executor(EngineRunner(llm.engine), llm.tokenizer, max_tokens=wl.max_tokens)
    t0 = time.monotonic()
    outcomes = ex.execute_many(list(wl.queries), order=order)
    wall = time.monotonic() - t0
    planner = Planner(llm.tokenizer)
    hits = [o.outputs[()].metrics["reuse"]["segment"] for o in outcomes]
    totals = [plus_tokens(planner, q) for q in wl.queries]
    # A request the pool cannot admit is failed with no output token; one that ran produced at least
    # one (it may stop early at EOS).
    if any(not o.outputs[()].token_ids for o in outcomes):
        raise RuntimeError("some queries were never admitted: the pool is too small for one query")
    return {"order": order, "pool_fraction": fraction, **sizes, "hit_tokens": sum(hits),
            "plus_tokens": sum(totals), "hit_ratio": sum(hits) / sum(totals), "wall_s": wall,
            "per_query_hits": hits}


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    fracs = sorted({r["pool_fraction"] for r in rows})
    for order, style in (("locality", "o-"), ("submission", "s--")):
        med = [statistics.median(r["hit_ratio"] for r in rows if r["order"] == order and r["pool_fraction"] == f)
               for f in fracs]
        lo = [min(r["hit_ratio"] for r in rows if r["order"] == order and r["pool_fraction"] == f) for f in fracs]
        hi = [max(r["hit_ratio"] for r in rows if r["order"] == order and r["pool_fraction"] == f) for f in fracs]
        ax.plot(fracs, med, style, label=f"{order} order")
        ax.fill_between(fracs, lo, hi, alpha=0.2)
    ax.set_xscale("log", base=2)
    ax.set_xticks(fracs, [f"{f:g}" for f in fracs])
    ax.set_ylim(0, 1)
    ax.set_xlabel("KV pool size (fraction of corpus blocks, + one query)")
    ax.set_ylabel("plus-document hit ratio")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF model dir; default: a tiny random llama (tests/tiny_models.py)")
    ap.add_argument("--fractions", default="0.125,0.25,0.5,1", help="pool sizes as fractions of the corpus")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="workload seeds")
    ap.add_argument("--topics", type=int, default=8)
    ap.add_argument("--docs-per-topic", type=int, default=4)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--per-query", type=int, default=3)
    ap.add_argument("--doc-words", type=int, default=40)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the tiny model needs one)")
    ap.add_argument("--quick", action="store_true", help="pool fraction 0.25 only, seeds 0 and 1")
    ap.add_argument("--json", default=None, help="default benchmarks/results/bulk_locality[_quick].json")
    ap.add_argument("--plot", default=None, help="default docs/bulk_locality[_quick].png")
    args = ap.parse_args()
    if args.quick:
        args.fractions, args.seeds = "0.25", "0,1"
    suffix = "_quick" if args.quick else ""
    json_path = Path(args.json or ROOT / "benchmarks" / "results" / f"bulk_locality{suffix}.json")
    png_path = Path(args.plot or ROOT / "docs" / f"bulk_locality{suffix}.png")
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from tiny_models import make_tiny_model
            model = str(make_tiny_model("llama", Path(tmp))[0])
        rows = []
        for seed in (int(s) for s in args.seeds.split(",")):
            wl = make_workload(seed, args.topics, args.docs_per_topic, args.queries, args.per_query, args.doc_words)
            for frac in (float(f) for f in args.fractions.split(",")):
                for order in ("locality", "submission"):  # side by side, same workload and pool
                    r = run_order(model, wl, order, frac, args.block_size)
                    rows.append({"seed": seed, **r})
    print(f"\nBulk execution: {args.queries} queries, {args.topics}x{args.docs_per_topic} docs, "
          f"{args.per_query} docs/query, block_size {args.block_size}, model {args.model or 'tiny llama'}")
    summary = report(rows)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"benchmark": "bulk_locality", "args": vars(args), "summary": summary,
                                     "runs": rows, "wall_s": time.monotonic() - t0}, indent=1))
    plot(rows, png_path, f"{args.queries} RAG queries over {args.topics * args.docs_per_topic} docs: "
                         "hit ratio by execution order")
    print(f"\nwrote {json_path} and {png_path}")


def report(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prints the medians per pool size and the per-seed ratios; returns the summary rows."""
    hdr = (f"{'pool frac':>9} {'pool blk':>8} {'corpus blk':>10} {'seeds':>5} {'locality hit':>12} "
           f"{'submission hit':>14} {'ratio':>6} {'loc>sub':>7}")
    print(hdr)
    print("-" * len(hdr))
    summary = []
    for frac in sorted({r["pool_fraction"] for r in rows}):
        loc = [r for r in rows if r["pool_fraction"] == frac and r["order"] == "locality"]
        sub = [r for r in rows if r["pool_fraction"] == frac and r["order"] == "submission"]
        lm = statistics.median(r["hit_ratio"] for r in loc)
        sm = statistics.median(r["hit_ratio"] for r in sub)
        wins = sum(a["hit_ratio"] > b["hit_ratio"] for a, b in zip(loc, sub))
        summary.append({"pool_fraction": frac, "locality_hit_median": lm, "submission_hit_median": sm,
                        "locality_wins": wins, "seeds": len(loc), "num_blocks": loc[0]["num_blocks"],
                        "corpus_blocks": loc[0]["corpus_blocks"]})
        ratio = f"{lm / sm:.2f}" if sm else "inf"
        print(f"{frac:>9g} {loc[0]['num_blocks']:>8} {loc[0]['corpus_blocks']:>10} {len(loc):>5} "
              f"{lm:>12.3f} {sm:>14.3f} {ratio:>6} {wins:>3}/{len(loc)}")
    print("\nper seed (pool fraction, seed: locality / submission hit ratio)")
    for a, b in zip(rows[::2], rows[1::2]):
        print(f"  {a['pool_fraction']:g}, seed {a['seed']}: {a['hit_ratio']:.3f} / {b['hit_ratio']:.3f}")
    return summary


if __name__ == "__main__":
    main()
