"""Where an FP8 engine's time goes, beside bfloat16: kernel profiles (torch.profiler, device time
per unit) of a batch-1 decode step, a 16k-token prefill and a warm RAG request (32 pinned
documents of 2857 tokens read at new positions, then a 64-token question), per mode (bf16, FP8
KV, FP8 KV + weights) of a random Llama-3-8B; and the staging of an 8-bit cache's keys and values
for a prefill launch, per layer, for each tile of the kernel (keys per program, warps).

    python benchmarks/experiments/fp8_time.py           # CUDA
    python benchmarks/experiments/fp8_time.py --dry     # tiny model on the CPU, no staging sweep
"""
from __future__ import annotations

import argparse
import gc
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import (  # noqa: E402
    format_table,
    llama3_8b_config,
    random_model,
    random_tokens,
    tiny_llama_config,
    write_json,
)
from fp8 import MODES  # noqa: E402  (benchmarks/fp8.py's modes)

from spanserve.engine.layout import Segment  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.llm import LLM  # noqa: E402

TOP = 8


def profile(fn: Callable[[], None], units: int, cuda: bool) -> list[tuple[str, float, float]]:
    """(kernel, ms per unit, calls per unit) of the top kernels by device time (CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as p:
        fn()
        if cuda:
            torch.cuda.synchronize()
    ka = p.key_averages()

    def t(e: Any) -> float:
        return e.self_device_time_total if cuda else e.self_cpu_time_total

    rows = sorted((e for e in ka if t(e) > 0), key=lambda e: -t(e))[:TOP]
    return [(e.key[:60], t(e) / units / 1e3, e.count / units) for e in rows]


def run_mode(name: str, weights: Any, args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device == "cuda"
    longest = max(args.prefill, args.docs * args.doc_len + 64) + 64
    llm = LLM(weights, device=args.device, dtype="bfloat16" if cuda else "float32", block_size=16,
              kv_cache_memory=int(args.kv_gib * 2**30), max_num_seqs=4, pin_fraction=0.6, max_model_len=longest,
              **MODES[name])
    try:
        return measure(llm, weights.config.vocab_size, args)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def measure(llm: LLM, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device == "cuda"
    gen = torch.Generator().manual_seed(0)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    steps = SamplingParams(max_tokens=1 + args.decode_tokens, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}
    llm.generate(random_tokens(gen, 128, vocab), steps)  # graphs for batch 1
    out["decode step"] = profile(lambda: llm.generate(random_tokens(gen, 128, vocab), steps),
                                 1 + args.decode_tokens, cuda)
    llm.generate(random_tokens(gen, args.prefill, vocab), one)
    out[f"{args.prefill}-token prefill"] = profile(
        lambda: llm.generate(random_tokens(gen, args.prefill, vocab), one), 1, cuda)
    docs = [random_tokens(gen, args.doc_len, vocab) for _ in range(args.docs)]
    llm.pin([Segment(token_ids=d, kind="plus", key=f"d{i}") for i, d in enumerate(docs)], namespace="warm")

    def warm() -> None:
        order = torch.randperm(len(docs), generator=gen).tolist()
        layout = [Segment(token_ids=docs[i], kind="plus") for i in order]
        llm.generate(layout + [Segment(token_ids=random_tokens(gen, 64, vocab))], one, namespace="warm")

    for _ in range(2):
        warm()
    out["warm RAG request"] = profile(lambda: [warm() for _ in range(3)], 3, cuda)
    return out


def staging(args: argparse.Namespace) -> list[dict[str, Any]]:
    """ms per layer of rotate_keys_kernel over the RAG layout's keys (8 KV heads, D 128): bf16 keys
    alone (the bf16 engine's prerotation), then 8-bit keys and values for each tile."""
    import triton

    from spanserve.attention.kv_cache import Fp8Cache, quantize
    from spanserve.attention.triton.kernels import rotate_keys_kernel

    dev, KVH, D, BS = "cuda", 8, 128, 16
    n, per_doc = args.docs * args.doc_len, -(-args.doc_len // BS)
    blocks = args.docs * per_doc
    g = torch.Generator(device=dev).manual_seed(0)
    k8, v8 = (Fp8Cache(*quantize(torch.randn(blocks, BS, KVH, D, device=dev, generator=g))) for _ in range(2))
    kb = torch.randn(blocks, BS, KVH, D, device=dev, generator=g).bfloat16()
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(0)).view(args.docs, per_doc)
    # each document's keys: its (scattered) blocks' slots in order, the last block partly used
    src = torch.cat([(perm[d][:, None] * BS + torch.arange(BS)).view(-1)[:args.doc_len] for d in range(args.docs)])
    src = src.to(device=dev, dtype=torch.int32)
    delta = torch.randint(1, 90000, (args.docs,), device=dev, dtype=torch.int32).repeat_interleave(args.doc_len)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=dev).float() / D))
    out = torch.empty(n, 1, KVH, D, dtype=torch.bfloat16, device=dev)
    v_out = torch.empty_like(out)

    def launch(bk: int, warps: int, fp8: bool) -> Callable[[], None]:
        rows, sc = (k8.data, k8.scale) if fp8 else (kb, kb)
        return lambda: rotate_keys_kernel[(triton.cdiv(n, bk),)](
            rows, sc, out, src, delta, inv_freq, src, n, KVH * D, v8.data, v8.scale, v_out,
            KVH=KVH, D=D, BLOCK_K=bk, BLOCK_KVH=KVH, COUNTED=False, K_FP8=fp8, HAS_V=fp8, num_warps=warps)

    res = [{"what": "bf16 keys", "keys_per_program": 4, "warps": 4, "ms": triton.testing.do_bench(
        launch(4, 4, False), return_mode="median")}]
    for bk, warps in itertools.product((1, 2, 4, 8), (2, 4, 8)):
        res.append({"what": "fp8 keys + values", "keys_per_program": bk, "warps": warps,
                    "ms": triton.testing.do_bench(launch(bk, warps, True), return_mode="median")})
    for r in res:  # bytes read and written per layer (scales aside)
        moved = n * KVH * D * (4 if r["what"] == "bf16 keys" else 6)
        r["tb_s"] = moved / (r["ms"] * 1e-3) / 1e12
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--kv-gib", type=float, default=24.0)
    ap.add_argument("--prefill", type=int, default=16384)
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--doc-len", type=int, default=2857)
    ap.add_argument("--decode-tokens", type=int, default=32, help="decode steps profiled")
    ap.add_argument("--dry", action="store_true", help="tiny random model on the CPU, small sizes, no staging sweep")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.device = "cpu" if args.dry else "cuda"
    if args.dry:
        args.kv_gib, args.prefill, args.docs, args.doc_len, args.decode_tokens = 0.05, 256, 2, 64, 4
        weights = random_model(tiny_llama_config(), "cpu", torch.float32, seed=0)
        args.modes = [m for m in args.modes if m != "fp8"]  # FP8 weights want CUDA's kernels to be timed
    else:
        weights = random_model(llama3_8b_config(), "cuda", torch.bfloat16, seed=0)
    res = {m: run_mode(m, weights, args) for m in args.modes}
    for part in next(iter(res.values())):
        rows = [(m, k, f"{ms:.3f}", f"{calls:g}") for m, r in res.items() for k, ms, calls in r[part]]
        print(f"\n{part}: top kernels by {'device' if not args.dry else 'CPU'} time, per unit")
        print(format_table(["mode", "kernel", "ms", "calls"], rows))
    stage = [] if args.dry else staging(args)
    if stage:
        print(f"\nstaging {args.docs * args.doc_len} keys, one layer (8 KV heads, D 128)")
        print(format_table(["what", "keys / program", "warps", "ms", "TB/s"],
                           [(r["what"], r["keys_per_program"], r["warps"], f"{r['ms']:.3f}", f"{r['tb_s']:.2f}")
                            for r in stage]))
    device = "CPU, tiny random model" if args.dry else torch.cuda.get_device_name()
    name = args.out or ("fp8_time_dry.json" if args.dry else "fp8_time_gpu.json")
    path = write_json(name, {"benchmark": "fp8_time", "device": device, "args": vars(args),
                             "profiles": {m: {p: [list(x) for x in rows] for p, rows in r.items()} for m, r in res.items()},
                             "staging": stage})
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
