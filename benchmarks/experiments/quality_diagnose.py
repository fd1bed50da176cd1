"""Why selective recomputation loses to none: per-layer evidence on a few retrieval cases, SmolLM2.

    .venv/bin/python benchmarks/experiments/quality_diagnose.py                 # 3 key-value cases, 4 x 256-token segments
    .venv/bin/python benchmarks/experiments/quality_diagnose.py --cases 1 --ctx 512

Every policy is traced by the plain dense computation of tests/dense_reference.py (float32 here),
which mirrors the engine's policies layer by layer; the engine answers each case greedily to show
whether the policy gets it right. Per policy and layer it prints, for the question's queries:
  bos    attention mass on position 0 (the prompt's real sink)
  starts mass on the first token of every reused segment (summed over segments)
and, for the reused tokens: the relative deviation of their K/V from full's (recomputed ones and
stale ones apart), and how much the recomputed tokens read stale segment starts compared with
what full's same queries give those positions. Then which tokens each policy selected.
`full` is CacheBlend at ratio 1 (everything recomputed at every layer) and `none` the sinks-only
policy with no sinks (layer 0 recomputed, whose KV does not depend on context, nothing above).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
from common import write_json  # noqa: E402
from dense_reference import Dense, policy_logits  # noqa: E402
from common.tasks import make_case  # noqa: E402

from spanserve.engine.layout import resolve, sink_prefix  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.llm import LLM  # noqa: E402
from spanserve.model.loader import load_model  # noqa: E402
from spanserve.reuse.policies import FULL, NONE, CacheBlend, Policy, Sinks, SparseQ  # noqa: E402

BLOCK = 16


def traced() -> dict[str, tuple[Policy, str]]:
    """label -> (policy run by the engine, anchor); the dense trace uses the stand-ins above."""
    return {"full": (FULL, "none"), "none": (NONE, "none"),
            "CacheBlend 15%": (CacheBlend(ratio=0.15), "none"), "SparseQ 15%": (SparseQ(budget=0.15, sink_tokens=0), "none"),
            "sinks 4": (Sinks(sink_tokens=4), "none"),
            "CacheBlend 15% +sink4": (CacheBlend(ratio=0.15, sink_tokens=4), "none"),
            "SparseQ 15% +sink4": (SparseQ(budget=0.15, sink_tokens=4), "none"),
            "none, anchor sink": (NONE, "sink")}


def dense_policy(p: Policy) -> Policy:
    if p == FULL:
        return CacheBlend(ratio=1.0)
    if p == NONE:
        return Sinks(sink_tokens=0)
    return p


class Trace:
    """Per-layer statistics of one policy's dense run."""

    def __init__(self, q_rows: torch.Tensor, starts: torch.Tensor, full: "Trace | None"):
        self.q_rows, self.starts, self.full = q_rows, starts, full
        self.layers: list[dict[str, float]] = []
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # kept for full only
        self.start_cols: list[torch.Tensor] = []  # probs[:, :, starts] per layer, full only
        self.selected: torch.Tensor | None = None

    def __call__(self, i, probs, k, v, recomputed, reused, standalone) -> None:
        q = probs[:, self.q_rows]
        row = {"bos": float(q[:, :, 0].mean()), "starts": float(q[:, :, self.starts].sum(-1).mean())}
        if self.full is None:
            self.kv.append((k.clone(), v.clone()))
            self.start_cols.append(probs[:, :, self.starts].clone())
        else:
            fk, fv = self.full.kv[i]
            stale = reused & ~recomputed
            kk = torch.where(stale[:, None, None], standalone[0], k)
            vv = torch.where(stale[:, None, None], standalone[1], v)
            dev = ((kk - fk).pow(2).sum((1, 2)) + (vv - fv).pow(2).sum((1, 2))).sqrt() / \
                (fk.pow(2).sum((1, 2)) + fv.pow(2).sum((1, 2))).sqrt()
            row["dev_recomputed"] = float(dev[recomputed].mean()) if recomputed.any() else float("nan")
            row["dev_stale"] = float(dev[stale].mean()) if stale.any() else float("nan")
            rec_rows = recomputed.nonzero().flatten()
            stale_starts = stale[self.starts]
            if rec_rows.numel() and stale_starts.any():
                mine = probs[:, rec_rows][:, :, self.starts[stale_starts]].sum(-1).mean()
                theirs = self.full.start_cols[i][:, rec_rows][:, :, stale_starts].sum(-1).mean()
                row["rec_reads_stale_starts"], row["full_same"] = float(mine), float(theirs)
            if i >= 1 and self.selected is None and not bool(recomputed.all() or not recomputed.any()) \
                    and recomputed.sum() < reused.sum():
                self.selected = recomputed.clone()
        self.layers.append(row)


