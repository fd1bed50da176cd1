"""The most document tokens any routing could hit on routing_sim.py's trace if each replica's pool
held a fixed set of documents (no load bound, no eviction by misses, no cold start): an upper
bound for routers over LRU pools, which every miss churns.

    .venv/bin/python benchmarks/experiments/routing_ceiling.py            # 8 replicas, routing_sim.py's trace
    .venv/bin/python benchmarks/experiments/routing_ceiling.py --steps 500 --replicas 2 4   # smoke run

Each request goes to the replica holding most of its documents. Sets tried: the `hot` most
popular documents on every replica and the next ones dealt out one per replica in rank order
(every `hot`), then the best of those improved by random swaps (a document in a pool for one
outside it, kept when the trace's hits do not drop), fitted to the very trace it is scored on.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, write_json  # noqa: E402
from common.traces import zipf_trace  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--doc-len", type=int, default=512)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--pool-docs", type=int, default=20, help="documents a replica's pool holds (10%% of 200)")
    ap.add_argument("--replicas", type=int, nargs="+", default=[8])
    ap.add_argument("--steps", type=int, default=5000, help="random swaps tried")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="routing_ceiling.json")
    return ap.parse_args(argv)


def trace_matrix(args: argparse.Namespace) -> np.ndarray:
    """routing_sim.py's trace (same seed, same draws: the corpus's tokens come first) as a
    requests x documents 0/1 matrix."""
    rng = np.random.default_rng(args.seed)
    for _ in range(args.docs):
        rng.integers(100, 50000, size=args.doc_len)
    trace = zipf_trace(args.requests, args.docs, args.k, args.k, args.alpha, rng)
    q = np.zeros((args.requests, args.docs), np.float32)
    for i, req in enumerate(trace):
        q[i, [d for d, _ in req]] = 1
    return q


def hit_ratio(q: np.ndarray, pools: np.ndarray) -> float:
    return float((q @ pools.T).max(axis=1).sum() / q.sum())


def tiered(n: int, docs: int, per: int, hot: int) -> np.ndarray:
    pools = np.zeros((n, docs), np.float32)
    pools[:, :hot] = 1
    for j, d in enumerate(range(hot, min(docs, hot + n * (per - hot)))):
        pools[j % n, d] = 1
    return pools


def improved(q: np.ndarray, pools: np.ndarray, steps: int, rng: np.random.Generator) -> np.ndarray:
    pools = pools.copy()
    best = hit_ratio(q, pools)
    for _ in range(steps):
        r = rng.integers(len(pools))
        a, b = rng.choice(np.flatnonzero(pools[r])), rng.choice(np.flatnonzero(pools[r] == 0))
        pools[r, a], pools[r, b] = 0, 1
        v = hit_ratio(q, pools)
        if v >= best:
            best = v
        else:
            pools[r, a], pools[r, b] = 1, 0
    return pools


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    q = trace_matrix(args)
    rows, table = [], []
    for n in args.replicas:
        by_hot = {h: hit_ratio(q, tiered(n, args.docs, args.pool_docs, h)) for h in range(args.pool_docs + 1)}
        hot = max(by_hot, key=lambda h: by_hot[h])
        best = improved(q, tiered(n, args.docs, args.pool_docs, hot), args.steps, np.random.default_rng(args.seed))
        ceiling = hit_ratio(q, best)
        rows.append({"replicas": n, "tiered": by_hot, "best_hot": hot, "swapped": ceiling,
                     "copies_by_rank": best.sum(axis=0).astype(int).tolist()})
        table.append([n, hot, f"{by_hot[hot]:.3f}", f"{ceiling:.3f}"])
    print(f"{args.requests} requests x {args.k} of {args.docs} docs, Zipf alpha {args.alpha}, "
          f"{args.pool_docs} documents per pool")
    print(format_table(["replicas", "hot on every pool", "tiered hit", "after swaps"], table))
    path = write_json(args.out, {"benchmark": "routing_ceiling", "args": vars(args), "results": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
