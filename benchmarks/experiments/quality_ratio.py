"""Does more recomputation bring a policy closer to `full`? Agreement with full's greedy tokens and
accuracy versus the recompute ratio, for CacheBlend (at a given check layer) and SparseQ, on a few
SmolLM2 cases; then, for one chat case, the reused tokens CacheBlend leaves stale at 95%.

    .venv/bin/python benchmarks/experiments/quality_ratio.py                       # 6 cases, 4 x 128 tokens, CPU
    .venv/bin/python benchmarks/experiments/quality_ratio.py --check-layer 1       # CacheBlend's former check layer
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from common import format_table, set_threads, write_json  # noqa: E402
from dense_reference import Dense, policy_logits  # noqa: E402
from common.tasks import LAYOUTS, is_correct, make_case  # noqa: E402

from spanserve.engine.layout import resolve  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.llm import LLM  # noqa: E402
from spanserve.model.loader import load_model  # noqa: E402
from spanserve.reuse.policies import CacheBlend, SparseQ  # noqa: E402

RATIOS = (0.15, 0.5, 0.8, 0.95)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--check-layer", type=int, default=None, help="CacheBlend's check layer (default: the policy's)")
    ap.add_argument("--cases", type=int, default=2, help="cases per family and layout pair")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--families", nargs="+", default=["single_needle", "multi_key", "var_tracking"])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default="quality_ratio.json")
    args = ap.parse_args()
    set_threads(2)
    model = load_model(args.model, torch.float32, torch.device("cpu"))
    enc = lambda s: list(model.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    llm = LLM(model, device="cpu", dtype="float32", block_size=16, kv_cache_memory=2 * 2**30)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    cases = [make_case(f, LAYOUTS[i % 2], i, 0, enc, args.ctx, 4) for i in range(args.cases) for f in args.families]
    policies = {"none": "none", **{f"CacheBlend {r:.0%}": CacheBlend(ratio=r, check_layer=args.check_layer) for r in RATIOS},
                **{f"SparseQ {r:.0%}": SparseQ(budget=r, sink_tokens=4) for r in RATIOS}}
    scores: dict[str, list[tuple[float, bool]]] = {k: [] for k in policies}
    for c in cases:
        ref = list(llm.generate([c.segments()], params, policy="full")[0].token_ids)
        for label, pol in policies.items():
            out = llm.generate([c.segments()], params, policy=pol)[0]
            ids = list(out.token_ids)
            agree = sum(a == b for a, b in zip(ids, ref)) / max(len(ids), len(ref), 1)
            scores[label].append((agree, is_correct(out.text, c.answer, c.kind)))
    rows = [[k, f"{sum(a for a, _ in v) / len(v):.3f}", f"{sum(b for _, b in v) / len(v):.3f}"] for k, v in scores.items()]
    print(format_table(["policy", "agree w/ full", "accuracy"], rows))
    # which reused tokens CacheBlend keeps stale at 95% on a chat case
    dense = Dense(model.config, model.weights, torch.float32)
    chat = next(c for c in cases if c.layout == "chat")
    pieces = resolve(chat.segments(), None, "none")
    toks = [t for p in pieces for t in p.tokens]
    pol = CacheBlend(ratio=0.95, check_layer=args.check_layer)
    seen: dict[str, list[int]] = {}

    def observe(i, probs, k, v, recomputed, reused, standalone):  # noqa: ANN001
        if i == pol.decision_layer(model.config.num_layers) + 1:
            seen["stale"] = (reused & ~recomputed).nonzero().flatten().tolist()
    logits = policy_logits(dense, pieces, pol, 16, observe=observe)
    stale = [model.tokenizer.decode([toks[j]]) for j in seen["stale"]]
    top = [model.tokenizer.decode([i]) for i in logits.topk(3).indices.tolist()]
    print(f"\nCacheBlend 95% on {chat.family}/{chat.layout}: top next tokens {top}; stale tokens: {' | '.join(stale)}")
    path = write_json(args.out, {"benchmark": "quality_ratio", "config": vars(args), "rows": rows,
                                 "stale_at_95": stale, "top_at_95": top})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