def case_pieces(case, anchor: str, sink: tuple[int, ...]):
    return resolve(case.segments(anchor), None, "none", sink=sink)


def selection_summary(sel: torch.Tensor | None, pieces) -> dict[str, Any]:
    if sel is None:
        return {}
    plus = [p for p in pieces if p.kind == "plus"]
    n = int(sel.sum())
    first = sum(int(sel[p.start]) for p in plus)
    head = sum(int(sel[p.start:p.start + BLOCK].sum()) for p in plus)
    tail = sum(int(sel[p.end - BLOCK:p.end].sum()) for p in plus)
    return {"selected": n, "reused": sum(len(p.tokens) for p in plus), "segment_firsts_selected": f"{first}/{len(plus)}",
            "in_first_block": head, "in_last_block": tail}


def run_case(args, dense: Dense, llm: LLM, case, sink) -> dict[str, Any]:
    out: dict[str, Any] = {"family": case.family, "layout": case.layout, "answer": case.answer, "policies": {}}
    full_trace = None
    params = SamplingParams(max_tokens=12, temperature=0)
    for label, (pol, anchor) in traced().items():
        pieces = case_pieces(case, anchor, sink)
        plus = [p for p in pieces if p.kind == "plus"]
        n = sum(len(p.tokens) for p in pieces)
        q_rows = torch.arange(pieces[-1].start, n)
        starts = torch.tensor([p.start for p in plus])
        tr = Trace(q_rows, starts, full_trace)
        with torch.no_grad():
            logits = policy_logits(dense, pieces, dense_policy(pol), BLOCK, observe=tr)
        if full_trace is None:
            full_trace = tr
        reply = llm.generate(case.segments(anchor), params, policy=pol)[0]
        out["policies"][label] = {"layers": tr.layers, "selection": selection_summary(tr.selected, pieces),
                                  "reply": reply.text, "correct": case.answer in reply.text,
                                  "top1": int(logits.argmax())}
    return out


def show(res: dict[str, Any], layers: list[int]) -> None:
    print(f"\n== {res['family']} / {res['layout']}: answer {res['answer']}")
    for label, p in res["policies"].items():
        print(f"  {label:24s} {'RIGHT' if p['correct'] else 'wrong'}  reply {p['reply'][:40]!r}  {p['selection']}")
    cols = list(res["policies"])
    print("  question's mass on segment first tokens (starts) / on position 0 (bos), by layer:")
    print("  layer " + " ".join(f"{c[:14]:>15s}" for c in cols))
    for i in layers:
        print(f"  {i:5d} " + " ".join(f"{res['policies'][c]['layers'][i]['starts']:6.3f}/{res['policies'][c]['layers'][i]['bos']:.3f}".rjust(15)
                                      for c in cols))
    print("  K/V deviation from full (recomputed | stale reused tokens), and recomputed tokens' mass on stale")
    print("  segment starts vs full's for the same queries, by layer:")
    for c in cols[2:]:
        for i in layers:
            r = res["policies"][c]["layers"][i]
            extra = (f"  reads stale starts {r['rec_reads_stale_starts']:.3f} (full {r['full_same']:.3f})"
                     if "rec_reads_stale_starts" in r else "")
            print(f"  {c[:22]:22s} L{i:<3d} dev rec {r.get('dev_recomputed', float('nan')):.3f} | stale "
                  f"{r.get('dev_stale', float('nan')):.3f}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=3)
    ap.add_argument("--family", default="kv_retrieval")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--layers", default="0,1,2,3,4,5,8,12,16,20,24,29")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model("smollm2", torch.float32, torch.device("cpu"))
    dense = Dense(model.config, model.weights, torch.float32)
    sink = sink_prefix(model.tokenizer)
    llm = LLM(model, dtype="float32", num_blocks=4096, max_num_batched_tokens=4096)
    encode = lambda s: list(model.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    layers = [int(x) for x in args.layers.split(",")]
    results = []
    for i in range(args.cases):
        case = make_case(args.family, ("rag", "chat")[i % 2], i, args.seed, encode, args.ctx, args.chunks)
        res = run_case(args, dense, llm, case, sink)
        show(res, layers)
        sys.stdout.flush()
        results.append(res)
    path = write_json("quality_diagnose.json", {"benchmark": "quality_diagnose", "config": vars(args), "cases": results})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
