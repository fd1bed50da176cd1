"""Token hit ratio and load balance of a Zipf RAG trace served by N replicas under three routers.
Pure cache simulation, no model: each replica is the engine's own CacheManager over its own
BlockPool, fed the same span layouts the server would build.

    .venv/bin/python benchmarks/routing_sim.py           # 2000 requests, 200 docs x 512 tokens, 1-64 replicas
    .venv/bin/python benchmarks/routing_sim.py --quick   # 300 requests, 50 docs, 1-8 replicas

Each request is k distinct documents drawn with Zipf(alpha) popularity (zipf_hits.py's trace),
as plus segments in the order drawn, then a question of its own (cross). Routers:

  round_robin    replica i mod N
  prefix_hash    rendezvous hash of the prompt's first blocks read as one plain prompt (what a
                 prefix-affinity router sees), bounded load
  segment_aware  spanserve.cluster.routing: the replica holding most of the request's plus-segment
                 tokens (where their keys were sent lately, else their rendezvous owners), less
                 the expected recomputation of the keys its misses would push out, bounded load

Load: a request stays in flight for the next N x --concurrency arrivals; a replica at
ceil(1.5 x mean in-flight) is passed over (bounded-load hashing; --slack 0.25 for 1.25x). Each request is admitted
(lookup, allocate, hits held), its blocks marked computed and released at once, so the pool
holds one request's blocks at a time and LRU-caches the rest. Hit ratio = document tokens
found cached / document tokens requested, cold start included; imbalance = the busiest
replica's requests / the mean.
"""
from __future__ import annotations

import argparse
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common import ROOT, format_table, save_figure, write_json
from spanserve.cache.block_pool import BlockPool
from spanserve.cache.claim import Admission, Piece
from spanserve.cache.manager import CacheManager
from spanserve.cluster import routing
from common.traces import zipf_trace

ROUTERS = ("round_robin", "prefix_hash", "segment_aware")


class NoKV:
    """Storage for a replay: there is no KV to copy."""

    def copy_many(self, jobs: list[tuple[int, int, int]]) -> None:
        pass

    def copy(self, src: int, dst: int, n: int) -> None:
        pass


@dataclass
class Replica:
    manager: CacheManager
    requests: int = 0
    hit_tokens: int = 0
    doc_tokens: int = 0
    computed: int = 0

    def serve(self, adm: Admission, doc_tokens: int) -> None:
        held = self.manager.admit(adm)
        if held is None:
            raise RuntimeError("a request does not fit an empty pool: raise --budget")
        for t in held.tasks:  # as if the forward ran: every task's positions now have KV
            t.todo = []
        self.manager.release(held)
        self.requests += 1
        self.hit_tokens += held.reuse["segment"] + held.reuse["prefix"] + held.reuse["perforated"]
        self.doc_tokens += doc_tokens
        self.computed += held.reuse["computed"]


@dataclass
class Workload:
    layouts: list[list[Piece]]
    doc_tokens: list[int]
    keys: list[list[routing.RouteKey]] = field(default_factory=list)  # segment-aware
    prefix: list[list[routing.RouteKey]] = field(default_factory=list)  # prefix-hash


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--docs", type=int, default=200, help="corpus size")
    ap.add_argument("--doc-len", type=int, default=512, help="tokens per document")
    ap.add_argument("--question-len", type=int, default=24)
    ap.add_argument("--k", type=int, default=4, help="documents per request")
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--budget", type=float, default=0.10, help="KV pool per replica, fraction of the corpus")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight per replica on average")
    ap.add_argument("--slack", type=float, default=0.5, help="load bound: (1 + slack) x mean in flight")
    ap.add_argument("--horizon", type=float, default=routing.HORIZON,
                    help="segment-aware: requests ahead over which a key pushed out is charged (0: off)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 300 requests, 50 documents, 1-8 replicas")
    ap.add_argument("--out", default="routing_sim.json", help="file name under benchmarks/results/")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.docs, args.replicas = 300, 50, [1, 2, 4, 8]
        if args.out == "routing_sim.json":
            args.out = "routing_sim_quick.json"
    if args.k > args.docs:
        ap.error("--k must be at most --docs")
    return args


def workload(args: argparse.Namespace, rng: np.random.Generator) -> Workload:
    corpus = [tuple(rng.integers(100, 50000, size=args.doc_len).tolist()) for _ in range(args.docs)]
    trace = zipf_trace(args.requests, args.docs, args.k, args.k, args.alpha, rng)
    bs = args.block_size
    w = Workload([], [])
    for req in trace:
        pieces, pos = [], 0
        for doc, _ in req:
            pieces.append(Piece("plus", corpus[doc], pos))
            pos += args.doc_len
        question = tuple(rng.integers(100, 50000, size=args.question_len).tolist())
        pieces.append(Piece("cross", question, pos))
        w.layouts.append(pieces)
        w.doc_tokens.append(pos)
        w.keys.append(routing.layout_keys(pieces, "", bs))
        flat = [t for p in pieces for t in p.tokens]
        w.prefix.append([routing.prefix_key(flat, "", bs)])
    return w


