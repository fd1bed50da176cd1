"""Answer quality of the recomputation policies on synthetic long-context tasks (RULER / SparseX style),
SmolLM2-135M-Instruct on CPU.

    .venv/bin/python benchmarks/quality.py              # 16 cases per family (80 cases), 4 x 256-token segments
    .venv/bin/python benchmarks/quality.py --quick      # 2 cases per family, 4 x 128-token segments
    .venv/bin/python benchmarks/quality.py --cases 40 --ctx 2048   # more and longer (4 x 512)
    .venv/bin/python benchmarks/quality.py --split tune --tune      # the repair's grid on the tuning split
    .venv/bin/python benchmarks/quality.py --split held-out --frontier T S   # the frontier, held out

The repair (temperature T, log scale S: reuse/policies.py) is tuned on one split and reported on the
other: --split tune draws every case from seed 1000 + --seed, --split held-out from 2000 + --seed
(tasks.make_case generates a case from its family, layout, index and seed, so the splits share no
case). --tune runs none, full, sink-anchored none and the repair at every (T, S) of --temperatures x
--log-scales; --frontier every method at 0, 5, 15, 30 and 50% recompute with and without the
repair (common/quality_variants.py), plotted as accuracy against recompute share. Both default to
every task family (retrieval, multi-document reasoning, many-shot in-context learning).

Five task families (benchmarks/common/tasks.py: single needle, multi-key needle, key-value retrieval,
variable tracking, frequent words), each generated from --seed, nothing downloaded; the cases of a
family alternate between a RAG layout (instruction | document chunks as plus segments | question)
and a multi-turn chat layout (system + first exchange | history turns as plus segments | question
turn). Without --tune or --frontier every case runs under the standard variants
(common/quality_variants.standard): none, full, the sinks-only policy,
CacheBlend and SparseQ at ~15% with and without sink tokens (CacheBlend also at its former check
layer 1), SparseQ at ~5% with sinks, and segments anchored on the model's sink prefix (BOS + chat
template opening) under none, CacheBlend and SparseQ; --sweep adds 30% and 50% budgets.
--device cuda runs one engine on the GPU (Triton backend).
Greedy, up to --max-tokens tokens, EOS ends a reply.

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
Batching is what fits 80 cases x 10 variants into the time budget of two CPU cores.

Scores per policy: accuracy (the expected number / word appears as a whole word in the reply, see
tasks.is_correct; averaged per family, then over families; 95% intervals by bootstrap over the
cases of each family, and paired against none), agreement with `full` (position-by-
position equality of the generated token ids over the longer of the two replies, EOS included, at
most --max-tokens), recompute fraction (selected / reused from metrics["recompute"]: the share of
reused tokens recomputed above the decision layer, sink tokens included; none 0, full 1), layer-weighted compute of the
reused tokens ((D + 1 + (L - D - 1) * fraction) / L: every token is recomputed through the decision
layer D of L), exact match with full, median TTFT of the timed cases.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import set_threads, write_json  # noqa: E402
from common.quality_stats import findings, frontier_plot, markdown, plot, summarize, table  # noqa: E402
from common.quality_variants import Variant, frontier, standard, tuning  # noqa: E402
from common.tasks import ALL_FAMILIES, FAMILIES, LAYOUTS, Case, is_correct, make_case  # noqa: E402

from spanserve.engine.layout import Segment  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.llm import LLM  # noqa: E402
from spanserve.model.loader import LoadedModel, load_model  # noqa: E402
from spanserve.reuse.policies import Policy  # noqa: E402
from spanserve.attention.kv_cache import cache_dtype  # noqa: E402
from spanserve.worker.storage import bytes_per_block  # noqa: E402

BLOCK_SIZE = 16
SPLIT_SEEDS = {"tune": 1000, "held-out": 2000}  # case seeds: the two splits share no case


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=16, help="cases per task family (default 16; --quick: 2)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 cases per family, 4 x 128-token segments")
    ap.add_argument("--families", nargs="+", default=None, choices=ALL_FAMILIES,
                    help="default: the five retrieval families; with --tune or --frontier all of them")
    ap.add_argument("--ctx", type=int, default=1024, help="context tokens per case (the plus segments together)")
    ap.add_argument("--chunks", type=int, default=4, help="plus segments per case")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--group", type=int, default=20, help="cases run together (their pins held together)")
    ap.add_argument("--timed", type=int, default=2,
                    help="per family, the first N cases also run alone for TTFT (default 2; --quick: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--workers", type=int, default=2, help="worker processes, each with its own engine (default 2)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (one worker; the Triton backend)")
    ap.add_argument("--sweep", action="store_true", help="also CacheBlend and SparseQ at 30%% and 50%% recompute")
    ap.add_argument("--split", choices=sorted(SPLIT_SEEDS), default=None,
                    help="draw the cases of the tuning or the held-out split (case seed 1000 or 2000 plus --seed)")
    ap.add_argument("--tune", action="store_true",
                    help="the repair's grid (--temperatures x --log-scales) instead of the standard policies")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.8, 0.9, 1.0, 1.1, 1.25])
    ap.add_argument("--log-scales", type=float, nargs="+", default=[-1.0, -0.5, 0.0, 0.5])
    ap.add_argument("--frontier", type=float, nargs=2, metavar=("T", "S"), default=None,
                    help="every method at 0/5/15/30/50%% recompute, each also repaired with temperature T, log scale S")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="weights and KV (default bfloat16, the serving dtype; ~1.5x faster than float32 here)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="the KV pool's dtype")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="linear weights in FP8")
    ap.add_argument("--variants", nargs="+", default=None, metavar="LABEL",
                    help="run only these variants of the standard set (labels as printed, e.g. none full)")
    ap.add_argument("--out", default=None, help="file name under benchmarks/results/ (default quality[_quick].json)")
    ap.add_argument("--plot", default=None, help="file name under docs/ (default: --out's name, .png)")
    args = ap.parse_args(argv)
    given = argv if argv is not None else sys.argv[1:]
    if args.quick and "--cases" not in given:
        args.cases = 2
    if args.quick and "--ctx" not in given:
        args.ctx = 512
    if args.quick and "--timed" not in (argv if argv is not None else sys.argv[1:]):
        args.timed = args.cases
    if args.split is not None:
        args.seed += SPLIT_SEEDS[args.split]
    if args.families is None:
        args.families = list(ALL_FAMILIES if args.tune or args.frontier is not None else FAMILIES)
    suffix = "_quick" if args.quick else ""
    args.out = args.out or f"quality{suffix}.json"
    # named after the JSON: a run with its own --out keeps the other runs' figures
    args.plot = args.plot or f"{Path(args.out).stem}.png"
    return args


# ---- running -----------------------------------------------------------------------------------
def build_llm(args: argparse.Namespace, model: LoadedModel, max_prompt: int, max_ctx: int) -> LLM:
    per_block = bytes_per_block(model.config, BLOCK_SIZE, cache_dtype(args.kv_cache_dtype, getattr(torch, args.dtype)))
    blocks = lambda n: -(-n // BLOCK_SIZE) + args.chunks + 1  # noqa: E731 (partial blocks per segment)
    # A group's pinned documents, then its requests' own blocks: run 2 of a policy holds a whole
    # group at once, and the previous policy's blocks wait for LRU eviction. A sink-anchored
    # variant also keeps its unpinned segment copies cached while the group's selective runs
    # write every segment again into private blocks.
    pinned = args.group * blocks(max_ctx)
    working = 3 * args.group * blocks(max_prompt + args.max_tokens)
    num_blocks = pinned + working + 256
    llm = LLM(model, device=args.device, dtype=args.dtype, block_size=BLOCK_SIZE, kv_cache_memory=num_blocks * per_block,
              max_num_seqs=max(args.group, 1), max_num_batched_tokens=max(4096, max_prompt + 1),
              pin_fraction=min(0.9, (pinned + 64) / num_blocks), kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization)
    print(f"KV pool {num_blocks * per_block / 2**30:.2f} GiB ({num_blocks} blocks of {BLOCK_SIZE}, "
          f"{per_block // BLOCK_SIZE // 1024} KiB/token)", flush=True)
    return llm


def agreement(a: list[int], b: list[int], n: int) -> float:
    a, b = a[:n], b[:n]
    m = max(len(a), len(b))
    return 1.0 if m == 0 else sum(1 for x, y in zip(a, b) if x == y) / m


def pin_group(llm: LLM, group: list[Case], keys: list[list[str]]) -> None:
    """Pinning encodes the segments; one pin request counts all its segments against the model's
    context length (8192 positions) although each is encoded standalone, so pin in batches."""
    segs = [Segment(token_ids=ch, kind="plus", key=k) for c, ks in zip(group, keys) for ch, k in zip(c.chunks, ks)]
    batch: list[Segment] = []
    for seg in segs + [None]:  # type: ignore[list-item]
        if batch and (seg is None or sum(len(x.token_ids) for x in batch) + len(seg.token_ids) > 4096):
            llm.pin(batch)
            batch = []
        if seg is not None:
            batch.append(seg)


def record(v: Variant, c: Case, rec: dict[str, Any], m: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    """One case's metrics under one variant, into its record; anomalies noted in stats."""
    rc = m.get("recompute") or {}
    if v.series == "none":
        frac: float | None = 0.0
    elif v.series == "full":
        frac = 1.0
    elif rc.get("reused"):
        frac = rc["selected"] / rc["reused"]
    else:
        frac = None
        stats["anomalies"].append(f"{v.label} {c.family}/{c.layout}/{c.index}: no recompute stats (reuse {m['reuse']})")
    if v.series != "full" and m["reuse"]["segment"] != c.context_tokens:
        stats["anomalies"].append(f"{v.label} {c.family}/{c.layout}/{c.index}: segment reuse "
                                  f"{m['reuse']['segment']} != {c.context_tokens} document tokens")
    p = {"ttft": m["ttft"] if rec["timed"] else None, "reuse": m["reuse"], "recompute": rc, "fraction": frac}
    rec["policies"][v.label] = p
    return p


