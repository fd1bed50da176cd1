"""Recomputation policies: which reused tokens are recomputed with full causal attention.

Every selective policy has the same shape: through a decision layer D every candidate token
(reused or not) is recomputed; at D the policy scores the reused tokens and keeps some; above D
only the kept ones and the non-reused ones are computed, and the others read their cached KV.

`sink_tokens=k` (every selective policy) also keeps the first k tokens of every reused segment
(EPIC's link tokens): a segment encoded alone makes its first token an attention sink, and a
sink left in the middle of the context draws the attention that `full` gives to real content.
The kept sinks count against the policy's budget.

`temperature` and `log_scale` (every policy but `full`) repair parallel encoding inside attention,
recomputing nothing (after APE, arXiv 2502.05431): a key of a reused segment read by a later token
scores s / temperature + log_scale instead of s (`attention.plan.Repair`). Names ending in
`+repair` give a policy the measured values (REPAIR)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch


_REPAIR_FIELDS = ("temperature", "log_scale")


def _check_repair(p: "Policy") -> None:
    t, s = p.temperature, p.log_scale
    if not (isinstance(t, (int, float)) and math.isfinite(t) and 0.05 <= t <= 20):
        raise ValueError(f"temperature must be a number in [0.05, 20] (1 = unchanged), got {t!r}")
    if not (isinstance(s, (int, float)) and math.isfinite(s) and -20 <= s <= 20):
        raise ValueError(f"log_scale must be a number in [-20, 20] (0 = unchanged), got {s!r}")
    if p.name == "full" and p.repairs:
        raise ValueError("the full policy reads everything causally: it has no reused segments to repair; "
                         "drop temperature and log_scale, or use another policy")


@dataclass(frozen=True)
class Policy:
    """`none`: pure span semantics, nothing recomputed. `full`: everything read causally, exactly a
    plain prompt of the same tokens."""

    name: str = "none"
    sink_tokens: int = 0
    temperature: float = 1.0  # of reused segments' scores read by later tokens
    log_scale: float = 0.0  # added to those scores

    def __post_init__(self) -> None:
        _check_repair(self)

    @property
    def selective(self) -> bool:
        return False

    @property
    def repairs(self) -> bool:
        """Whether later tokens read reused segments with changed scores."""
        return self.temperature != 1.0 or self.log_scale != 0.0

    @property
    def key(self) -> str:
        """Enters the request's chain seed: different parameters give different KV. The repair's
        fields appear only when they change something, so unrepaired keys stay as they were."""
        shown = [f for f in fields(self) if f.repr and (self.repairs or f.name not in _REPAIR_FIELDS)]
        return f"{type(self).__name__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"


NONE = Policy("none")
FULL = Policy("full")


@dataclass(frozen=True)
class CacheBlend(Policy):
    """Full recompute through `check_layer`, then the top `ratio` of reused tokens by KV
    deviation (new vs cached, after aligning the cached key's rotation) (CacheBlend, LMCache).
    The check layer defaults to ~15% of the layers (as SparseQ's boundary), not layer 1: at
    layer 1 a chat history's template tokens (`<|im_start|>assistant`, a stock reply) deviate
    least, because their early KV hardly depends on context, so they stay stale while their
    neighbours are recomputed, and the question then copies the stale turn ("Got it.") even at
    95% recompute (docs/quality_notes.md, section 5)."""

    ratio: float = 0.15
    check_layer: int | None = None
    name: str = "cacheblend"

    def __post_init__(self) -> None:
        _check_sinks(self.sink_tokens)
        _check_repair(self)
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"CacheBlend ratio must be in [0, 1], got {self.ratio}")
        if self.check_layer is not None and self.check_layer < 1:
            # Layer 0's K/V depend only on each token's embedding, so new and cached KV are equal
            # there and the deviation ranks nothing but rounding noise.
            raise ValueError(f"CacheBlend check_layer must be >= 1 (layer 0 KV does not depend on "
                             f"context, so it shows no deviation), got {self.check_layer}")

    @property
    def selective(self) -> bool:
        return True

    def decision_layer(self, num_layers: int) -> int:
        c = max(1, hybrid_depth(num_layers)) if self.check_layer is None else self.check_layer
        return min(c, num_layers - 1)

    def select(self, deviation: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """deviation [n_reused]; sinks [n_reused] bool (kept first) -> indices of the kept reused
        tokens, sorted."""
        sinks = torch.zeros_like(deviation, dtype=torch.bool) if sinks is None else sinks
        return top_with_sinks(deviation, sinks, round(self.ratio * deviation.numel()))


@dataclass(frozen=True)
class SparseQ(Policy):
    """SparseX's Sparse-Q: layers below `boundary` recompute everything (the full+sparse hybrid;
    0 disables it, None picks ~15% of the layers); at the boundary the non-reused queries' attention
    (softmax over their causal rows, summed over queries and heads) ranks the reused keys; the
    top-k stay, plus `overflow_blocks` blocks each side of every non-reused interval, plus the last
    `tail` tokens when the prompt ends inside reused text. Sink tokens are on by default: the
    attention of the non-reused queries at the boundary is computed over in-context keys, where a
    segment's first token is no sink, so the score alone never picks the stale sinks that draw the
    question's attention above the boundary (docs/quality_notes.md)."""

    sink_tokens: int = 4
    budget: float | None = 0.15
    k: int | None = None
    boundary: int | None = None
    overflow_blocks: int = 1
    tail: int = 64
    name: str = "sparseq"

    def __post_init__(self) -> None:
        _check_sinks(self.sink_tokens)
        _check_repair(self)
        if self.k is None and (self.budget is None or not 0 <= self.budget <= 1):
            raise ValueError(f"SparseQ needs budget in [0, 1] or k >= 0, got budget={self.budget}")
        if self.k is not None and self.k < 0:
            raise ValueError(f"SparseQ k must be >= 0, got {self.k}")
        if self.boundary is not None and self.boundary < 0:
            raise ValueError(f"boundary must be >= 0 or None, got {self.boundary}")

    @property
    def selective(self) -> bool:
        return True

    def decision_layer(self, num_layers: int) -> int:
        b = hybrid_depth(num_layers) if self.boundary is None else self.boundary
        return min(b, num_layers - 1)

    def select(self, scores: torch.Tensor, reused: torch.Tensor, block_size: int,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """scores [N] per position of the row (attention mass); reused [N] bool; sinks [N] bool
        (reused positions kept first) -> kept reused positions (sorted)."""
        n_reused = int(reused.sum())
        k = self.k if self.k is not None else round(self.budget * n_reused)  # type: ignore[operator]
        sinks = torch.zeros_like(reused) if sinks is None else sinks & reused
        masked = torch.where(reused, scores, torch.full_like(scores, float("-inf")))
        keep = torch.zeros_like(reused)
        keep[top_with_sinks(masked, sinks, min(k, n_reused))] = True
        span = self.overflow_blocks * block_size
        computed = ~reused
        n = reused.numel()
        if span:  # the reused neighbours of every non-reused interval (the boundary cases)
            edges = computed.clone()
            edges[1:] &= ~computed[:-1]  # interval starts
            ends = computed.clone()
            ends[:-1] &= ~computed[1:]  # interval ends
            for s in edges.nonzero().flatten().tolist():
                keep[max(0, s - span):s] = True
            for e in ends.nonzero().flatten().tolist():
                keep[e + 1:min(n, e + 1 + span)] = True
        if bool(reused[-1]) and self.tail:
            keep[max(0, n - self.tail):] = True
        return (keep & reused).nonzero().flatten()


@dataclass(frozen=True)
class Sinks(Policy):
    """Recompute only the first `sink_tokens` tokens of every reused segment (EPIC's LegoLink
    without a score): decided at layer 0, whose KV does not depend on context, so nothing else
    is ever recomputed."""

    sink_tokens: int = 4
    name: str = "sinks"

    def __post_init__(self) -> None:
        _check_sinks(self.sink_tokens)
        _check_repair(self)

    @property
    def selective(self) -> bool:
        return True

    def decision_layer(self, num_layers: int) -> int:
        return 0

    def select(self, sinks: torch.Tensor) -> torch.Tensor:
        """sinks [n_reused] bool -> their indices."""
        return sinks.nonzero().flatten()


def hybrid_depth(num_layers: int) -> int:
    """The layers a selective policy recomputes in full before it decides (~15%): SparseQ's
    default boundary and CacheBlend's default check layer, so their budgets compare at one cost."""
    return round(0.15 * num_layers)


def _check_sinks(k: int) -> None:
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"sink_tokens must be an int >= 0, got {k!r}")


def top_with_sinks(scores: torch.Tensor, sinks: torch.Tensor, total: int) -> torch.Tensor:
    """Indices (sorted) of every sink plus the best-scoring others, `total` in all (more when the
    sinks alone exceed it). Entries scored -inf are never picked as others."""
    others = total - int(sinks.sum())
    pick = sinks.clone()
    if others > 0:
        rest = scores.masked_fill(sinks, float("-inf"))
        n_ok = int(torch.isfinite(rest).sum())
        if n_ok:
            pick[torch.topk(rest, min(others, n_ok)).indices] = True
    return pick.nonzero().flatten()


# The repair's values, the best of a 5 x 4 grid on the quality benchmark's tuning split (SmolLM2-135M,
# float32, H100: `benchmarks/quality.py --split tune --tune`); on the held-out split they do not beat
# sink-anchored segments without them (docs/quality.md), so no default uses them.
REPAIR = {"temperature": 0.8, "log_scale": 0.0}

_BY_NAME = {"none": NONE, "full": FULL, "cacheblend": CacheBlend(), "sparseq": SparseQ(), "sinks": Sinks()}
_BY_NAME.update({f"{n}+repair": replace(p, name=f"{n}+repair", **REPAIR)
                 for n, p in list(_BY_NAME.items()) if n != "full"})
POLICY_NAMES = tuple(_BY_NAME)


def resolve_policy(policy: "str | Policy | None", default: Policy = NONE) -> Policy:
    if policy is None:
        return default
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and policy in _BY_NAME:
        return _BY_NAME[policy]
    raise ValueError(f"unknown recomputation policy {policy!r}; use one of {sorted(_BY_NAME)} or a Policy object")