def simulate(w: Workload, router: str, n: int, pool_blocks: int, args: argparse.Namespace) -> dict:
    names = [f"replica-{i}" for i in range(n)]
    replicas = {r: Replica(CacheManager(BlockPool(pool_blocks), NoKV(), args.block_size)) for r in names}  # type: ignore[arg-type]
    loads = dict.fromkeys(names, 0)
    in_flight: deque[str] = deque()
    window = n * args.concurrency
    seg = routing.SegmentRouter(pool_blocks * args.block_size, slack=args.slack, horizon=args.horizon)
    for i, pieces in enumerate(w.layouts):
        if len(in_flight) >= window:
            loads[in_flight.popleft()] -= 1
        if router == "round_robin":
            r = names[i % n]
        elif router == "prefix_hash":
            order = routing.ranked(w.prefix[i], names)
            r = routing.choose(order, loads, routing.load_bound(loads, args.slack))
        else:
            r = seg.route(w.keys[i], loads)
        loads[r] += 1
        in_flight.append(r)
        prompt = [t for p in pieces for t in p.tokens]
        replicas[r].serve(Admission(list(pieces), prompt), w.doc_tokens[i])
    counts = [x.requests for x in replicas.values()]
    work = [x.computed for x in replicas.values()]
    return {"router": router, "replicas": n,
            "hit_ratio": sum(x.hit_tokens for x in replicas.values()) / sum(w.doc_tokens),
            "imbalance": max(counts) / (sum(counts) / n),
            "work_imbalance": max(work) / max(1e-9, sum(work) / n),
            "requests_per_replica": counts}


def plot(results: list[dict], title: str, name: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for router, style in zip(ROUTERS, ("o-", "s--", "^-")):
        rows = [r for r in results if r["router"] == router]
        xs = [r["replicas"] for r in rows]
        a.plot(xs, [r["hit_ratio"] for r in rows], style, label=router)
        b.plot(xs, [r["imbalance"] for r in rows], style, label=router)
    for ax, label in ((a, "hit ratio (document tokens)"), (b, "busiest replica / mean (requests)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    a.set_ylim(0, 1.05)
    fig.suptitle(title, fontsize=9)
    path = save_figure(fig, name)
    plt.close(fig)
    return str(path.relative_to(ROOT))  # no machine paths in results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    w = workload(args, rng)
    doc_blocks = -(-args.doc_len // args.block_size)
    corpus_blocks = args.docs * doc_blocks
    need = args.k * doc_blocks + -(-args.question_len // args.block_size) + 1  # one request must fit
    pool_blocks = max(need, round(args.budget * corpus_blocks))
    results = []
    for n in args.replicas:
        for router in ROUTERS:
            row = simulate(w, router, n, pool_blocks, args)
            results.append(row)
            print(f"{n:>3} replicas {router:>13}: hit {row['hit_ratio']:.3f}, busiest/mean {row['imbalance']:.2f}",
                  flush=True)
    by = {(r["router"], r["replicas"]): r for r in results}
    table = []
    for n in args.replicas:
        rr, ph, sa = (by[(x, n)] for x in ROUTERS)
        table.append([n, f"{rr['hit_ratio']:.3f}", f"{ph['hit_ratio']:.3f}", f"{sa['hit_ratio']:.3f}",
                      f"{sa['hit_ratio'] / rr['hit_ratio']:.2f}x", f"{sa['hit_ratio'] / ph['hit_ratio']:.2f}x",
                      f"{ph['imbalance']:.2f}", f"{sa['imbalance']:.2f}"])
    print(f"\n{args.requests} requests x {args.k} docs from {args.docs} docs of {args.doc_len} tokens, "
          f"Zipf alpha {args.alpha}, pool per replica {args.budget:.0%} of the corpus ({pool_blocks} blocks of "
          f"{args.block_size})")
    print(format_table(["replicas", "round robin hit", "prefix-hash hit", "segment-aware hit", "vs round robin",
                        "vs prefix-hash", "prefix-hash busiest/mean", "segment-aware busiest/mean"], table))
    title = (f"{args.requests} requests, k={args.k} of {args.docs} docs x {args.doc_len} tok, alpha {args.alpha}, "
             f"pool {args.budget:.0%} of corpus per replica")
    png = plot(results, title, Path(args.out).stem + ".png")
    path = write_json(args.out, {"benchmark": "routing_sim", "args": vars(args), "corpus_blocks": corpus_blocks,
                                 "pool_blocks": pool_blocks, "results": results, "plot": png})
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main(sys.argv[1:])
