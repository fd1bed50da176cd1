"""TTFT of a RAG request whose documents' KV is served from each tier below the pool (host memory,
local disk, Redis on loopback) versus recomputing them (span-cold: the segments encoded now;
stock: the same tokens as one plain prompt, as an engine without span reuse or tiers computes
it) and versus finding them in the pool, and each tier's load bandwidth against that tier's
ceiling measured in the same run (pinned host-to-device copy on a GPU, memory copy on a CPU; raw
file reads; raw Redis MGET).

Every row's first request is a warm-up and is dropped: the first short step over a cached
context captures a CUDA graph for its padded shape, which costs several forwards. The copy-time
lower bound is the host tier's bytes over the measured pinned-copy bandwidth; it bounds any
host-tier speedup. The break-even bandwidth is the layout's KV bytes over the span-cold
recompute time: a tier that delivers less than that loses to recomputing the documents.

    python benchmarks/tiers.py                 # CPU, SmolLM2, 8 documents x 256 tokens (+ Redis if installed)
    python benchmarks/tiers.py --gpu           # CUDA, random Llama-3-8B bf16, 32 x 2857 tokens
    python benchmarks/tiers.py --dry           # CPU, tiny random model: the script runs end to end
"""
from __future__ import annotations

import argparse
import itertools
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import llama3_8b_config, median, random_model, random_tokens, write_json  # noqa: E402
from common.tiers_report import plot, report  # noqa: E402

from spanserve.attention.kv_cache import cache_dtype  # noqa: E402
from spanserve.cache.tiers.payload import BlockKV  # noqa: E402
from spanserve.engine.config import EngineConfig  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.engine.layout import Segment  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.model.config import ModelConfig  # noqa: E402
from spanserve.worker import kv_upload  # noqa: E402
from spanserve.worker.storage import bytes_per_block  # noqa: E402

BS = 16
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="CUDA, random Llama-3-8B-shaped weights, bf16")
    ap.add_argument("--dry", action="store_true", help="tiny random model on the CPU, small sizes")
    ap.add_argument("--n", type=int, default=None, help="documents (default 8 on CPU, 32 on GPU)")
    ap.add_argument("--doc-len", type=int, default=None, help="tokens per document (default 256 / 2857 on GPU)")
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3, help="timed requests per row (after one warm-up)")
    ap.add_argument("--tiers", default=None, help="comma list of host,disk,store (default: all that are available)")
    ap.add_argument("--disk-dir", default=None, help="directory for the disk tier (default: a temp dir)")
    ap.add_argument("--store-timeout-ms", type=float, default=1000.0,
                    help="the store tier's timeout here (servers default to 50 ms; a loaded machine misses that)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU; 0 = torch's default")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="the KV pool's (and tiers') dtype")
    args = ap.parse_args(argv)
    args.n = args.n or (32 if args.gpu else 4 if args.dry else 8)
    args.doc_len = args.doc_len or (2857 if args.gpu else 40 if args.dry else 256)
    if args.dry:
        args.question_len, args.runs = 8, 2
    wanted = args.tiers.split(",") if args.tiers else ["host", "disk", "store"]
    if "store" in wanted and shutil.which("redis-server") is None:
        print("note: redis-server is not installed here; the store tier is left out of this run")
        wanted.remove("store")
    args.tiers = wanted
    return args


def build_model(args: argparse.Namespace) -> tuple[Any, str, torch.dtype]:
    if args.gpu:
        return random_model(llama3_8b_config(), "cuda", torch.bfloat16), "cuda", torch.bfloat16
    if args.dry:
        c = ModelConfig(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                        max_position_embeddings=4096, tie_word_embeddings=True, name="tiny-random")
        return random_model(c, "cpu", torch.float32), "cpu", torch.float32
    from spanserve.model.loader import load_model

    return load_model("smollm2", torch.float32, torch.device("cpu")), "cpu", torch.float32