def run_variant(llm: LLM, v: Variant, group: list[Case], recs: list[dict[str, Any]], args: argparse.Namespace,
                stats: dict[str, Any]) -> None:
    one = SamplingParams(max_tokens=1, temperature=0.0)
    layouts = [c.segments(v.anchor) for c in group]
    if v.anchor == "sink":
        # Sink-anchored segments depend on the sink prefix only, which a pin cannot name: a
        # request of the sink prefix, the segments and a one-token stand-in question encodes
        # them, right before the variant runs (unpinned blocks earlier would be LRU-evicted by
        # the variants in between).
        sink = list(llm.engine.sink_prefix)
        llm.generate([[Segment(token_ids=sink)] + lay[1:-1] + [Segment(token_ids=c.suffix[:1])]
                      for c, lay in zip(group, layouts)], one)
    for c, lay, rec in zip(group, layouts, recs):  # 1. the timed cases alone: TTFT, reuse, recompute
        if rec["timed"]:
            out = llm.generate(lay, one, policy=v.policy)[0]
            record(v, c, rec, out.metrics, stats)["first_token"] = out.token_ids[0] if out.token_ids else None
    outs = llm.generate(layouts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), policy=v.policy)
    for c, rec, out in zip(group, recs, outs):  # 2. all together: the replies
        if rec["timed"]:  # its prompt was cached by run 1: this only decoded
            p = rec["policies"][v.label]
            computed = out.metrics["reuse"]["computed"]
            if computed > 1:
                stats["rerun_computed"].append(computed)
            if out.token_ids[:1] != [p["first_token"]]:
                stats["first_token_mismatch"] += 1
        else:
            p = record(v, c, rec, out.metrics, stats)
        p.update(text=out.text, token_ids=list(out.token_ids), correct=is_correct(out.text, c.answer, c.kind))


