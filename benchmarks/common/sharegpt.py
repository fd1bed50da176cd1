"""A ShareGPT-shaped load as `vllm bench serve` sends it, and vLLM's summary of it.

`vllm bench serve --dataset-name sharegpt --num-prompts 1000 --request-rate inf` sends every
request at once to /v1/completions, greedy, streaming, `ignore_eos`, each with its conversation's
prompt and output lengths. Here the lengths are drawn from log-normals with ShareGPT's means (about
230 prompt and 200 output tokens, long-tailed; vLLM's filter keeps prompts of 4-1024 tokens and
4-2048 in all), and the text is random words of the benchmark's word-level tokenizer (one word,
one token).

The decode roofline loads run fixed batches (1, 64, 256 requests of equal length at once) so the
server's decode-only steps at exactly that batch can be read from /metrics.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from common.serving_load import COMPLETIONS, Request, Result, pct, words

MEAN_IN, MEAN_OUT, SIGMA = 230.0, 200.0, 0.9


def _lognormal(rng: np.random.Generator, n: int, mean: float, lo: int, hi: int) -> list[int]:
    mu = math.log(mean) - SIGMA ** 2 / 2  # the mean of exp(N(mu, SIGMA^2)) is `mean`
    return [int(x) for x in np.clip(np.round(rng.lognormal(mu, SIGMA, n)), lo, hi)]


def _body(model: str, prompt: str, out: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": out, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def sharegpt_requests(seed: int, n: int, model: str, first: int, vocab: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    ins = _lognormal(rng, n, MEAN_IN, 4, 1024)
    outs = [min(o, 2048 - i) for o, i in zip(_lognormal(rng, n, MEAN_OUT, 4, 2044), ins)]
    return [Request(COMPLETIONS, _body(model, words(rng, i, first, vocab), o), o) for i, o in zip(ins, outs)]


def fixed_batch(seed: int, batch: int, model: str, first: int, vocab: int, prompt: int = 128,
                out: int = 256) -> list[Request]:
    """`batch` requests of equal length, sent together: after their prefill, decode steps of
    exactly `batch` rows."""
    rng = np.random.default_rng(seed)
    return [Request(COMPLETIONS, _body(model, words(rng, prompt, first, vocab), out), out) for _ in range(batch)]


def vllm_summary(results: list[Result]) -> dict[str, Any]:
    """vLLM's serving benchmark result: throughputs and TTFT / TPOT / ITL mean, median, p99 (ms)."""
    ok = [r for r in results if r.error is None and r.first is not None]
    dur = max(r.end for r in results) - min(r.sent for r in results)
    out_tok, in_tok = sum(r.tokens for r in ok), sum(r.prompt_tokens for r in ok)
    ttft = [1e3 * (r.first - r.sent) for r in ok]  # type: ignore[operator]
    tpot = [1e3 * (r.end - r.first) / (r.tokens - 1) for r in ok if r.tokens > 1]  # type: ignore[operator]
    itl = [1e3 * x for r in ok for x in r.itl]
    out: dict[str, Any] = {"successful_requests": len(ok), "failed_requests": len(results) - len(ok),
                           "errors": sorted({r.error for r in results if r.error})[:5], "duration_s": dur,
                           "total_input_tokens": in_tok, "total_generated_tokens": out_tok,
                           "requests_per_s": len(ok) / dur, "output_tok_s": out_tok / dur,
                           "total_tok_s": (in_tok + out_tok) / dur}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        out[f"{name}_mean_ms"] = float(np.mean(xs)) if xs else math.nan
        out[f"{name}_median_ms"] = pct(xs, 50)
        out[f"{name}_p99_ms"] = pct(xs, 99)
    return out


def print_summary(s: dict[str, Any], title: str = "Serving Benchmark Result") -> None:
    print(f"{f' {title} ':=^50}")
    for label, key, fmt in (("Successful requests:", "successful_requests", "{}"),
                            ("Benchmark duration (s):", "duration_s", "{:.2f}"),
                            ("Total input tokens:", "total_input_tokens", "{}"),
                            ("Total generated tokens:", "total_generated_tokens", "{}"),
                            ("Request throughput (req/s):", "requests_per_s", "{:.2f}"),
                            ("Output token throughput (tok/s):", "output_tok_s", "{:.2f}"),
                            ("Total Token throughput (tok/s):", "total_tok_s", "{:.2f}")):
        print(f"{label:<40}{fmt.format(s[key]):>10}")
    for name, head in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency")):
        print(f"{head:-^50}")
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            print(f"{f'{label} {name.upper()} (ms):':<40}{s[f'{name}_{stat}_ms']:>10.2f}")
    print("=" * 50, flush=True)


def bound_fraction(stats: dict[str, float], weight_bytes: int, kv_bytes: int, gbps: float) -> float:
    """The fraction of the weights + KV bandwidth bound reached by decode-only steps of one batch
    size: bytes the steps must read over the device's copy bandwidth, against their wall time."""
    nbytes = stats["steps"] * weight_bytes + stats["kv_tokens"] * kv_bytes
    return nbytes / (gbps * 1e9) / stats["seconds"]
