"""Attention locality (span-query paper, figure 17, scaled down to SmolLM2): one judge vs. a tree.

    .venv/bin/python benchmarks/experiments/attention_locality.py --quick     # n in {4, 8}, 2 trials
    .venv/bin/python benchmarks/experiments/attention_locality.py             # n in {4, 8, 16}, 5 trials

Each trial hides n distinct names in n filler paragraphs. Inner generation i reads paragraph i
(random filler sentences with "The secret name is <Name>." at a random place) and is asked for the
name. A judge then reads the inner generations as a plus (their whole conversations, from the
cache) and is asked to list every secret name:

    g(cross(system(judge), plus(g(user(paragraph_1 + ask)), ..., g(user(paragraph_n + ask))), user(list)))

Two executions of the same query, on the same LLM, side by side in every trial:

* plain: Executor(..., fan_in=None): one judge attends to all n conversations;
* tree:  Executor(..., fan_in=k): optimize splits the plus into groups of at most k, a judge per
  group lists its names, and the final judge lists the names from the group judges' answers.

each under two recomputation policies (Executor(policy=...)): "none", the engine's pure span
semantics (each plus conversation is read from the cache as encoded on its own; conversations do
not attend to each other), and "full" (the judge's whole prompt is read causally, exactly a plain
prompt of the same tokens; nothing after the system prompt is reused). In our SmolLM2-135M runs,
under "none" the judge mostly answers as if it had read a single conversation.

Accuracy = fraction of the n names found (case-insensitive, whole word) in the final judge's
answer. "extra" counts names of the name pool that the answer gives but that were not hidden in
this trial. "inner" is the fraction of inner generations whose answer contains their own name (an
upper bound of sorts: the judge sees the paragraphs too, so it can do better). "group judges" is
the fraction of names found in the union of a tree's first-level judges' answers: what the final
judge of the tree could at best collect. With n <= k the optimizer leaves the query unchanged, so
the tree run is the plain run (reported once, marked).
All calls are greedy (temperature 0): results depend only on the seed.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # the shared helpers (common)

import torch  # noqa: E402

from spanserve import LLM  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.query import cross, g, optimize, plus, system, user  # noqa: E402
from spanserve.query.execute import EngineRunner, Executor  # noqa: E402

NAMES = ("Alice", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ingrid", "Jamal",
         "Kenji", "Lucia", "Mateo", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Stefan", "Tariq",
         "Ursula", "Viktor", "Wanda", "Yusuf")
FILLER = (
    "The morning market opened late because of the rain.",
    "A small boat drifted slowly past the old harbour wall.",
    "Most of the apples that year were picked before October.",
    "The library on the hill keeps its maps in a locked room.",
    "Traffic on the bridge was lighter than usual on Sunday.",
    "Someone had painted the fence a pale shade of green.",
    "The baker sold out of bread well before noon.",
    "Three students argued about the rules of the chess club.",
    "A cold wind came down from the mountains after dark.",
    "The museum added a new wing for ancient pottery.",
    "Two cats slept on the warm steps of the post office.",
    "The train to the coast stops at every village on the way.",
    "Old letters were found under the floor of the farmhouse.",
    "The choir practised the same song for most of the evening.",
    "Fresh snow covered the path that leads to the lake.",
    "The town council met to discuss the new parking rules.",
)
ASK = "What is the secret name? Answer with the name only."
JUDGE = "You will read several short conversations. Each one reveals a secret name."
PLOT_TITLE = "Names recovered vs. amount of text, {model} (extraction by the final judge)"
LIST = "List every secret name that appears above, separated by commas. Answer with the names only."


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def paragraph(rng: random.Random, name: str, sentences: int) -> str:
    body = rng.sample(FILLER, sentences)
    body.insert(rng.randrange(sentences + 1), f"The secret name is {name}.")
    return " ".join(body)


def build(n: int, trial: int, seed: int, sentences: int, inner_tokens: int, judge_tokens: int):
    rng = random.Random(f"{seed}/{n}/{trial}")
    names = rng.sample(NAMES, n)
    inner = [g(user(f"{paragraph(rng, nm, sentences)}\n\n{ASK}"), max_tokens=inner_tokens, temperature=0.0)
             for nm in names]
    q = g(cross(system(JUDGE), plus(*inner), user(LIST)), max_tokens=judge_tokens, temperature=0.0)
    return names, q


def found(text: str, names: list[str] | tuple[str, ...]) -> list[str]:
    return [nm for nm in names if re.search(rf"\b{re.escape(nm)}\b", text, re.IGNORECASE)]


def run(llm: LLM, q: Any, names: list[str], fan_in: int | None, inner_tokens: int, policy: str) -> dict[str, Any]:
    ex = Executor(EngineRunner(llm.engine), llm.tokenizer, max_tokens=inner_tokens, temperature=0.0, fan_in=fan_in,
                  policy=policy)
    t0 = time.monotonic()
    out = ex.execute(q)
    wall = time.monotonic() - t0
    final = out.outputs[()].text
    # Inner generations are the ones whose prompt holds a paragraph (the judges' prompts hold the
    # paragraphs too, but start with the judge's system prompt).
    inner, group_answers = {}, []
    for path, o in out.outputs.items():
        prompt = llm.tokenizer.decode(o.prompt_token_ids)
        if ASK in prompt and JUDGE not in prompt:
            own = found(prompt, names)
            inner[path] = bool(own) and bool(found(o.text, own))
        elif path != ():
            group_answers.append(o.text)  # a tree's first-level judge
    got = found(final, names)
    groups_got = found("\n".join(group_answers), names)
    extra = [nm for nm in found(final, NAMES) if nm not in names]
    return {"accuracy": len(got) / len(names), "found": got, "extra": extra, "answer": final,
            "inner_accuracy": sum(inner.values()) / max(1, len(inner)), "inner_calls": len(inner),
            "judge_calls": len(out.outputs) - len(inner), "wall_s": wall,
            "group_accuracy": len(groups_got) / len(names) if group_answers else None,
            "group_answers": group_answers,
            "final_prompt_tokens": out.outputs[()].metrics["prompt_tokens"]}


def plot(summary: list[dict[str, Any]], path: Path, title: str, fan_in: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = sorted({s["policy"] for s in summary}, key=["none", "full"].index)
    fig, axes = plt.subplots(1, len(policies), figsize=(5.5 * len(policies), 4), squeeze=False)
    for ax, pol in zip(axes[0], policies):
        rows = [s for s in summary if s["policy"] == pol]
        ns = [s["n"] for s in rows]
        for key, label, style in (("plain", "one judge (fan_in=None)", "o-"),
                                  ("tree", f"tree of judges (fan_in={fan_in})", "s-"),
                                  ("inner", "inner calls (own name)", "^:")):
            ax.plot(ns, [s[f"{key}_mean"] for s in rows], style, label=label)
            if key != "inner":
                ax.fill_between(ns, [s[f"{key}_min"] for s in rows], [s[f"{key}_max"] for s in rows], alpha=0.15)
        grp = [(s["n"], s["tree_group_mean"]) for s in rows if s.get("tree_group_mean") is not None]
        if grp:
            ax.plot([p[0] for p in grp], [p[1] for p in grp], "s--", color="tab:orange", alpha=0.6,
                    label="tree: union of first-level judges")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("inner generations n (names to recover)")
        ax.set_ylabel("fraction of names in the final answer")
        ax.set_title(f"policy={pol}", fontsize=9)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--ns", default="4,8,16", help="comma-separated numbers of inner generations")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--fan-in", type=int, default=4)
    ap.add_argument("--policies", default="none,full", help="recomputation policies to compare")
    ap.add_argument("--sentences", type=int, default=6, help="filler sentences per paragraph")
    ap.add_argument("--inner-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (see nested_gen.py)")
    ap.add_argument("--quick", action="store_true", help="n in {4, 8}, 2 trials")
    ap.add_argument("--json", default=None, help="default benchmarks/results/attention_locality[_quick].json")
    ap.add_argument("--plot", default=None, help="default docs/attention_locality[_quick].png")
    ap.add_argument("--from-json", default=None, help="print the table and plot from a results file; run nothing")
    args = ap.parse_args()
    if args.quick:
        args.ns, args.trials = "4,8", 2
    if max(int(x) for x in args.ns.split(",")) > len(NAMES):
        ap.error(f"n is at most {len(NAMES)} (the name pool)")
    return args


def trial_rows(llm: LLM, n: int, trial: int, policies: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One trial at n: plain and tree under every policy (the order flips every other trial)."""
    names, q = build(n, trial, args.seed, args.sentences, args.inner_tokens, 4 * n + 8)
    same = optimize(q, fan_in=args.fan_in) == optimize(q)
    variants = [(pol, v) for pol in policies for v in ("plain", "tree")]
    if trial % 2:
        variants.reverse()
    res: dict[str, dict[str, Any]] = {pol: {} for pol in policies}
    for pol, variant in variants:
        other = "tree" if variant == "plain" else "plain"
        if same and other in res[pol]:  # n <= fan_in: the optimizer leaves the query alone
            res[pol][variant] = dict(res[pol][other], same_as_plain=True)
            continue
        r = run(llm, q, names, args.fan_in if variant == "tree" else None, args.inner_tokens, pol)
        res[pol][variant] = r
        log(f"n={n} trial={trial} {pol}/{variant}: {r['accuracy']:.2f} ({len(r['found'])}/{n}, extra "
            f"{len(r['extra'])}, inner {r['inner_accuracy']:.2f}, {r['judge_calls']} judge calls, "
            f"{r['wall_s']:.0f}s) answer={r['answer']!r}")
    return [{"n": n, "trial": trial, "policy": pol, "names": names, "same_query": same, **res[pol]} for pol in policies]