class Bench:
    def __init__(self, args: argparse.Namespace, model: Any, device: str, dtype: torch.dtype, store_url: str | None,
                 disk_dir: str):
        c = model.config
        per_block = bytes_per_block(c, BS, cache_dtype(args.kv_cache_dtype, dtype))
        self.doc_blocks = args.n * -(-args.doc_len // BS)
        request_blocks = args.n * -(-args.doc_len // BS) + -(-(args.question_len + 16) // BS) + 4
        offload = {"cpu_bytes": (self.doc_blocks + 64) * per_block, "store_url": store_url,
                   "disk_path": disk_dir if "disk" in args.tiers else None,
                   "disk_bytes": 2 * (self.doc_blocks + 64) * per_block, "store_timeout_ms": args.store_timeout_ms,
                   "store_secret": secrets.token_hex(16)}  # payloads on disk and in the store carry a MAC
        self.store_url = store_url
        offload["async_loads"] = False  # loads inside admission, where timed_fill times them
        extra: dict[str, Any] = {}
        if device == "cuda":
            from spanserve.attention.triton import TritonBackend

            extra["backend"] = TritonBackend()
        longest = args.n * args.doc_len + args.question_len + 16
        self.eng = LLMEngine(EngineConfig.from_kwargs(
            model=model, device=device, dtype=dtype, block_size=BS, num_blocks=2 * request_blocks + 16,
            max_num_batched_tokens=longest + 16, max_num_seqs=2, kv_offload=offload,
            kv_cache_dtype=args.kv_cache_dtype, **extra))
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(0)
        v = c.vocab_size
        self.prefix = random_tokens(gen, 16, v)
        self.docs = [random_tokens(gen, args.doc_len, v) for _ in range(args.n)]
        self.gen, self.vocab, self.qlen = gen, v, args.question_len
        self.fill_s: list[float] = []  # whole loads: tier reads, pool bookkeeping, copies into the pool
        self.copy_s: list[float] = []  # of which the copies into the pool (write_blocks, timed on the device)
        self.upload_runs: list[int] = []  # contiguous host runs each load's blocks came in (one copy each)
        fill, write = self.eng.tiers.fill, self.eng.storage.write_blocks

        laps: list[Any] = []  # (start, end) events of write_blocks, read once the fill is synchronized

        def timed_fill(*a: Any, **k: Any) -> Any:
            self._sync()
            t0 = time.perf_counter()
            out = fill(*a, **k)
            self._sync()
            self.fill_s.append(time.perf_counter() - t0)
            for lap, (ids, kvs) in laps:
                self.copy_s.append(lap if isinstance(lap, float) else lap[0].elapsed_time(lap[1]) / 1e3)
                self.upload_runs.append(len(kv_upload.plan(ids, kvs).runs))
            laps.clear()
            return out

        def timed_write(*a: Any) -> Any:  # device events, no sync: the copies stay overlapped
            if self.device.type != "cuda":
                t0 = time.perf_counter()
                write(*a)
                laps.append((time.perf_counter() - t0, a))
                return
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            write(*a)
            end.record()
            laps.append(((start, end), a))
        self.eng.manager.tiers.fill = timed_fill  # type: ignore[method-assign]
        self.eng.storage.write_blocks = timed_write  # type: ignore[method-assign]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def graph_captures(self) -> int:
        """Step CUDA graphs captured so far (none without graphs; the log keeps the last 64)."""
        graphs = getattr(self.eng.executor, "step_graphs", None)
        return len(graphs.captured) if graphs is not None else 0

    def layout(self) -> list[Segment]:
        q = random_tokens(self.gen, self.qlen, self.vocab)  # a new question each time: only documents hit
        return ([Segment(token_ids=self.prefix)] + [Segment(token_ids=d, kind="plus") for d in self.docs]
                + [Segment(token_ids=q)])

    def plain(self) -> list[int]:
        """The same tokens as one plain prompt (what an engine without span reuse computes)."""
        q = random_tokens(self.gen, self.qlen, self.vocab)
        return self.prefix + [t for d in self.docs for t in d] + q

    def ttft(self, namespace: str = "", plain: bool = False) -> tuple[float, dict[str, int]]:
        self._sync()
        req = self.eng.add_request(self.plain() if plain else self.layout(), ONE, namespace=namespace)
        while self.eng.has_unfinished():
            self.eng.step()
        return req.first_token_time - req.arrival_time, dict(req.reuse)

    def clear_pool(self) -> None:
        """Forget every cached block without writing it anywhere (explicit eviction skips write-back)."""
        pool = self.eng.pool
        for b in pool.blocks:
            if b.key is not None and b.ref_cnt == 0:
                pool.evict(b)

    def cached_kv(self) -> list[BlockKV]:
        """Every block the pool caches (the documents' and the prefix's; full blocks and partial
        tails), copied to (pinned) host memory."""
        e = self.eng
        cached = [b for b in e.pool.blocks if b.key is not None]
        out = torch.empty((len(cached), *e.tiers.shape.dims), dtype=e.tiers.shape.host_dtype,
                          pin_memory=self.device.type == "cuda")
        e.storage.read_blocks([b.id for b in cached], out)
        self._sync()
        return [BlockKV(b.key, b.tokens, out[i], b.parent) for i, b in enumerate(cached)]

    def check_loaded(self, blocks: list[BlockKV], sample: int = 256) -> int:
        """Read a random sample of `blocks` back from the pool, where the last load put them, and
        compare them with what the tier held (the load path's result on this device). Returns
        how many were compared; raises on a difference."""
        pick = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(1))[:sample].tolist()
        held = [(blocks[i], self.eng.pool.lookup(blocks[i].key, blocks[i].tokens)) for i in pick]
        held = [(kv, b) for kv, b in held if b is not None]
        out = torch.empty((len(held), *self.eng.tiers.shape.dims), dtype=self.eng.tiers.shape.host_dtype)
        self.eng.storage.read_blocks([b.id for _, b in held], out)
        for (kv, _), got in zip(held, out):
            if not torch.equal(kv.kv.cpu(), got):
                raise AssertionError(f"block {kv.key:x} differs in the pool from the tier's copy")
        return len(held)


def ceiling(bench: Bench, blocks: list[BlockKV], tier: str) -> float:
    """GB/s the tier's medium gives a plain reader of the same bytes, measured here: a pinned
    host-to-device copy (a memory copy on the CPU), raw file reads, raw MGETs."""
    stack = bench.eng.tiers
    t0 = time.perf_counter()
    if tier == "host":
        nbytes = min(1 << 30, len(blocks) * stack.shape.kv_bytes)
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=bench.device.type == "cuda")
        dst = torch.empty(nbytes, dtype=torch.uint8, device=bench.device)
        times = []
        for _ in range(3):
            bench._sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            bench._sync()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times) / 1e9
    if tier == "disk":
        total = sum(len(f.read_bytes()) for f in sorted(stack.disk.dir.glob("*.kv")))
    else:
        import redis

        client = redis.Redis.from_url(bench.store_url, socket_timeout=60)  # a plain reader, no deadline
        keys = [stack.store._key(b.key) for b in blocks]
        total = 0
        for lo in range(0, len(keys), 64):
            total += sum(len(v) for v in client.mget(keys[lo:lo + 64]) if v)
    return total / (time.perf_counter() - t0) / 1e9


