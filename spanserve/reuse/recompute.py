"""Selective recomputation inside one forward pass: per-layer active sets, the policy's decision
at its layer, and the fill of skipped tokens' private slots from the shared cached copy."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from spanserve.attention.kv_cache import read_rows, write_rows
from spanserve.attention.plan import Repair
from spanserve.attention.reference import repaired_softmax
from spanserve.rope import Rotary, apply_rotary
from spanserve.reuse.policies import CacheBlend, Policy, Sinks, SparseQ


@dataclass
class RecomputeSpec:
    """Attached by the cache manager to a main task whose reused tokens a policy may recompute.
    Their recomputed KV is written to the request's private slots; `src_slots` hold the shared
    position-free copy, read rotated by `src_delta`."""

    policy: Policy
    reused: list[int]  # logical positions of the reused tokens
    src_slots: list[int]
    src_delta: list[int]
    offsets: list[int] = field(default_factory=list)  # each reused token's place in its segment


@dataclass
class RecomputeRow:
    """One selective chunk in this step's flat batch."""

    spec: RecomputeSpec
    flat: torch.Tensor  # [n] flat indices of the chunk's tokens
    is_reused: torch.Tensor  # [n] bool
    key_slots: torch.Tensor  # the row's keys, positions [0, N)
    key_delta: torch.Tensor | None
    q_pos: torch.Tensor  # [n] row positions of the chunk's tokens
    decision_layer: int
    offsets: torch.Tensor | None = None  # [n_reused] place of each of the chunk's reused tokens in its segment
    selected: torch.Tensor | None = None  # indices into the reused tokens, once decided
    stats: dict = field(default_factory=dict)
    repair: Repair | None = None  # the row's: SparseQ scores keys by the attention the queries pay


