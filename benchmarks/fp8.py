"""FP8 beside bfloat16, in one run on one GPU: the KV pool's token capacity, decode inter-token
latency at batch 1 and 64, a 16k-token prefill, and RAG time to first token (span warm and span
cold, 32 documents of 2857 tokens), for three modes of the same random Llama-3-8B:

  bf16       the model and its KV cache in bfloat16 (the default)
  fp8-kv     kv_cache_dtype="fp8": K and V in float8 e4m3, a power-of-two scale per token and KV head
  fp8        that and quantization="fp8": linear weights in e4m3, scaled per output channel

    python benchmarks/fp8.py              # CUDA (an H100 for the published figures)
    python benchmarks/fp8.py --quick      # a short smoke run of the same steps

Each mode builds its engine from the same weights, measures, and shuts down before the next. A
host-tier hit against encoding the segments is `benchmarks/tiers.py --gpu --kv-cache-dtype fp8`
(both sides of that ratio come from one engine).
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, llama3_8b_config, median, random_model, random_tokens, write_json  # noqa: E402
from rag_ttft import Bench, measure  # noqa: E402

from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.llm import LLM  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "bf16": {},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "fp8": {"kv_cache_dtype": "fp8", "quantization": "fp8"},
}
BS = 16
PARTS = ("itl", "prefill", "rag")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS), help="what to measure")
    ap.add_argument("--kv-gib", type=float, default=24.0, help="KV pool memory, the same in every mode")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per ITL measurement")
    ap.add_argument("--prefill", type=int, default=16384, help="tokens of the long prefill")
    ap.add_argument("--docs", type=int, default=32)
    ap.add_argument("--doc-len", type=int, default=2857)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens per step, so the longest chunk of a prompt (default: the engine's, 8192 on a GPU)")
    ap.add_argument("--quick", action="store_true", help="short smoke run: small sizes, one run")
    ap.add_argument("--cpu", action="store_true", help="the script end to end on a CPU: a tiny random model")
    ap.add_argument("--out", default="fp8_gpu.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.decode_tokens, args.prefill, args.docs, args.doc_len, args.runs = 8, 2048, 4, 256, 1
        args.out = "fp8_gpu_quick.json"
    if args.cpu:  # a tiny model: a pool of the GPU's size would only take the host's memory
        args.kv_gib = min(args.kv_gib, 0.25)
    return args


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_itl(llm: LLM, batch: int, tokens: int, vocab: int, runs: int) -> float:
    """Seconds per decode step of `batch` requests of 128-token prompts: the time of `tokens`
    more decode steps over the time of the prefill and first token alone, the median of `runs`
    such pairs (one run alone once read 9.6 ms where the others read 7.1)."""
    gen = torch.Generator().manual_seed(batch)
    params = {n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 1 + tokens)}
    for p in params.values():  # warm-up: graphs for this batch size
        llm.generate([random_tokens(gen, 128, vocab) for _ in range(batch)], p)
    per_step = []
    for _ in range(runs):
        times = []
        for p in params.values():
            prompts = [random_tokens(gen, 128, vocab) for _ in range(batch)]  # new ones: nothing cached
            sync()
            t0 = time.perf_counter()
            llm.generate(prompts, p)
            sync()
            times.append(time.perf_counter() - t0)
        per_step.append((times[1] - times[0]) / tokens)
    return median(per_step)


def prefill_tps(llm: LLM, n: int, vocab: int, runs: int) -> float:
    gen = torch.Generator().manual_seed(n)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ttfts = []
    for r in range(runs + 1):  # the first is a warm-up
        out = llm.generate(random_tokens(gen, n, vocab), one, namespace=f"prefill-{r}")[0]
        if r:
            ttfts.append(out.metrics["ttft"])
    return n / median(ttfts)


def run_mode(name: str, weights: Any, args: argparse.Namespace) -> dict[str, Any]:
    vocab = weights.config.vocab_size
    longest = max(args.prefill, args.docs * args.doc_len + 64) + 64
    llm = LLM(weights, device=args.device, dtype="bfloat16" if args.device == "cuda" else "float32", block_size=BS, kv_cache_memory=int(args.kv_gib * 2**30),
              max_num_seqs=64, pin_fraction=0.6, max_model_len=longest,
              max_num_batched_tokens=args.max_num_batched_tokens, **MODES[name])
    try:
        e = llm.engine
        out: dict[str, Any] = {"pool_tokens": e.pool.num_blocks * BS, "kv_dtype": str(e.storage.k.dtype)}
        print(f"[{name}] pool {out['pool_tokens']} tokens in {args.kv_gib} GiB", flush=True)
        if "itl" in args.parts:
            out["itl_b1_ms"] = 1e3 * decode_itl(llm, 1, args.decode_tokens, vocab, args.runs)
            out["itl_b64_ms"] = 1e3 * decode_itl(llm, 64, args.decode_tokens, vocab, args.runs)
            print(f"[{name}] ITL b1 {out['itl_b1_ms']:.2f} ms, b64 {out['itl_b64_ms']:.2f} ms", flush=True)
        if "prefill" in args.parts:
            out["prefill_tok_s"] = prefill_tps(llm, args.prefill, vocab, args.runs)
            print(f"[{name}] {args.prefill}-token prefill {out['prefill_tok_s']:.0f} tok/s", flush=True)
        if "rag" in args.parts:
            bench = Bench(llm, 64, seed=0)
            measure(bench, 1, args.doc_len, 1, f"warmup-{name}", quiet=True)
            ttft, reuse = measure(bench, args.docs, args.doc_len, args.runs, name, discard=1, quiet=True)
            out.update({f"rag_{v}_ms": 1e3 * median(ttft[v]) for v in ("stock", "cold", "warm")})
            out["rag_ttfts_s"] = ttft
            print(f"[{name}] RAG {args.docs} x {args.doc_len}: " +
                  ", ".join(f"{v} {out[f'rag_{v}_ms']:.1f} ms" for v in ("stock", "cold", "warm")), flush=True)
        return out
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.device = "cpu" if args.cpu else "cuda"
    if args.cpu:
        from spanserve.model.config import ModelConfig

        tiny = ModelConfig(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=8192, name="tiny")
        weights = random_model(tiny, "cpu", torch.float32, seed=0)
    else:
        weights = random_model(llama3_8b_config(), "cuda", torch.bfloat16, seed=0)
    res = {m: run_mode(m, weights, args) for m in args.modes}
    base = res.get("bf16")
    cols = [("pool tokens", "pool_tokens")]
    cols += [("ITL b1 ms", "itl_b1_ms"), ("ITL b64 ms", "itl_b64_ms")] if "itl" in args.parts else []
    cols += [(f"{args.prefill // 1024}k prefill tok/s", "prefill_tok_s")] if "prefill" in args.parts else []
    cols += [("RAG warm ms", "rag_warm_ms"), ("RAG cold ms", "rag_cold_ms")] if "rag" in args.parts else []
    rows = []
    for m, r in res.items():
        row: list[Any] = [m]
        for _, key in cols:
            row += [r[key], f"{r[key] / base[key]:.2f}x" if base else "-"]
        rows.append(row)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU, tiny random model"
    print(f"\nrandom Llama-3-8B, {device}; ratios against bf16 from this run")
    print(format_table(["mode"] + [h for c, _ in cols for h in (c, "x")], rows))
    path = write_json(args.out, {"benchmark": "fp8", "args": vars(args), "device": device,
                                 "model": "random Llama-3-8B", "modes": {m: MODES[m] for m in res}, "results": res})
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
