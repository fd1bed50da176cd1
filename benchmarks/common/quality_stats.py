"""Summaries of the quality benchmark's records: accuracy per family with bootstrap 95% intervals,
paired differences against `none` and `full`, agreement with full, recompute fraction, TTFT;
the table, the markdown table and the plot."""
from __future__ import annotations

import math
import random
import statistics
from typing import Any

from common import format_table, median, save_figure

_SHORT = {"single_needle": "needle", "multi_key": "multikey", "kv_retrieval": "kv", "var_tracking": "vartrack",
          "frequent_words": "freqword"}


class _Short(dict):
    def __missing__(self, key: str) -> str:
        return key


SHORT = _Short(_SHORT)
BOOT = 2000


def mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None]
    return float(statistics.fmean(xs)) if xs else math.nan


def family_mean(correct: dict[tuple[str, int], float], keys: list[tuple[str, int]], families: list[str]) -> float:
    """Mean over families of each family's mean over its cases (keys: (family, case) pairs)."""
    by: dict[str, list[float]] = {}
    for k in keys:
        by.setdefault(k[0], []).append(correct[k])
    return mean([mean(by[f]) for f in families if f in by])


def bootstrap(values: dict[str, dict[tuple[str, int], float]], families: list[str], seed: int = 0
              ) -> dict[str, list[list[float]]]:
    """values: label -> {(family, case): score}. Resamples cases within each family (the same draw
    for every label, so differences are paired); label -> draws of the family-mean score."""
    rng = random.Random(seed)
    keys = sorted(next(iter(values.values())))
    by_fam = {f: [k for k in keys if k[0] == f] for f in families}
    draws: dict[str, list[float]] = {lab: [] for lab in values}
    fam_draws: dict[str, dict[str, list[float]]] = {lab: {f: [] for f in families} for lab in values}
    for _ in range(BOOT):
        pick = {f: [rng.choice(ks) for _ in ks] for f, ks in by_fam.items() if ks}
        for lab, vals in values.items():
            fams = {f: mean([vals[k] for k in ks]) for f, ks in pick.items()}
            draws[lab].append(mean(list(fams.values())))
            for f, x in fams.items():
                fam_draws[lab][f].append(x)
    return {"overall": draws, "family": fam_draws}  # type: ignore[return-value]


def interval(xs: list[float]) -> tuple[float, float]:
    s = sorted(xs)
    return s[int(0.025 * (len(s) - 1))], s[int(0.975 * (len(s) - 1))]


def summarize(records: list[dict[str, Any]], vs: list[Any], families: list[str], layouts: tuple[str, ...],
              num_layers: int) -> list[dict]:
    correct = {v.label: {(r["family"], r["index"]): float(r["policies"][v.label]["correct"]) for r in records} for v in vs}
    boot = bootstrap(correct, families)
    none_draws, full_draws = boot["overall"]["none"], boot["overall"]["full"]
    rows = []
    for v in vs:
        ps = [(r, r["policies"][v.label]) for r in records]
        keys = list(correct[v.label])
        acc = family_mean(correct[v.label], keys, families)
        fam_acc = {f: mean([float(p["correct"]) for r, p in ps if r["family"] == f]) for f in families}
        fam_ci = {f: interval(boot["family"][v.label][f]) for f in families if boot["family"][v.label][f]}
        lay_acc = {lay: mean([float(p["correct"]) for r, p in ps if r["layout"] == lay]) for lay in layouts}
        diff_none = [a - b for a, b in zip(boot["overall"][v.label], none_draws)]
        ratio_full = [a / b for a, b in zip(boot["overall"][v.label], full_draws) if b]
        frac = mean([p["fraction"] for _, p in ps])
        layers = [p["recompute"].get("decision_layer") for _, p in ps if p["recompute"]]
        d = statistics.median(layers) if layers else None
        if v.series == "none" or v.policy == "none":
            compute = 0.0
        elif v.series == "full":
            compute = 1.0
        else:
            compute = mean([(p["recompute"]["decision_layer"] + 1 + (num_layers - p["recompute"]["decision_layer"] - 1)
                             * p["fraction"]) / num_layers for _, p in ps if p["recompute"] and p["fraction"] is not None])
        rows.append({"label": v.label, "series": v.series, "anchor": v.anchor, "budget": v.budget, "decision_layer": d,
                     "recompute_fraction": frac, "layer_weighted_compute": compute,
                     "accuracy": acc, "accuracy_ci95": interval(boot["overall"][v.label]),
                     "accuracy_by_family": fam_acc, "accuracy_by_family_ci95": fam_ci, "accuracy_by_layout": lay_acc,
                     "diff_vs_none": acc - family_mean(correct["none"], keys, families),
                     "diff_vs_none_ci95": interval(diff_none),
                     "vs_full_ci95": interval(ratio_full) if ratio_full else (math.nan, math.nan),
                     "agreement": mean([p["agreement"] for _, p in ps]),
                     "exact_match_full": mean([float(p["agreement"] == 1.0) for _, p in ps]),
                     "ttft_median_ms": 1e3 * median([p["ttft"] for _, p in ps if p["ttft"] is not None]),
                     "n": len(ps)})
    full = next(r for r in rows if r["series"] == "full")["accuracy"]
    for r in rows:
        r["accuracy_vs_full"] = r["accuracy"] / full if full else math.nan
    return rows


def ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0f}"


def ci(c: tuple[float, float]) -> str:
    return f"[{c[0]:.2f}, {c[1]:.2f}]"


def table(rows: list[dict], families: list[str], layouts: tuple[str, ...]) -> str:
    headers = ["policy", "recompute", "layer-wtd", "acc", "95% CI", "acc/full", "vs none 95% CI",
               *[SHORT[f] for f in families], *layouts, "agree", "exact", "TTFT ms"]
    body = [[r["label"], r["recompute_fraction"], r["layer_weighted_compute"], r["accuracy"], ci(r["accuracy_ci95"]),
             r["accuracy_vs_full"], ci(r["diff_vs_none_ci95"]), *[r["accuracy_by_family"][f] for f in families],
             *[r["accuracy_by_layout"][lay] for lay in layouts], r["agreement"], r["exact_match_full"],
             ms(r["ttft_median_ms"])] for r in rows]
    return format_table(headers, body)


def markdown(rows: list[dict], families: list[str]) -> str:
    head = ["policy", "recomputed", "acc [95% CI]", "acc / full", "vs none [95% CI]", *[SHORT[f] for f in families],
            "agree w/ full", "TTFT ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lo, hi = r["diff_vs_none_ci95"]
        cells = [r["label"], f"{r['recompute_fraction']:.1%}", f"{r['accuracy']:.3f} {ci(r['accuracy_ci95'])}",
                 f"{r['accuracy_vs_full']:.1%}", f"{r['diff_vs_none']:+.3f} [{lo:+.2f}, {hi:+.2f}]",
                 *[f"{r['accuracy_by_family'][f]:.2f}" for f in families], f"{r['agreement']:.3f}",
                 ms(r["ttft_median_ms"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def findings(rows: list[dict], cap: float = 0.15) -> list[str]:
    full = next(r for r in rows if r["series"] == "full")
    none = next(r for r in rows if r["label"] == "none")
    cands = [r for r in rows if r["series"] not in ("full",) and r["label"] != "none"
             and r["recompute_fraction"] <= cap + 1e-9]
    out = [f"none: accuracy {none['accuracy']:.3f} ({none['accuracy_vs_full']:.1%} of full {full['accuracy']:.3f}), "
           f"agreement {none['agreement']:.3f}"]
    if cands:
        best = max(cands, key=lambda r: (r["accuracy"], r["agreement"]))
        lo, hi = best["diff_vs_none_ci95"]
        out.append(f"best at <= {cap:.0%} recompute (sinks counted): {best['label']} ({best['recompute_fraction']:.1%}) "
                   f"accuracy {best['accuracy']:.3f} = {best['accuracy_vs_full']:.1%} of full "
                   f"({'meets' if best['accuracy_vs_full'] >= 0.97 else 'misses'} 97%); vs none {best['diff_vs_none']:+.3f} "
                   f"[{lo:+.3f}, {hi:+.3f}] ({'separated' if lo > 0 else 'not separated'} by the 95% interval)")
    pairs = [(a, b) for a in rows for b in rows if a["series"] == "sparseq" and b["series"] == "cacheblend"
             and a["anchor"] == b["anchor"] and a["budget"] == b["budget"] and a["label"].endswith(b["label"].split()[-1])]
    for a, b in pairs:
        out.append(f"{a['label']} vs {b['label']}: accuracy {a['accuracy']:.3f} vs {b['accuracy']:.3f}, agreement "
                   f"{a['agreement']:.3f} vs {b['agreement']:.3f}, recomputed {a['recompute_fraction']:.1%} vs "
                   f"{b['recompute_fraction']:.1%}")
    return out


def plot(rows: list[dict], title: str, name: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    markers = {"none": "x", "full": "*", "sinks": "D", "cacheblend": "s", "sparseq": "o"}
    for ax, key, ylabel in ((axes[0], "accuracy", "accuracy (mean over families, 95% CI)"),
                            (axes[1], "agreement", "token agreement with full (first 32)")):
        for r in rows:
            x = r["recompute_fraction"]
            filled = r["anchor"] == "sink"
            kw = dict(marker=markers.get(r["series"], "o"), markersize=8, linestyle="none",
                      markerfacecolor=None if filled else "none", label=r["label"])
            if key == "accuracy":
                lo, hi = r["accuracy_ci95"]
                ax.errorbar([x], [r[key]], yerr=[[r[key] - lo], [hi - r[key]]], capsize=3, **kw)
            else:
                ax.plot([x], [r[key]], **kw)
        ax.axvline(0.15, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("symlog", linthresh=0.05)
        ax.set_xticks([0, 0.05, 0.1, 0.15, 0.3, 0.5, 1.0], ["0", "5%", "10%", "15%", "30%", "50%", "100%"])
        ax.set_xlabel("reused tokens recomputed (sink tokens counted)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7, frameon=False)
    fig.suptitle(title + "\n(filled markers: segments anchored on the sink prefix)", fontsize=9)
    fig.subplots_adjust(bottom=0.3, wspace=0.25)
    path = save_figure(fig, name)
    plt.close(fig)
    return str(path)


def frontier_plot(rows: list[dict], vs: list[Any], title: str, name: str) -> str:
    """Accuracy against recompute share: one line per method (solid: with the repair, dashed:
    without), 95% intervals, full and plain none as horizontal references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    repaired = {v.label: v.repaired for v in vs}
    colors = {"none": "tab:grey", "sinks": "tab:purple", "cacheblend": "tab:blue", "sparseq": "tab:orange"}
    fig, ax = plt.subplots(figsize=(8, 5))
    refs = {r["label"]: r for r in rows if r["label"] in ("none", "full")}
    for lab, style in (("full", "-"), ("none", ":")):
        if lab in refs:
            ax.axhline(refs[lab]["accuracy"], color="black", linestyle=style, linewidth=1, label=f"{lab} (plain)")
    for series, color in colors.items():
        for rep in (False, True):
            pts = sorted((r for r in rows if r["series"] == series and repaired.get(r["label"]) == rep
                          and r["label"] != "none"), key=lambda r: r["recompute_fraction"])
            if not pts:
                continue
            x = [r["recompute_fraction"] for r in pts]
            y = [r["accuracy"] for r in pts]
            err = [[r["accuracy"] - r["accuracy_ci95"][0] for r in pts], [r["accuracy_ci95"][1] - r["accuracy"] for r in pts]]
            ax.errorbar(x, y, yerr=err, color=color, linestyle="-" if rep else "--", marker="o" if rep else "s",
                        markerfacecolor=color if rep else "none", capsize=3,
                        label=f"{series}{' + repair' if rep else ''}")
    ax.set_xscale("symlog", linthresh=0.05)
    ax.set_xticks([0, 0.05, 0.15, 0.3, 0.5, 1.0], ["0", "5%", "15%", "30%", "50%", "100%"])
    ax.set_xlabel("reused tokens recomputed (sink tokens counted)")
    ax.set_ylabel("accuracy (mean over families, 95% CI)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title, fontsize=9)
    path = save_figure(fig, name)
    plt.close(fig)
    return str(path)
