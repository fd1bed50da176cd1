"""The policies the quality benchmark compares (`benchmarks/quality.py`): the standard set, the
repair's tuning grid, and the frontier (accuracy against recompute share, each method with and
without the repair)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from spanserve.reuse.policies import CacheBlend, Policy, Sinks, SparseQ

SINK = 4  # sink tokens recomputed per reused segment
FRONTIER_BUDGETS = (0.05, 0.15, 0.30, 0.50)


@dataclass(frozen=True)
class Variant:
    label: str
    series: str  # none | full | sinks | cacheblend | sparseq (plot marker)
    budget: float | None
    policy: "str | Policy"
    anchor: str = "none"  # the plus segments' anchor: none, or sink (BOS + chat template opening)
    repaired: bool = False  # the policy reads reused segments with a temperature and log scale


def standard(sweep: bool = False) -> list[Variant]:
    # keyword arguments only: a policy's first dataclass field is `name`. SparseQ's budgets leave
    # room for its overflow blocks (one block each side of the question and the instruction),
    # so that what it recomputes in all stays near the CacheBlend budget beside it.
    out = [Variant("none", "none", None, "none"), Variant("full", "full", None, "full"),
           Variant(f"sinks {SINK}", "sinks", 0.0, Sinks(sink_tokens=SINK)),
           Variant("CacheBlend 15%", "cacheblend", 0.15, CacheBlend(ratio=0.15)),
           Variant("CacheBlend 15% (check layer 1)", "cacheblend", 0.15, CacheBlend(ratio=0.15, check_layer=1)),
           Variant("SparseQ 15%", "sparseq", 0.15, SparseQ(budget=0.12, sink_tokens=0)),
           Variant(f"CacheBlend 15% +sink{SINK}", "cacheblend", 0.15, CacheBlend(ratio=0.15, sink_tokens=SINK)),
           Variant(f"SparseQ 15% +sink{SINK}", "sparseq", 0.15, SparseQ(budget=0.12, sink_tokens=SINK)),
           Variant(f"SparseQ 5% +sink{SINK}", "sparseq", 0.05, SparseQ(budget=0.02, sink_tokens=SINK)),
           Variant("none, anchor sink", "none", None, "none", "sink"),
           Variant(f"SparseQ 15% +sink{SINK}, anchor sink", "sparseq", 0.15, SparseQ(budget=0.12, sink_tokens=SINK), "sink"),
           Variant("CacheBlend 15%, anchor sink", "cacheblend", 0.15, CacheBlend(ratio=0.15), "sink")]
    if sweep:  # larger budgets: where on the accuracy / recompute curve each selection reaches full
        for pct in (30, 50):
            out += [Variant(f"CacheBlend {pct}%", "cacheblend", pct / 100, CacheBlend(ratio=pct / 100)),
                    Variant(f"SparseQ {pct}% +sink{SINK}", "sparseq", pct / 100,
                            SparseQ(budget=pct / 100 - 0.03, sink_tokens=SINK)),
                    Variant(f"SparseQ {pct}% +sink{SINK}, anchor sink", "sparseq", pct / 100,
                            SparseQ(budget=pct / 100 - 0.03, sink_tokens=SINK), "sink")]
    return out


def _repair(v: Variant, temperature: float, log_scale: float) -> Variant:
    pol = v.policy if isinstance(v.policy, Policy) else Policy(v.policy)
    return replace(v, label=f"{v.label} + repair", policy=replace(pol, temperature=temperature, log_scale=log_scale),
                   repaired=True)


def tuning(temperatures: list[float], log_scales: list[float]) -> list[Variant]:
    """The baselines and the repair's grid, all on sink-anchored segments (APE's shared prefix)
    but the plain `none`."""
    base = Variant("none, anchor sink", "none", None, "none", "sink")
    out = [Variant("none", "none", None, "none"), Variant("full", "full", None, "full"), base]
    for t in temperatures:
        for s in log_scales:
            if (t, s) != (1.0, 0.0):
                out.append(replace(_repair(base, t, s), label=f"repair T={t:g} S={s:+g}"))
    return out


def frontier(temperature: float, log_scale: float) -> list[Variant]:
    """Every method at 0, 5, 15, 30 and 50% recompute, on sink-anchored segments, each also with
    the repair (T, S); plain `none` (unanchored segments, the default) with and without it, and
    `full`, for reference."""
    sink = "sink"
    base = [Variant("none, anchor sink", "none", None, "none", sink),
            Variant(f"sinks {SINK}, anchor sink", "sinks", 0.0, Sinks(sink_tokens=SINK), sink)]
    for b in FRONTIER_BUDGETS:
        pct = round(100 * b)
        base += [Variant(f"CacheBlend {pct}%, anchor sink", "cacheblend", b, CacheBlend(ratio=b), sink),
                 Variant(f"SparseQ {pct}% +sink{SINK}, anchor sink", "sparseq", b,
                         SparseQ(budget=max(0.0, b - 0.03), sink_tokens=SINK), sink)]
    plain = Variant("none", "none", None, "none")
    out = [plain, _repair(plain, temperature, log_scale), Variant("full", "full", None, "full")]
    for v in base:
        out += [v, _repair(v, temperature, log_scale)]
    return out