def run_group(llm: LLM, group: list[Case], tag: str, vs: list[Variant], args: argparse.Namespace,
              records: list[dict[str, Any]], stats: dict[str, Any]) -> None:
    keys = [[f"{tag}/{i}/{j}" for j in range(len(c.chunks))] for i, c in enumerate(group)]
    pin_group(llm, group, keys)
    recs = [{"family": c.family, "layout": c.layout, "index": c.index, "answer": c.answer, "timed": c.index < args.timed,
             "prompt_tokens": c.prompt_tokens, "context_tokens": c.context_tokens, "policies": {}} for c in group]
    for v in vs:
        run_variant(llm, v, group, recs, args, stats)
    for rec in recs:
        ref = rec["policies"]["full"]["token_ids"]
        for p in rec["policies"].values():
            p["agreement"] = agreement(p["token_ids"], ref, args.max_tokens)
    for ks in keys:
        llm.unpin(ks)
    records.extend(recs)


def make_cases(args: argparse.Namespace, tok: Any) -> list[Case]:
    encode = lambda s: list(tok.encode(s, add_special_tokens=False))  # noqa: E731
    # Families interleaved, so every group (and a cut-short run) covers all of them.
    return [make_case(f, LAYOUTS[i % len(LAYOUTS)], i, args.seed, encode, args.ctx, args.chunks)
            for i in range(args.cases) for f in args.families]