def summarize(rows: list[dict[str, Any]], pol: str, n: int) -> dict[str, Any]:
    rs = [r for r in rows if r["n"] == n and r["policy"] == pol]
    s: dict[str, Any] = {"policy": pol, "n": n, "trials": len(rs), "same_query": rs[0]["same_query"],
                         "final_prompt_tokens": rs[0]["plain"]["final_prompt_tokens"]}
    for key in ("plain", "tree"):
        acc = [r[key]["accuracy"] for r in rs]
        s.update({f"{key}_mean": statistics.mean(acc), f"{key}_median": statistics.median(acc),
                  f"{key}_min": min(acc), f"{key}_max": max(acc),
                  f"{key}_extra_mean": statistics.mean(len(r[key]["extra"]) for r in rs),
                  f"{key}_judge_calls": rs[0][key]["judge_calls"]})
    groups = [r["tree"]["group_accuracy"] for r in rs if r["tree"]["group_accuracy"] is not None]
    s["tree_group_mean"] = statistics.mean(groups) if groups else None
    inner = [r["plain"]["inner_accuracy"] for r in rs]
    s.update({"inner_mean": statistics.mean(inner), "inner_min": min(inner), "inner_max": max(inner)})
    return s


def main() -> None:
    args = parse_args()
    suffix = "_quick" if args.quick else ""
    json_path = Path(args.json or ROOT / "benchmarks" / "results" / f"attention_locality{suffix}.json")
    png_path = Path(args.plot or ROOT / "docs" / f"attention_locality{suffix}.png")
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        report(saved["summary"], argparse.Namespace(**saved["args"]))
        plot(saved["summary"], png_path, PLOT_TITLE.format(model=saved["model"]), saved["args"]["fan_in"])
        return
    ns = [int(x) for x in args.ns.split(",")]
    policies = args.policies.split(",")
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    llm = LLM(args.model)
    llm.generate("Warm up.", SamplingParams(max_tokens=2))
    rows = [row for n in ns for trial in range(args.trials) for row in trial_rows(llm, n, trial, policies, args)]
    summary = [summarize(rows, pol, n) for pol in policies for n in ns]
    report(summary, args)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"benchmark": "attention_locality", "model": args.model, "args": vars(args),
                                     "judge_system": JUDGE, "ask": ASK, "list": LIST, "summary": summary,
                                     "runs": rows, "wall_s": time.monotonic() - t0}, indent=1))
    plot(summary, png_path, PLOT_TITLE.format(model=args.model), args.fan_in)
    print(f"\nwrote {json_path} and {png_path}")


def report(summary: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nAttention locality, {args.model} CPU float32: fraction of names in the final judge's answer "
          f"(mean over {args.trials} trials; {args.sentences} filler sentences per paragraph)")
    hdr = (f"{'policy':>6} {'n':>3} {'prompt tok':>10} {'inner acc':>9} {'plain acc':>9} {'plain extra':>11} "
           f"{f'tree(k={args.fan_in}) acc':>15} {'tree extra':>10} {'judges':>6} {'group judges':>12}")
    print(hdr)
    print("-" * len(hdr))
    for s in summary:
        tree = f"{s['tree_mean']:.2f}" + (" (=plain)" if s["same_query"] else "")
        group = "-" if s["tree_group_mean"] is None else f"{s['tree_group_mean']:.2f}"
        print(f"{s['policy']:>6} {s['n']:>3} {s['final_prompt_tokens']:>10} {s['inner_mean']:>9.2f} "
              f"{s['plain_mean']:>9.2f} {s['plain_extra_mean']:>11.1f} {tree:>15} {s['tree_extra_mean']:>10.1f} "
              f"{s['tree_judge_calls']:>6} {group:>12}")


if __name__ == "__main__":
    main()