class Recompute:
    """LayerHooks for the selective rows of one step."""

    def __init__(self, rows: list[RecomputeRow], num_tokens: int, rotary: Rotary, block_size: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """`reduce`: sums per-token scores over the ranks of a tensor-parallel model (each
        rank scores with its own heads); every rank then makes the same decision."""
        self.rows = rows
        self.reduce = reduce or (lambda x: x)
        self.T = num_tokens
        self.rotary = rotary
        self.block_size = block_size
        self._active: torch.Tensor | None = None
        self._decided = 0
        dev = rows[0].flat.device
        self._src = [torch.tensor(r.spec.src_slots, dtype=torch.long, device=dev) for r in rows]
        self._delta = [torch.tensor(r.spec.src_delta, dtype=torch.long, device=dev) for r in rows]

    def active(self, layer: int) -> torch.Tensor | None:
        return self._active

    def _shrink(self) -> None:
        keep = torch.ones(self.T, dtype=torch.bool, device=self.rows[0].flat.device)
        for r in self.rows:
            if r.selected is not None:
                reused_flat = r.flat[r.is_reused]
                drop = torch.ones(reused_flat.numel(), dtype=torch.bool, device=keep.device)
                drop[r.selected] = False
                keep[reused_flat[drop]] = False
        self._active = keep.nonzero().flatten()

    def _cached(self, i: int, which: torch.Tensor, k_cache, v_cache, dtype: torch.dtype):
        """The shared copy of reused tokens `which` (indices into row i's reused tokens), with K
        turned to the tokens' logical positions."""
        src = self._src[i][which]
        k = read_rows(k_cache, src, dtype)
        cos, sin = self.rotary.cos_sin(self._delta[i][which], torch.float32)
        return apply_rotary(k.float(), cos, sin).to(k.dtype), read_rows(v_cache, src, dtype)

    def after_write(self, layer, q, k, v, idx, k_cache, v_cache) -> None:
        for i, r in enumerate(self.rows):
            n_reused = int(r.is_reused.sum())
            if r.selected is not None and layer > r.decision_layer:
                skip = torch.ones(n_reused, dtype=torch.bool, device=q.device)
                skip[r.selected] = False
                which = skip.nonzero().flatten()
                if which.numel():
                    # K, turned to its logical position, is stored anew (an 8-bit cache quantizes
                    # it again, as in a cold request so in a warm one); V's values come back as they were
                    kk, vv = self._cached(i, which, k_cache, v_cache, k.dtype)
                    dst = self._private(r, which, k_cache)
                    write_rows(k_cache, dst, kk)
                    write_rows(v_cache, dst, vv)
            elif layer == r.decision_layer:
                local = r.flat if idx is None else torch.searchsorted(idx, r.flat)
                r.selected = self._decide(i, r, q[local], k[local], v[local], k_cache, v_cache)
                r.stats = {"reused": n_reused, "selected": int(r.selected.numel()), "decision_layer": layer}
                self._shrink()

    def _private(self, r: RecomputeRow, which: torch.Tensor, k_cache) -> torch.Tensor:
        """Private slots of reused tokens: where their KV sits in the request's own row."""
        pos = r.q_pos[r.is_reused][which]
        return r.key_slots[pos]

    def _decide(self, i, r: RecomputeRow, q, k, v, k_cache, v_cache) -> torch.Tensor:
        pol = r.spec.policy
        n_reused = int(r.is_reused.sum())
        if r.offsets is None or not pol.sink_tokens:
            sinks = torch.zeros(n_reused, dtype=torch.bool, device=q.device)
        else:
            sinks = r.offsets < pol.sink_tokens
        if isinstance(pol, Sinks):
            return pol.select(sinks)
        if isinstance(pol, CacheBlend):
            all_reused = torch.arange(int(r.is_reused.sum()), device=q.device)
            k_old, v_old = self._cached(i, all_reused, k_cache, v_cache, k.dtype)
            dk = (k[r.is_reused].float() - k_old.float()).pow(2).sum((1, 2))
            dv = (v[r.is_reused].float() - v_old.float()).pow(2).sum((1, 2))
            return pol.select(self.reduce(dk + dv), sinks)
        if isinstance(pol, SparseQ):
            scores = self.reduce(attention_mass(q[~r.is_reused], r.q_pos[~r.is_reused], k_cache, r.key_slots,
                                                r.key_delta, self.rotary, r.repair))
            reused_mask = torch.zeros(r.key_slots.numel(), dtype=torch.bool, device=q.device)
            reused_mask[r.q_pos[r.is_reused]] = True
            sink_mask = torch.zeros_like(reused_mask)
            sink_mask[r.q_pos[r.is_reused][sinks]] = True
            kept_pos = pol.select(scores, reused_mask, self.block_size, sink_mask)
            # positions -> indices among this chunk's reused tokens (both ascending)
            return torch.searchsorted(r.q_pos[r.is_reused], kept_pos)
        raise TypeError(f"no selective recomputation for policy {pol!r}")


def attention_mass(q, q_pos, k_cache, key_slots, key_delta, rotary: Rotary, repair: Repair | None = None) -> torch.Tensor:
    """Softmax attention of queries q [nq, H, D] at q_pos over the row's keys (causal, scores
    repaired as the row's attention repairs them), summed over queries and heads: how much the
    non-reused tokens read each key [N]."""
    KVH, D = k_cache.shape[2:]
    H = q.shape[1]
    keys = read_rows(k_cache, key_slots, torch.float32)
    if key_delta is not None:
        cos, sin = rotary.cos_sin(key_delta, torch.float32)
        keys = apply_rotary(keys, cos, sin)
    keys = keys.repeat_interleave(H // KVH, dim=1)  # [N, H, D]
    s = torch.einsum("qhd,khd->hqk", q.float(), keys) / D ** 0.5
    causal = torch.arange(keys.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    if repair is not None:
        context = repair.applies(q_pos, keys.shape[0])[None]
        return repaired_softmax(s, causal[None], context, 1.0 / repair.temperature, repair.log_scale).sum((0, 1))
    p = s.masked_fill(~causal[None], float("-inf")).softmax(-1)
    return p.sum((0, 1))
