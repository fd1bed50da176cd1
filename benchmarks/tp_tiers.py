"""KV tiers under tensor parallelism: TP=2 against TP=1 in one run (random bf16 weights, Triton).

For each engine, a RAG layout of --docs documents of --doc-len tokens: TTFT recomputed, with the
documents resident in the pool, and loaded back from the host tier (whole blocks, scattered to
the ranks' heads); the capture bandwidth (whole blocks gathered from the ranks into pinned host
memory) and the load bandwidth (tier to pool); greedy tokens after a host-tier load against the
same engine with the documents resident. TP=2 runs first and leaves its captured blocks in a disk
tier that TP=1 then reads (one store, either TP size).

    NCCL_NVLS_ENABLE=0 python benchmarks/tp_tiers.py    # two GPUs, random Llama-3-8B
    python benchmarks/tp_tiers.py --dry                 # CPU, gloo, tiny shape: checks the script
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (inherited by workers)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, llama3_8b_config, median, random_tokens, write_json  # noqa: E402

from spanserve.cache.tiers.payload import BlockKV  # noqa: E402
from spanserve.distributed import RandomWeights  # noqa: E402
from spanserve.engine.config import EngineConfig  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.engine.layout import Segment  # noqa: E402
from spanserve.engine.sampling import SamplingParams  # noqa: E402

BS = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU, gloo, tiny random model, small sizes")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.dry:
        args.docs, args.doc_len, args.question_len, args.greedy_tokens, args.runs = 3, 40, 8, 6, 2
    return args


class Bench:
    def __init__(self, args: argparse.Namespace, tp: int, disk: str):
        self.args = args
        self.cuda = not args.dry
        cfg = llama3_8b_config()
        if args.dry:
            cfg = dataclasses.replace(cfg, vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=2,
                                      num_heads=4, num_kv_heads=2, head_dim=32, name="tiny")
        self.doc_blocks = args.docs * -(-args.doc_len // BS)
        request = self.doc_blocks + -(-(args.question_len + args.greedy_tokens + 16) // BS) + 4
        kv_bytes = 2 * cfg.num_layers * BS * cfg.num_kv_heads * cfg.head_dim * (4 if args.dry else 2)
        extra: dict[str, Any] = {}
        if self.cuda:
            from spanserve.attention.triton import TritonBackend

            extra["backend"] = TritonBackend()
        t0 = time.perf_counter()
        self.eng = LLMEngine(EngineConfig.from_kwargs(
            model=RandomWeights(cfg, seed=args.seed), device="cuda" if self.cuda else "cpu",
            dtype="float32" if args.dry else "bfloat16", block_size=BS, num_blocks=2 * request + 16,
            max_num_batched_tokens=args.docs * args.doc_len + args.question_len + 32, max_num_seqs=2,
            tensor_parallel_size=tp, kv_offload={
                "cpu_bytes": (self.doc_blocks + 64) * kv_bytes, "disk_path": disk,
                "disk_bytes": 2 * (self.doc_blocks + 64) * kv_bytes}, **extra))
        print(f"TP={tp}: engine up in {time.perf_counter() - t0:.1f} s", flush=True)
        gen = torch.Generator().manual_seed(0)
        v = cfg.vocab_size
        self.prefix = random_tokens(gen, 16, v)
        self.docs = [random_tokens(gen, args.doc_len, v) for _ in range(args.docs)]
        self.question = random_tokens(gen, args.question_len, v)
        self.fill_s: list[float] = []
        stack = self.eng.tiers
        fill = stack.fill

        def timed_fill(*a: Any, **k: Any) -> Any:  # the load itself: tier reads, copies into every rank
            self.sync()
            t0 = time.perf_counter()
            out = fill(*a, **k)
            self.sync()
            self.fill_s.append(time.perf_counter() - t0)
            return out
        stack.fill = timed_fill  # type: ignore[method-assign]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def layout(self) -> list[Segment]:
        return ([Segment(token_ids=self.prefix)] + [Segment(token_ids=d, kind="plus") for d in self.docs]
                + [Segment(token_ids=self.question)])

    def request(self, tokens: int, namespace: str = "") -> tuple[float, dict[str, int], list[int]]:
        """TTFT, reuse counts and greedy tokens of the layout."""
        self.sync()
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        req = self.eng.add_request(self.layout(), params, namespace=namespace)
        while self.eng.has_unfinished():
            self.eng.step()
        return req.first_token_time - req.arrival_time, dict(req.reuse), list(req.output_token_ids)

    def clear_pool(self) -> None:
        """Forget every cached block (an explicit eviction writes nothing below)."""
        for b in self.eng.pool.blocks:
            if b.key is not None and b.ref_cnt == 0:
                self.eng.pool.evict(b)

    def capture(self) -> tuple[list[BlockKV], float]:
        """Every cached block, whole, into pinned host memory, and the seconds it took."""
        e = self.eng
        cached = [b for b in e.pool.blocks if b.key is not None]
        out = torch.empty((len(cached), *e.tiers.shape.dims), dtype=e.dtype, pin_memory=self.cuda)
        self.sync()
        t0 = time.perf_counter()
        e.storage.read_blocks([b.id for b in cached], out)
        self.sync()
        return [BlockKV(b.key, b.tokens, out[i], b.parent) for i, b in enumerate(cached)], time.perf_counter() - t0


def measure(args: argparse.Namespace, tp: int, disk: str) -> dict[str, Any]:
    bench = Bench(args, tp, disk)
    stack = bench.eng.tiers
    res: dict[str, Any] = {}
    if tp == 1:  # TP=2's blocks, read from its disk tier
        bench.clear_pool()
        _, reuse, toks = bench.request(args.greedy_tokens)
        res["from_tp2_disk"] = {"reuse": reuse, "tokens": toks}
    ttfts = []
    for r in range(args.runs + 1):  # the first run warms up and is dropped
        bench.clear_pool()
        t, _, _ = bench.request(1, namespace=f"cold-{r}")
        ttfts.append(t)
    res["recompute_s"] = median(ttfts[1:])
    bench.clear_pool()
    _, _, resident_tokens = bench.request(args.greedy_tokens)
    res["pool_s"] = median([bench.request(1)[0] for _ in range(args.runs)])
    blocks, secs = bench.capture()
    res["capture_GBps"] = len(blocks) * stack.shape.kv_bytes / secs / 1e9
    if tp == 2:
        stack.disk.store_many(blocks)  # for TP=1 to read
    ttfts, fills = [], []
    for _ in range(args.runs):
        assert stack.flush(600)
        stack.host.store_many(blocks)
        bench.clear_pool()
        bench.fill_s.clear()
        t, reuse, _ = bench.request(1)
        ttfts.append(t)
        fills.append(bench.fill_s[0] if bench.fill_s else float("nan"))
    res["host_s"], res["host_reuse"] = median(ttfts), reuse
    res["load_GBps"] = len(blocks) * stack.shape.kv_bytes / median(fills) / 1e9
    stack.host.store_many(blocks)
    bench.clear_pool()
    _, reuse, host_tokens = bench.request(args.greedy_tokens)
    res["tokens_host"], res["tokens_resident"] = host_tokens, resident_tokens
    res["blocks"], res["kv_GiB"] = len(blocks), len(blocks) * stack.shape.kv_bytes / 2**30
    bench.clear_pool()
    stack.host.drain()  # nothing more for the disk at shutdown
    bench.eng.shutdown()
    del bench
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def report(args: argparse.Namespace, res: dict[int, dict[str, Any]]) -> list[list[str]]:
    rows = []
    for tp in (1, 2):
        r = res[tp]
        ms = [f"{r[k] * 1e3:.1f}" for k in ("recompute_s", "pool_s", "host_s")]
        rows.append([f"TP={tp}", *ms, f"{r['recompute_s'] / r['host_s']:.1f}x", f"{r['load_GBps']:.3g}",
                     f"{r['capture_GBps']:.3g}", str(r["tokens_host"] == r["tokens_resident"])])
    print(format_table(["engine", "recompute TTFT ms", "pool TTFT ms", "host-tier TTFT ms", "recompute / host",
                        "load GB/s", "capture GB/s", "tokens equal (host vs pool)"], rows))
    d = res[1]["from_tp2_disk"]
    cached = sum(d["reuse"].get(k, 0) for k in ("prefix", "perforated", "segment"))
    print(f"TP=1 reading TP=2's disk tier: {d['reuse'].get('disk', 0)} of {cached} cached tokens from disk; "
          f"greedy tokens equal to TP=2's: {d['tokens'] == res[2]['tokens_resident']}, "
          f"to TP=1's own: {d['tokens'] == res[1]['tokens_resident']}")
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.dry and torch.cuda.device_count() < 2:
        sys.exit("needs two GPUs (or --dry)")
    print(f"{args.docs} documents x {args.doc_len} tokens", flush=True)
    with tempfile.TemporaryDirectory() as disk:
        res = {2: measure(args, 2, disk)}
        res[1] = measure(args, 1, disk)
    rows = report(args, res)
    path = write_json("tp_tiers_dry.json" if args.dry else "tp_tiers.json", {
        "benchmark": "tp_tiers", "args": vars(args), "results": {f"tp{k}": v for k, v in res.items()}, "table": rows,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