def run_groups(args: argparse.Namespace, which: list[int], worker: int = 0) -> dict[str, Any]:
    """Runs the groups numbered `which` in this process (one LLM, its own KV pool)."""
    set_threads(args.threads)
    t0, c0 = time.perf_counter(), time.process_time()
    vs = chosen_variants(args)
    model = load_model(args.model, getattr(torch, args.dtype), torch.device(args.device))
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


def chosen_variants(args: argparse.Namespace) -> list[Variant]:
    if args.tune:
        return tuning(args.temperatures, args.log_scales)
    if args.frontier is not None:
        return frontier(*args.frontier)
    vs = standard(args.sweep)
    if args.variants:
        unknown = set(args.variants) - {v.label for v in vs}
        if unknown:
            raise SystemExit(f"unknown variants {sorted(unknown)}; the standard ones: {[v.label for v in vs]}")
        vs = [v for v in vs if v.label in args.variants]
    return vs


def best_repair(rows: list[dict[str, Any]], vs: list[Variant]) -> dict[str, Any] | None:
    """The tuned values: the repaired variant of highest accuracy (then agreement with full)."""
    by = {v.label: v for v in vs if v.repaired}
    cands = [r for r in rows if r["label"] in by]
    if not cands:
        return None
    r = max(cands, key=lambda r: (r["accuracy"], r["agreement"]))
    pol = by[r["label"]].policy
    assert isinstance(pol, Policy)
    return {"label": r["label"], "temperature": pol.temperature, "log_scale": pol.log_scale, "accuracy": r["accuracy"],
            "accuracy_ci95": r["accuracy_ci95"], "accuracy_vs_full": r["accuracy_vs_full"]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    vs = chosen_variants(args)
    cases = make_cases(args, load_model(args.model, torch.float32, torch.device("cpu")).tokenizer)
    max_prompt = max(c.prompt_tokens for c in cases)
    n_groups = -(-len(cases) // args.group)
    workers = 1 if args.device != "cpu" else max(1, min(args.workers, n_groups))
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
    rows = summarize(records, vs, args.families, LAYOUTS, num_layers)
    print()
    print(table(rows, args.families, LAYOUTS))
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
    png = frontier_plot(rows, vs, title, args.plot) if args.frontier is not None else plot(rows, title, args.plot)
    tuned = best_repair(rows, vs) if args.tune else None
    if tuned is not None:
        print(f"* best repair on this split: {tuned['label']} (T={tuned['temperature']:g}, S={tuned['log_scale']:+g}), "
              f"accuracy {tuned['accuracy']:.3f} = {tuned['accuracy_vs_full']:.1%} of full")
    config = {k: v for k, v in vars(args).items()}
    config["model"] = Path(str(args.model)).name  # a file's name, not where it sat on the machine
    path = write_json(args.out, {
        "benchmark": "quality", "model": f"SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to {args.dtype}, {args.device})",
        "config": config, "num_layers": num_layers, "wall_s": wall, "cpu_s": cpu, "model_load_s": t_load,
        "split": args.split, "case_seed": args.seed, "tuned": tuned,
        "summary": rows, "findings": findings(rows), "markdown_table": markdown(rows, args.families),
        "checks": {"anomalies": stats["anomalies"], "decode_runs_not_all_hit": len(stats["rerun_computed"]),
                   "first_token_mismatch": stats["first_token_mismatch"]},
        "cases": records})
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
