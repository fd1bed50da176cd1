"""The chunked-prefill budget: the offline engine on ShareGPT-shaped requests (log-normal lengths
with means of about 230 prompt and 200 output tokens, greedy, ignore_eos) at budgets of 2k, 8k
and 16k tokens per step, random Llama-3-8B bf16 on one GPU; prints output tokens/s and requests/s
for each.

    python benchmarks/experiments/prefill_budget.py [--requests 800] [--budgets 2048,8192,16384]
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, llama3_8b_config, write_json  # noqa: E402

from spanserve.engine.config import EngineConfig  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.model.weights import RandomWeights  # noqa: E402


def run(n: int, budget: int) -> dict[str, float]:
    eng = LLMEngine(EngineConfig.from_kwargs(model=RandomWeights(llama3_8b_config(), seed=0),
                                             max_num_batched_tokens=budget))
    eng.detokenize = False  # as the engine core runs
    g = torch.Generator().manual_seed(0)
    ins = torch.distributions.LogNormal(5.03, 0.9).sample((n,)).clamp(4, 1024).int().tolist()
    outs = torch.distributions.LogNormal(4.89, 0.9).sample((n,)).clamp(4, 1024).int().tolist()
    for a, b in zip(ins, outs):
        eng.add_request(torch.randint(3, 100000, (a,), generator=g).tolist(),
                        SamplingParams(max_tokens=b, ignore_eos=True, temperature=0))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.advance()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out = {"budget": budget, "output_tok_s": eng.counters["generation_tokens"] / dt, "requests_per_s": n / dt}
    eng.shutdown()
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--budgets", default="2048,8192,16384")
    a = ap.parse_args()
    rows = [run(a.requests, int(b)) for b in a.budgets.split(",")]
    print(format_table(["budget", "output tok/s", "req/s"], [[r["budget"], r["output_tok_s"], r["requests_per_s"]]
                                                             for r in rows]))
    write_json("prefill_budget.json", {"requests": a.requests, "runs": rows})


if __name__ == "__main__":
    main()
