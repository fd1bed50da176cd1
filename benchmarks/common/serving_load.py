"""Workloads and the HTTP load generator of the serving benchmark.

Requests are plain dicts (route + JSON body) built from a seeded generator, so the offline engine
can be given exactly the same ones. The client streams every response (aiohttp, one connection
per request) and timestamps each content chunk: TTFT is send to first content, inter-token
latency is the gap between chunks spread over the tokens each one carries (the word-level
tokenizer makes that count exact: one word per token).
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass
class Request:
    route: str
    body: dict[str, Any]
    output_tokens: int


@dataclass
class Result:
    sent: float
    end: float
    first: float | None = None
    tokens: int = 0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


# ---------------------------------------------------------------------------- workloads


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> list[int]:
    """Lengths spread like chat traffic (ShareGPT's are roughly log-normal), clipped to [lo, hi]."""
    return [int(x) for x in np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), lo, hi)]


def words(rng: np.random.Generator, n: int, first: int, vocab: int) -> str:
    return " ".join(f"w{i}" for i in rng.integers(first, vocab, n))


def _sampling(model: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def chat_requests(seed: int, n: int, model: str, first: int, vocab: int, in_median: float, out_median: float,
                  sigma: float = 0.6, max_in: int = 2048, max_out: int = 1024) -> list[Request]:
    rng = np.random.default_rng(seed)
    ins = lognormal_lengths(rng, n, in_median, sigma, 4, max_in)
    outs = lognormal_lengths(rng, n, out_median, sigma, 2, max_out)
    return [Request(CHAT, {**_sampling(model, o), "messages": [{"role": "user", "content": words(rng, i, first, vocab)}]}, o)
            for i, o in zip(ins, outs)]


@dataclass(frozen=True)
class RagShape:
    docs: int = 32
    doc_tokens: tuple[int, int] = (1000, 3000)
    per_request: tuple[int, int] = (4, 8)
    question_tokens: tuple[int, int] = (16, 48)
    system_tokens: int = 24
    output_tokens: int = 32


def rag_corpus(seed: int, shape: RagShape, first: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lo, hi = shape.doc_tokens
    return [rng.integers(first, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(shape.docs)]


def rag_requests(seed: int, n: int, model: str, corpus: list[list[int]], shape: RagShape, first: int, vocab: int,
                 spans: bool, cover: bool = False) -> list[Request]:
    """n questions, each over 4-8 corpus documents in random order: as span layouts (documents
    are `plus` segments, reused wherever they sit) or as the same tokens in one plain prompt.
    The same seed gives the same documents, order and question either way. `cover`: the
    documents in corpus order, as many per request as fit, until every one was sent (warm-up)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(first, vocab, shape.system_tokens).tolist()
    per = shape.per_request[1]
    picks = ([list(range(i, min(i + per, len(corpus)))) for i in range(0, len(corpus), per)] if cover else
             [rng.permutation(len(corpus))[:int(rng.integers(shape.per_request[0], per + 1))].tolist()
              for _ in range(n)])
    out = []
    for pick in picks:
        docs = [corpus[i] for i in pick]
        q = rng.integers(first, vocab, int(rng.integers(shape.question_tokens[0], shape.question_tokens[1] + 1)))
        body = _sampling(model, shape.output_tokens)
        if spans:
            body["segments"] = ([{"token_ids": system}] + [{"token_ids": d, "kind": "plus"} for d in docs]
                                + [{"token_ids": q.tolist()}])
        else:
            body["prompt"] = system + [t for d in docs for t in d] + q.tolist()
        out.append(Request(COMPLETIONS, body, shape.output_tokens))
    return out


def arrivals(seed: int, n: int, rate: float) -> list[float]:
    """Send offsets in seconds: Poisson arrivals at `rate` per second; all at 0 when rate is inf."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


# ---------------------------------------------------------------------------- client


def _content(route: str, choice: dict[str, Any]) -> str:
    if route == CHAT:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def _one(session: Any, base: str, req: Request, delay: float, t0: float) -> Result:
    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    res = Result(sent=time.perf_counter(), end=0.0)
    last = None
    try:
        async with session.post(base + req.route, json=req.body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    msg = json.loads(line[6:])
                    if "error" in msg:
                        res.error = str(msg["error"])[:200]
                        break
                    if msg.get("usage"):
                        u = msg["usage"]
                        res.tokens = u["completion_tokens"]
                        res.prompt_tokens = u["prompt_tokens"]
                        res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    n = sum(len(_content(req.route, c).split()) for c in msg.get("choices", []))
                    if n == 0:
                        continue
                    if res.first is None:
                        res.first = now
                    elif last is not None:
                        res.itl.extend([(now - last) / n] * n)
                    last = now
    except Exception as e:  # a broken connection is a failed request, not a crashed benchmark
        res.error = f"{type(e).__name__}: {e}"[:200]
    res.end = time.perf_counter()
    return res


async def _run(base: str, reqs: list[Request], offsets: list[float]) -> list[Result]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        t0 = time.perf_counter() + 0.05
        return list(await asyncio.gather(*(_one(session, base, r, d, t0) for r, d in zip(reqs, offsets))))


def run_load(base: str, reqs: list[Request], rate: float, seed: int = 0) -> list[Result]:
    return asyncio.run(_run(base, reqs, arrivals(seed, len(reqs), rate)))


# ---------------------------------------------------------------------------- statistics


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


def summarize(results: list[Result], offered_rate: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None and r.first is not None]
    start = min(r.sent for r in results)
    end = max(r.end for r in results)
    span = end - start
    ttft = [r.first - r.sent for r in ok]  # type: ignore[operator]
    itl = [x for r in ok for x in r.itl]
    tokens = sum(r.tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "offered_rate": None if math.isinf(offered_rate) else offered_rate, "requests": len(results), "ok": len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": span, "requests_per_s": len(ok) / span, "output_tokens_per_s": tokens / span,
        "output_tokens": tokens, "prompt_tokens": prompt,
        "cached_fraction": sum(r.cached_tokens for r in ok) / max(prompt, 1),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
    }


BUCKETS = ((1, 1), (2, 15), (16, 31), (32, 63), (64, 1 << 30))  # decode batch sizes the roofline groups


def stats_diff(after: dict[int, list[float]], before: dict[int, list[float]]) -> dict[str, dict[str, float]]:
    out = {}
    for b, (s, sec, kv) in after.items():
        s0, sec0, kv0 = before.get(b, [0.0, 0.0, 0.0])
        if s > s0:
            out[str(b)] = {"steps": s - s0, "seconds": sec - sec0, "kv_tokens": kv - kv0}
    return out


def roofline(decode: dict[str, dict[str, float]], weight_bytes: int, kv_bytes: int, gbps: float) -> list[dict]:
    """Per batch-size bucket: mean step time against (weights + KV read) / copy bandwidth."""
    rows = []
    for lo, hi in BUCKETS:
        sel = [(int(b), d) for b, d in decode.items() if lo <= int(b) <= hi]
        steps = sum(d["steps"] for _, d in sel)
        if not steps:
            continue
        secs = sum(d["seconds"] for _, d in sel)
        nbytes = sum(d["steps"] * weight_bytes + d["kv_tokens"] * kv_bytes for _, d in sel)
        rows.append({"batch": f"{lo}" if lo == hi else f"{lo}+" if hi > 1 << 20 else f"{lo}-{hi}",
                     "steps": int(steps), "mean_batch": sum(b * d["steps"] for b, d in sel) / steps,
                     "step_ms": 1e3 * secs / steps, "roofline_ms": 1e3 * nbytes / (gbps * 1e9) / steps,
                     "fraction_of_roofline": nbytes / (gbps * 1e9) / secs})
    return rows


def sustained(runs: list[dict[str, Any]], slo: float) -> dict[str, Any] | None:
    """The highest Poisson rate served without errors with p99 TTFT within the SLO (overload
    shows as queueing, so TTFT is the test); `capped` when no tried rate broke the SLO."""
    good = [r for r in runs if not r["errors"] and r["ok"] == r["requests"] and r["ttft_p99_s"] <= slo]
    if not good:
        return None
    best = max(good, key=lambda r: r["offered_rate"])
    return {"rate": best["offered_rate"], "achieved_requests_per_s": best["requests_per_s"],
            "ttft_p99_s": best["ttft_p99_s"], "capped": best is runs[-1]}