def block_copies(bench: Bench) -> float:
    """GB/s of the host ceiling's bytes copied one KV block at a time (pinned, queued without
    waiting): what the link gives at the granularity of separately captured blocks."""
    piece = bench.eng.tiers.shape.kv_bytes
    n = max(1, min(1 << 30, 512 * piece) // piece)
    src = torch.empty(n * piece, dtype=torch.uint8, pin_memory=bench.device.type == "cuda")
    dst = torch.empty(n * piece, dtype=torch.uint8, device=bench.device)
    times = []
    for _ in range(3):
        bench._sync()
        t0 = time.perf_counter()
        for i in range(n):
            dst[i * piece:(i + 1) * piece].copy_(src[i * piece:(i + 1) * piece], non_blocking=True)
        bench._sync()
        times.append(time.perf_counter() - t0)
    return n * piece / min(times) / 1e9


def place(bench: Bench, tier: str, blocks: list[BlockKV]) -> None:
    stack = bench.eng.tiers
    assert stack.flush(600)
    stack.host.drain()
    if stack.disk is not None:
        stack.disk.clear()
    getattr(stack, tier).store_many(blocks)


def timed(bench: Bench, runs: int, request: "Callable[[], tuple[float, dict[str, int]]]",
          before: "Callable[[], None]" = lambda: None, loads: bool = False) -> dict[str, Any]:
    """One warm-up request (dropped; a first short step over a cached context captures a CUDA
    graph) and `runs` timed ones, each after `before()`: their TTFTs, median and reuse, and with
    `loads` the tier loads' times."""
    before()
    bench.fill_s.clear()
    warm, _ = request()
    captures = bench.graph_captures()
    ttfts, fills, copies, reuse = [], [], [], {}
    for _ in range(runs):
        before()
        bench.fill_s.clear()
        bench.copy_s.clear()
        bench.upload_runs.clear()
        t, reuse = request()
        ttfts.append(t)
        fills += bench.fill_s[:1]
        copies.append(sum(bench.copy_s))
    out = {"ttft_s": median(ttfts), "ttfts_s": ttfts, "warmup_s": warm, "reuse": reuse,
           "graph_captures": bench.graph_captures() - captures}
    if loads:
        out.update(load_s=median(fills), loads_s=fills, copy_s=median(copies), upload_runs=list(bench.upload_runs))
    return out


def run(args: argparse.Namespace, store_url: str | None, disk_dir: str) -> dict[str, Any]:
    model, device, dtype = build_model(args)
    bench = Bench(args, model, device, dtype, store_url, disk_dir)
    del model
    stack = bench.eng.tiers
    kv_bytes = args.n * args.doc_len * stack.shape.kv_bytes // BS  # the documents' KV, token by token
    print(f"{args.n} documents x {args.doc_len} tokens, {bench.doc_blocks} full blocks per request, "
          f"{kv_bytes / 2**30:.2f} GiB of KV; tiers: {', '.join(args.tiers)}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    count = itertools.count()  # every recompute in a namespace of its own: nothing of an earlier run hits
    results["stock"] = timed(bench, args.runs, lambda: bench.ttft(f"stock-{next(count)}", plain=True),
                             bench.clear_pool)
    results["recompute"] = timed(bench, args.runs, lambda: bench.ttft(f"cold-{next(count)}"), bench.clear_pool)
    bench.clear_pool()
    bench.ttft()  # documents computed in the default namespace, now cached in the pool
    blocks = bench.cached_kv()
    assert stack.flush(600)
    results["pool"] = timed(bench, args.runs, bench.ttft)
    ceilings: dict[str, float] = {}
    for tier in args.tiers:
        place(bench, tier, blocks)
        hits = getattr(stack, tier).stats.hits

        def reload(tier: str = tier) -> None:
            if tier == "host":  # what the previous run loaded moved to the pool; put it back
                stack.host.store_many(blocks)
            bench.clear_pool()
        r = results[tier] = timed(bench, args.runs, bench.ttft, reload, loads=True)
        loaded = (getattr(stack, tier).stats.hits - hits) // (args.runs + 1) * stack.shape.kv_bytes
        r.update(loaded_bytes=loaded, load_GBps=loaded / r["load_s"] / 1e9,
                 copy_GBps=loaded / r["copy_s"] / 1e9 if r["copy_s"] else 0.0,  # 0: nothing was loaded
                 checked_blocks=bench.check_loaded(blocks))
        ceilings[tier] = ceiling(bench, blocks, tier)
        if tier == "host":
            r["block_copies_GBps"] = block_copies(bench)
        print(f"  {tier}: TTFT {r['ttft_s']:.3f} s, load {r['load_s']:.3f} s (copies {r['copy_s']:.3f} s); "
              f"{r['checked_blocks']} loaded blocks read back equal", flush=True)
    stack.close()
    return {"results": results, "ceiling_GBps": ceilings, "kv_bytes": kv_bytes,
            "break_even_GBps": kv_bytes / results["recompute"]["ttft_s"] / 1e9, "bounds": bounds(results, ceilings)}


def bounds(results: dict[str, dict[str, Any]], ceilings: dict[str, float]) -> dict[str, float]:
    """The fastest a host-tier hit can be: its bytes at the pinned-copy ceiling, alone and followed
    by the pool-resident request's compute; and the speedups over recompute that allows."""
    if "host" not in results or not ceilings.get("host"):
        return {}
    copy = results["host"]["loaded_bytes"] / (ceilings["host"] * 1e9)
    with_step = copy + results["pool"]["ttft_s"]
    out = {"copy_s": copy, "copy_then_pool_s": with_step}
    for name in ("recompute", "stock"):
        out[f"max_x_{name}"] = results[name]["ttft_s"] / copy
        out[f"max_x_{name}_with_step"] = results[name]["ttft_s"] / with_step
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    redis = None
    with tempfile.TemporaryDirectory() as tmp:
        disk_dir = args.disk_dir or str(Path(tmp) / "kv")
        if "store" in args.tiers:
            from redis_server import RedisServer

            redis = RedisServer(Path(tmp)).start()
        try:
            out = run(args, redis.url if redis else None, disk_dir)
        finally:
            if redis is not None:
                redis.stop()
    report(args, out)
    tag = ("_gpu" if args.gpu else "_dry" if args.dry else "") + ("_fp8" if args.kv_cache_dtype == "fp8" else "")
    what = ("random Llama-3-8B bf16, H100" if args.gpu else "tiny random" if args.dry else "SmolLM2-135M fp32, CPU") + (
        ", FP8 KV" if args.kv_cache_dtype == "fp8" else "")
    png = plot(out, f"tiers_ttft{tag}.png", f"{args.n} x {args.doc_len}-token RAG layout, {what}")
    path = write_json(f"tiers{tag}.json", {"args": {k: v for k, v in vars(args).items()}, **out})
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
