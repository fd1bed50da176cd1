"""Answer quality of the recomputation policies on synthetic long-context tasks (RULER / SparseX style),
SmolLM2-135M-Instruct on CPU.

    .venv/bin/python benchmarks/quality.py              # 40 cases per family (200 cases)
    .venv/bin/python benchmarks/quality.py --quick      # 3 cases per family, every case timed
    .venv/bin/python benchmarks/quality.py --cases 60   # more cases

Five task families (benchmarks/tasks.py: single needle, multi-key needle, key-value retrieval,
variable tracking, frequent words), each generated from --seed, nothing downloaded; the cases of a
family alternate between a RAG layout (instruction | document chunks as plus segments | question)
and a multi-turn chat layout (system + first exchange | history turns as plus segments | question
turn). Every case runs under every policy: none, full, CacheBlend at ratio 5/15/30%, SparseQ at
budget 5/15/30% (its default hybrid boundary, ~15% of the layers) and SparseQ 15% with boundary=0
(no hybrid). Greedy, up to --max-tokens tokens, EOS ends a reply.

Cases run in groups of --group. A group's plus segments are pinned (encoded once, standalone)
before any policy runs, so every span policy finds them cached, as a server would for a repeated
document. Then, per policy:
  1. the timed cases (the first --timed of each family) run alone for one token: TTFT
     (metrics["ttft"]), reuse counters, metrics["recompute"]; this publishes the request's KV,
     prompt tail included;
  2. the whole group runs as one continuous batch: the timed cases' prompts now hit the cache
     whole (checked: at most one prompt token computed) so they only decode, and their first token
     must equal run 1's (mismatches are counted); the other cases prefill, recompute and decode here,
     and their reuse / recompute metrics come from this run. (Batched and lone prefill agree: same
     tokens, same recompute selections, logprobs within 1e-5, checked on 20 cases x 3 policies.)
Batching is what fits 200 cases x 9 policies into the time budget of two CPU cores.

Scores per policy: accuracy (the expected number / word appears as a whole word in the reply, see
tasks.is_correct; averaged per family, then over families), agreement with `full` (position-by-
position equality of the generated token ids over the longer of the two replies, EOS included, at
most --max-tokens), recompute fraction (selected / reused from metrics["recompute"]: the share of
reused tokens recomputed above the decision layer; none 0, full 1), layer-weighted compute of the
reused tokens ((D + 1 + (L - D - 1) * fraction) / L: every token is recomputed through the decision
layer D of L), exact match with full, median TTFT of the timed cases.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, median, save_figure, set_threads, write_json  # noqa: E402
from tasks import FAMILIES, LAYOUTS, Case, is_correct, make_case  # noqa: E402

from spanserve.cache.storage import bytes_per_block  # noqa: E402
from spanserve.engine.layout import Segment  # noqa: E402
from spanserve.engine.sampling import SamplingParams  # noqa: E402
from spanserve.llm import LLM  # noqa: E402
from spanserve.model.loader import LoadedModel, load_model  # noqa: E402
from spanserve.reuse.policies import CacheBlend, Policy, SparseQ  # noqa: E402

BLOCK_SIZE = 16
BUDGETS = (0.05, 0.15, 0.30)


@dataclass(frozen=True)
class Variant:
    label: str
    family: str  # none | full | cacheblend | sparseq | sparseq-nohybrid (plot series)
    budget: float | None
    policy: "str | Policy"


def variants() -> list[Variant]:
    # keyword arguments only: a policy's first dataclass field is `name`
    out = [Variant("none", "none", None, "none"), Variant("full", "full", None, "full")]
    out += [Variant(f"CacheBlend {b:.0%}", "cacheblend", b, CacheBlend(ratio=b)) for b in BUDGETS]
    out += [Variant(f"SparseQ {b:.0%}", "sparseq", b, SparseQ(budget=b)) for b in BUDGETS]
    out.append(Variant("SparseQ 15% no-hybrid", "sparseq-nohybrid", 0.15, SparseQ(budget=0.15, boundary=0)))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=40, help="cases per task family (default 40; --quick: 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 3 cases per family")
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--ctx", type=int, default=512, help="context tokens per case (the plus segments together)")
    ap.add_argument("--chunks", type=int, default=2, help="plus segments per case")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--anchor", default="none", choices=["none", "prefix"],
                    help="plus segments encoded alone (none) or after the leading cross segment (prefix)")
    ap.add_argument("--group", type=int, default=50, help="cases run together (their pins held together)")
    ap.add_argument("--timed", type=int, default=2,
                    help="per family, the first N cases also run alone for TTFT (default 2; --quick: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--workers", type=int, default=2, help="worker processes, each with its own engine (default 2)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="weights and KV (default bfloat16, the serving dtype; ~1.5x faster than float32 here)")
    ap.add_argument("--out", default=None, help="file name under benchmarks/results/ (default quality[_quick].json)")
    ap.add_argument("--plot", default=None, help="file name under docs/ (default quality[_quick].png)")
    args = ap.parse_args(argv)
    if args.quick and "--cases" not in (argv if argv is not None else sys.argv[1:]):
        args.cases = 3
    if args.quick and "--timed" not in (argv if argv is not None else sys.argv[1:]):
        args.timed = args.cases
    suffix = "_quick" if args.quick else ""
    args.out = args.out or f"quality{suffix}.json"
    args.plot = args.plot or f"quality{suffix}.png"
    return args


# ---- running -----------------------------------------------------------------------------------
def build_llm(args: argparse.Namespace, model: LoadedModel, max_prompt: int, max_ctx: int) -> LLM:
    per_block = bytes_per_block(model.config, BLOCK_SIZE, getattr(torch, args.dtype))
    blocks = lambda n: -(-n // BLOCK_SIZE) + args.chunks + 1  # noqa: E731 (partial blocks per segment)
    # A group's pinned documents, then its requests' own blocks: run 2 of a policy holds a whole
    # group at once, and the previous policy's blocks wait for LRU eviction.
    pinned = args.group * blocks(max_ctx)
    working = 3 * args.group * blocks(max_prompt + args.max_tokens) // 2
    num_blocks = pinned + working + 256
    llm = LLM(model, device="cpu", dtype=args.dtype, block_size=BLOCK_SIZE, kv_cache_memory=num_blocks * per_block,
              max_num_seqs=max(args.group, 1), max_num_batched_tokens=max(4096, max_prompt + 1),
              pin_fraction=min(0.9, (pinned + 64) / num_blocks))
    print(f"KV pool {num_blocks * per_block / 2**30:.2f} GiB ({num_blocks} blocks of {BLOCK_SIZE}, "
          f"{per_block // BLOCK_SIZE // 1024} KiB/token)", flush=True)
    return llm


def agreement(a: list[int], b: list[int], n: int) -> float:
    a, b = a[:n], b[:n]
    m = max(len(a), len(b))
    return 1.0 if m == 0 else sum(1 for x, y in zip(a, b) if x == y) / m


def run_group(llm: LLM, group: list[Case], tag: str, vs: list[Variant], args: argparse.Namespace,
              records: list[dict[str, Any]], stats: dict[str, Any]) -> None:
    keys = [[f"{tag}/{i}/{j}" for j in range(len(c.chunks))] for i, c in enumerate(group)]
    # Pinning encodes the segments; one pin request counts all its segments against the model's
    # context length (8192 positions) although each is encoded standalone, so pin in batches.
    # (Anchored segments depend on their prefix, which a pin cannot name: they are encoded below
    # by a request with the same prefix and a one-token stand-in question.)
    segs = [] if args.anchor != "none" else [
        Segment(token_ids=ch, kind="plus", key=k) for c, ks in zip(group, keys) for ch, k in zip(c.chunks, ks)]
    batch: list[Segment] = []
    for seg in segs + [None]:  # type: ignore[list-item]
        if batch and (seg is None or sum(len(x.token_ids) for x in batch) + len(seg.token_ids) > 4096):
            llm.pin(batch)
            batch = []
        if seg is not None:
            batch.append(seg)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    many = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    if not segs:  # anchored: encode the segments (under their prefix) with a stand-in question
        llm.generate([c.segments(args.anchor)[:-1] + [Segment(token_ids=c.suffix[:1])] for c in group], one)
    recs = [{"family": c.family, "layout": c.layout, "index": c.index, "answer": c.answer, "timed": c.index < args.timed,
             "prompt_tokens": c.prompt_tokens, "context_tokens": c.context_tokens, "policies": {}} for c in group]
    layouts = [c.segments(args.anchor) for c in group]

    def record(v: Variant, c: Case, rec: dict[str, Any], m: dict[str, Any]) -> dict[str, Any]:
        rc = m.get("recompute") or {}
        if v.family == "none":
            frac: float | None = 0.0
        elif v.family == "full":
            frac = 1.0
        elif rc.get("reused"):
            frac = rc["selected"] / rc["reused"]
        else:
            frac = None
            stats["anomalies"].append(f"{v.label} {c.family}/{c.layout}/{c.index}: no recompute stats (reuse {m['reuse']})")
        if v.family != "full" and m["reuse"]["segment"] != c.context_tokens:
            stats["anomalies"].append(f"{v.label} {c.family}/{c.layout}/{c.index}: segment reuse "
                                      f"{m['reuse']['segment']} != {c.context_tokens} document tokens")
        p = {"ttft": m["ttft"] if rec["timed"] else None, "reuse": m["reuse"], "recompute": rc, "fraction": frac}
        rec["policies"][v.label] = p
        return p

    for v in vs:
        for c, lay, rec in zip(group, layouts, recs):  # 1. the timed cases alone: TTFT, reuse, recompute
            if rec["timed"]:
                out = llm.generate(lay, one, policy=v.policy)[0]
                record(v, c, rec, out.metrics)["first_token"] = out.token_ids[0] if out.token_ids else None
        outs = llm.generate(layouts, many, policy=v.policy)  # 2. all together: the replies
        for c, rec, out in zip(group, recs, outs):
            if rec["timed"]:  # its prompt was cached by run 1: this only decoded
                p = rec["policies"][v.label]
                computed = out.metrics["reuse"]["computed"]
                if computed > 1:
                    stats["rerun_computed"].append(computed)
                if out.token_ids[:1] != [p["first_token"]]:
                    stats["first_token_mismatch"] += 1
            else:
                p = record(v, c, rec, out.metrics)
            p.update(text=out.text, token_ids=list(out.token_ids), correct=is_correct(out.text, c.answer, c.kind))
    for rec in recs:
        ref = rec["policies"]["full"]["token_ids"]
        for p in rec["policies"].values():
            p["agreement"] = agreement(p["token_ids"], ref, args.max_tokens)
    for ks in keys if segs else []:
        llm.unpin(ks)
    records.extend(recs)


# ---- summary -----------------------------------------------------------------------------------
def mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None]
    return float(statistics.fmean(xs)) if xs else math.nan


def summarize(records: list[dict[str, Any]], vs: list[Variant], families: list[str], num_layers: int) -> list[dict]:
    rows = []
    for v in vs:
        ps = [(r, r["policies"][v.label]) for r in records]
        fam_acc = {f: mean([float(p["correct"]) for r, p in ps if r["family"] == f]) for f in families}
        lay_acc = {lay: mean([float(p["correct"]) for r, p in ps if r["layout"] == lay]) for lay in LAYOUTS}
        frac = mean([p["fraction"] for _, p in ps])
        layers = [p["recompute"].get("decision_layer") for _, p in ps if p["recompute"]]
        d = statistics.median(layers) if layers else None
        if v.family == "none":
            compute = 0.0
        elif v.family == "full":
            compute = 1.0
        else:
            compute = mean([(p["recompute"]["decision_layer"] + 1 + (num_layers - p["recompute"]["decision_layer"] - 1)
                             * p["fraction"]) / num_layers for _, p in ps if p["recompute"]])
        rows.append({"label": v.label, "series": v.family, "budget": v.budget, "decision_layer": d,
                     "recompute_fraction": frac, "layer_weighted_compute": compute,
                     "accuracy": mean(list(fam_acc.values())), "accuracy_by_family": fam_acc,
                     "accuracy_by_layout": lay_acc, "agreement": mean([p["agreement"] for _, p in ps]),
                     "exact_match_full": mean([float(p["agreement"] == 1.0) for _, p in ps]),
                     "ttft_median_ms": 1e3 * median([p["ttft"] for _, p in ps if p["ttft"] is not None]),
                     "n": len(ps)})
    full = next(r for r in rows if r["series"] == "full")["accuracy"]
    for r in rows:
        r["accuracy_vs_full"] = r["accuracy"] / full if full else math.nan
    return rows


SHORT = {"single_needle": "needle", "multi_key": "multikey", "kv_retrieval": "kv", "var_tracking": "vartrack",
         "frequent_words": "freqword"}


def ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0f}"


def table(rows: list[dict], families: list[str]) -> str:
    headers = ["policy", "recompute", "layer-wtd", "acc", "acc/full", *[SHORT[f] for f in families],
               "rag", "chat", "agree", "exact", "TTFT ms"]
    body = [[r["label"], r["recompute_fraction"], r["layer_weighted_compute"], r["accuracy"], r["accuracy_vs_full"],
             *[r["accuracy_by_family"][f] for f in families], r["accuracy_by_layout"]["rag"],
             r["accuracy_by_layout"]["chat"], r["agreement"], r["exact_match_full"], ms(r["ttft_median_ms"])]
            for r in rows]
    return format_table(headers, body)


def markdown(rows: list[dict], families: list[str]) -> str:
    head = ["policy", "recomputed", "acc", "acc / full", *[SHORT[f] for f in families], "agree w/ full", "TTFT ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["label"], f"{r['recompute_fraction']:.1%}", f"{r['accuracy']:.3f}", f"{r['accuracy_vs_full']:.1%}",
                 *[f"{r['accuracy_by_family'][f]:.2f}" for f in families], f"{r['agreement']:.3f}",
                 ms(r["ttft_median_ms"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def findings(rows: list[dict]) -> list[str]:
    by = {r["label"]: r for r in rows}
    full, sq, cb, nh, none = (by[k] for k in ("full", "SparseQ 15%", "CacheBlend 15%", "SparseQ 15% no-hybrid", "none"))
    out = [f"SparseQ 15% accuracy {sq['accuracy']:.3f} = {sq['accuracy_vs_full']:.1%} of full ({full['accuracy']:.3f}): "
           f"{'at least' if sq['accuracy_vs_full'] >= 0.97 else 'under'} 97% of full",
           f"SparseQ 15% vs CacheBlend 15%: accuracy {sq['accuracy']:.3f} vs {cb['accuracy']:.3f} "
           f"({'beats' if sq['accuracy'] > cb['accuracy'] else 'ties' if sq['accuracy'] == cb['accuracy'] else 'loses to'}"
           f" it), agreement {sq['agreement']:.3f} vs {cb['agreement']:.3f}, recomputed {sq['recompute_fraction']:.1%} vs "
           f"{cb['recompute_fraction']:.1%} of reused tokens above layers {sq['decision_layer']} vs {cb['decision_layer']}",
           f"hybrid boundary (SparseQ 15% vs boundary=0): accuracy {sq['accuracy']:.3f} vs {nh['accuracy']:.3f}, "
           f"agreement {sq['agreement']:.3f} vs {nh['agreement']:.3f}, layer-weighted compute "
           f"{sq['layer_weighted_compute']:.1%} vs {nh['layer_weighted_compute']:.1%}",
           f"none (pure span semantics): accuracy {none['accuracy']:.3f} ({none['accuracy_vs_full']:.1%} of full), "
           f"agreement {none['agreement']:.3f}"]
    return out


def plot(rows: list[dict], title: str, name: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.3))
    for ax, key, ylabel in ((axes[0], "accuracy", "accuracy (mean over families)"),
                            (axes[1], "agreement", "token agreement with full")):
        for series, style, label in (("cacheblend", "s-", "CacheBlend"), ("sparseq", "o-", "SparseQ (hybrid)")):
            pts = sorted((r["recompute_fraction"], r[key], r["budget"]) for r in rows if r["series"] == series)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
            for x, y, b in pts:
                ax.annotate(f"{b:.0%}", (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7)
        for series, style, label in (("none", "kx", "none"), ("full", "k*", "full"),
                                     ("sparseq-nohybrid", "v", "SparseQ 15% no hybrid")):
            r = next(r for r in rows if r["series"] == series)
            ax.plot([r["recompute_fraction"]], [r[key]], style, markersize=9, label=label)
        ax.set_xscale("symlog", linthresh=0.05)
        ax.set_xticks([0, 0.05, 0.1, 0.2, 0.4, 1.0], ["0", "5%", "10%", "20%", "40%", "100%"])
        ax.set_xlabel("reused tokens recomputed above the decision layer")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.subplots_adjust(bottom=0.24, wspace=0.25)
    path = save_figure(fig, name)
    plt.close(fig)
    return str(path)


def make_cases(args: argparse.Namespace, tok: Any) -> list[Case]:
    encode = lambda s: list(tok.encode(s, add_special_tokens=False))  # noqa: E731
    # Families interleaved, so every group (and a cut-short run) covers all of them.
    return [make_case(f, LAYOUTS[i % len(LAYOUTS)], i, args.seed, encode, args.ctx, args.chunks)
            for i in range(args.cases) for f in args.families]


def run_groups(args: argparse.Namespace, which: list[int], worker: int = 0) -> dict[str, Any]:
    """Runs the groups numbered `which` in this process (one LLM, its own KV pool)."""
    set_threads(args.threads)
    t0, c0 = time.perf_counter(), time.process_time()
    vs = variants()
    model = load_model(args.model, getattr(torch, args.dtype), torch.device("cpu"))
    cases = make_cases(args, model.tokenizer)
    groups = [cases[i:i + args.group] for i in range(0, len(cases), args.group)]
    llm = build_llm(args, model, max(c.prompt_tokens for c in cases), max(c.context_tokens for c in cases))
    del model
    t_load = time.perf_counter() - t0
    records: list[dict[str, Any]] = []
    stats: dict[str, Any] = {"anomalies": [], "rerun_computed": [], "first_token_mismatch": 0}
    todo = sum(len(groups[g]) for g in which)
    for g in which:
        tg = time.perf_counter()
        run_group(llm, groups[g], f"g{g}", vs, args, records, stats)
        done = len(records)
        el = time.perf_counter() - t0
        print(f"[worker {worker}] group {g + 1}/{len(groups)}: {len(groups[g])} cases in {time.perf_counter() - tg:.0f} s;"
              f" {done}/{todo} done, {el:.0f} s elapsed, ~{el / done * (todo - done):.0f} s to go", flush=True)
    return {"records": records, "stats": stats, "num_layers": llm.engine.config.num_layers, "load_s": t_load,
            "cpu_s": time.process_time() - c0}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    vs = variants()
    cases = make_cases(args, load_model(args.model, torch.float32, torch.device("cpu")).tokenizer)
    max_prompt = max(c.prompt_tokens for c in cases)
    n_groups = -(-len(cases) // args.group)
    workers = max(1, min(args.workers, n_groups))
    print(f"{len(cases)} cases ({args.cases} per family x {len(args.families)}), context {args.ctx} tokens in "
          f"{args.chunks} plus segments, prompts {min(c.prompt_tokens for c in cases)}-{max_prompt} tokens; "
          f"{len(vs)} policies; {n_groups} groups over {workers} worker process(es) x {args.threads} torch thread(s)",
          flush=True)
    shares = [list(range(w, n_groups, workers)) for w in range(workers)]
    if workers == 1:
        parts = [run_groups(args, shares[0])]
    else:  # separate processes: the engine's host work is single-threaded Python, so two 1-thread
        # engines keep two cores busier than one engine with two torch threads
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(workers) as pool:
            parts = pool.starmap(run_groups, [(args, share, w) for w, share in enumerate(shares)])
    records = sorted((r for p in parts for r in p["records"]), key=lambda r: (r["index"], args.families.index(r["family"])))
    stats: dict[str, Any] = {"anomalies": [], "rerun_computed": [], "first_token_mismatch": 0}
    for p in parts:
        for k in stats:
            stats[k] += p["stats"][k]
    num_layers = parts[0]["num_layers"]
    t_load = max(p["load_s"] for p in parts)
    wall, cpu = time.perf_counter() - t0, sum(p["cpu_s"] for p in parts)
    rows = summarize(records, vs, args.families, num_layers)
    print()
    print(table(rows, args.families))
    print()
    for line in findings(rows):
        print("* " + line)
    if stats["anomalies"]:
        print(f"! {len(stats['anomalies'])} anomalies, e.g. " + "; ".join(stats["anomalies"][:3]))
    if stats["rerun_computed"] or stats["first_token_mismatch"]:
        print(f"! decode runs: {len(stats['rerun_computed'])} did not hit the whole prompt; "
              f"{stats['first_token_mismatch']} first tokens differ from the run alone")
    print(f"\nwall {wall:.0f} s (model load {t_load:.0f} s), workers' CPU time {cpu:.0f} s, "
          f"{workers} worker(s) x {args.threads} torch thread(s)")
    title = (f"SmolLM2-135M-Instruct, {len(cases)} cases ({args.cases}/family x {len(args.families)} families), "
             f"context {args.ctx} tokens in {args.chunks} plus segments")
    png = plot(rows, title, args.plot)
    config = {k: v for k, v in vars(args).items()}
    path = write_json(args.out, {
        "benchmark": "quality", "model": f"SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to {args.dtype}, CPU)",
        "config": config, "num_layers": num_layers, "wall_s": wall, "cpu_s": cpu, "model_load_s": t_load,
        "summary": rows, "findings": findings(rows), "markdown_table": markdown(rows, args.families),
        "checks": {"anomalies": stats["anomalies"], "decode_runs_not_all_hit": len(stats["rerun_computed"]),
                   "first_token_mismatch": stats["first_token_mismatch"]},
        "cases": records})
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
