"""The offline engine on the serving benchmark's requests: LLM.generate with the server's
engine configuration (the same defaults), all requests at once, after a warm-up on other
requests. Run by benchmarks/serving.py in its own process once the server has exited, so each
has the GPU to itself.

    python benchmarks/serving.py offline MODEL_DIR --requests R.json [--warmup W.json] [--max-num-seqs 64]

Prints one JSON line: output tokens, wall seconds, rates, decode-step totals by batch size.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from spanserve import LLM, SamplingParams, Segment
from spanserve.sizes import parse_size


def to_prompt(llm: LLM, req: dict[str, Any]) -> Any:
    """What the server would hand the engine for this request body."""
    body = req["body"]
    if "messages" in body:
        text = llm.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
        return llm.engine.encode(text)
    if "segments" in body:
        return [Segment(token_ids=s["token_ids"], kind=s.get("kind", "cross")) for s in body["segments"]]
    prompt = body["prompt"]
    return llm.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)


def params(req: dict[str, Any]) -> SamplingParams:
    b = req["body"]
    return SamplingParams(max_tokens=b["max_tokens"], temperature=b["temperature"], ignore_eos=b["ignore_eos"])


def run(llm: LLM, reqs: list[dict[str, Any]]) -> tuple[int, float]:
    prompts = [to_prompt(llm, r) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, [params(r) for r in reqs])
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="serving.py offline")
    ap.add_argument("model", type=Path)
    ap.add_argument("--requests", type=Path, required=True)
    ap.add_argument("--warmup", type=Path, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--kv-cache-memory", type=parse_size, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    llm = LLM(str(args.model), max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    load_s = time.perf_counter() - t0
    if args.warmup is not None:
        run(llm, json.loads(args.warmup.read_text()))
    before = llm.engine.decode_stats.snapshot()
    reqs = json.loads(args.requests.read_text())
    tokens, wall = run(llm, reqs)
    after = llm.engine.decode_stats.snapshot()
    decode = {}
    for b, t in after.items():
        p = before.get(b)
        steps = t.steps - (p.steps if p else 0)
        if steps:
            decode[str(b)] = {"steps": steps, "seconds": t.seconds - (p.seconds if p else 0.0),
                              "kv_tokens": t.kv_tokens - (p.kv_tokens if p else 0)}
    print(json.dumps({"runtime": llm.runtime.summary(), "load_s": load_s, "requests": len(reqs),
                      "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
                      "requests_per_s": len(reqs) / wall, "decode": decode,
                      "engine": {"max_num_seqs": llm.engine.scheduler.max_num_seqs, "num_blocks": llm.engine.pool.num_blocks,
                                 "runtime": asdict(llm.runtime)}}), flush=True)
