"""Reference backend: gather keys through the block table, rotate by delta, SDPA with a mask.

Runs anywhere PyTorch runs; it is the CPU path and the oracle the GPU kernels are tested against."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spanserve.attention.backend import AttentionBackend
from spanserve.attention.kv_cache import read_rows, write_rows
from spanserve.attention.plan import AttentionPlan
from spanserve.rope import Rotary, apply_rotary


@dataclass
class _Group:
    """Rows attended in one SDPA call: queries [B, nq] padded, keys [B, N] padded."""

    q_index: torch.Tensor  # [B, nq] flat token index (padding points at token 0, masked off)
    q_valid: torch.Tensor  # [B, nq] bool
    slots: torch.Tensor  # [B, N]
    mask: torch.Tensor  # [B, nq, N] bool
    cos: torch.Tensor | None  # [B, N, D] rotation of cached keys by their entry's delta
    sin: torch.Tensor | None
    # rows with a Repair: which scores it changes [B, nq, N], and each row's 1 / temperature and
    # log_scale [B] (1 and 0 for rows without one)
    repair: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


@dataclass
class _Prepared:
    write_slots: torch.Tensor
    groups: list[_Group]


class ReferenceBackend(AttentionBackend):
    def prepare(self, plan: AttentionPlan, rotary: Rotary, block_size: int) -> _Prepared:
        # Single-query rows (decodes) share one padded call; each prefill row gets its own so a
        # long chunk never pads a batch of decodes up to its length.
        decodes = [r for r in plan.rows if r.num_queries == 1]
        groups = [self._group([r], plan, rotary) for r in plan.rows if r.num_queries > 1]
        if decodes:
            groups.append(self._group(decodes, plan, rotary))
        return _Prepared(plan.write_slots, groups)

    def _group(self, rows, plan: AttentionPlan, rotary: Rotary) -> _Group:
        dev = plan.positions.device
        B, nq, N = len(rows), max(r.num_queries for r in rows), max(r.num_keys for r in rows)
        q_index = torch.zeros(B, nq, dtype=torch.long, device=dev)
        q_valid = torch.zeros(B, nq, dtype=torch.bool, device=dev)
        slots = torch.zeros(B, N, dtype=torch.long, device=dev)
        mask = torch.zeros(B, nq, N, dtype=torch.bool, device=dev)
        deltas = torch.zeros(B, N, dtype=torch.long, device=dev)
        any_delta = False
        repaired = [b for b, r in enumerate(rows) if r.repair is not None]
        if repaired:
            changed = torch.zeros(B, nq, N, dtype=torch.bool, device=dev)
            inv_t = torch.ones(B, dtype=torch.float32, device=dev)
            log_s = torch.zeros(B, dtype=torch.float32, device=dev)
        for b, r in enumerate(rows):
            if r.repair is not None:
                changed[b, : r.num_queries, : r.num_keys] = r.repair.applies(r.q_pos, r.num_keys)
                inv_t[b], log_s[b] = 1.0 / r.repair.temperature, r.repair.log_scale
            q_index[b, : r.num_queries] = torch.arange(r.q_start, r.q_end, device=dev)
            q_valid[b, : r.num_queries] = True
            slots[b, : r.num_keys] = r.key_slots
            mask[b, : r.num_queries, : r.num_keys] = plan.visible(r)
            if r.key_delta is not None:
                deltas[b, : r.num_keys] = r.key_delta
                any_delta = True
        mask[~q_valid] = False
        mask[~q_valid, 0] = True  # padded queries see one key so softmax stays finite
        cos = sin = None
        if any_delta:
            cos, sin = rotary.cos_sin(deltas.flatten(), torch.float32)
            cos, sin = cos.view(B, N, -1), sin.view(B, N, -1)
        return _Group(q_index, q_valid, slots, mask, cos, sin, (changed, inv_t, log_s) if repaired else None)

    def write(self, prepared: _Prepared, k, v, k_cache, v_cache) -> None:
        write_rows(k_cache, prepared.write_slots, k)
        write_rows(v_cache, prepared.write_slots, v)

    def attend(self, prepared: _Prepared, q, k_cache, v_cache) -> torch.Tensor:
        T, H, D = q.shape
        KVH = k_cache.shape[2]
        g = H // KVH
        out = torch.empty(T, H * D, dtype=q.dtype, device=q.device)
        for grp in prepared.groups:
            B, nq = grp.q_index.shape
            # [B, N, KVH, D]; an 8-bit cache dequantized to the queries' dtype (exact: kv_cache.py)
            keys = read_rows(k_cache, grp.slots.flatten(), q.dtype).view(B, -1, KVH, D)
            if grp.cos is not None:
                rot = apply_rotary(keys.flatten(0, 1).float(), grp.cos.flatten(0, 1), grp.sin.flatten(0, 1))
                keys = rot.view_as(keys).to(keys.dtype)
            vals = read_rows(v_cache, grp.slots.flatten(), q.dtype).view(B, -1, KVH, D)
            # GQA without copying K/V: fold the query heads sharing a KV head into the query axis.
            qs = q[grp.q_index].view(B, nq, KVH, g, D).permute(0, 2, 3, 1, 4).reshape(B, KVH, g * nq, D)
            mask = grp.mask[:, None, None].expand(B, 1, g, nq, -1).reshape(B, 1, g * nq, -1)
            if grp.repair is None:
                o = F.scaled_dot_product_attention(qs, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=mask)
            else:
                o = _repaired(qs, keys.transpose(1, 2), vals.transpose(1, 2), mask, grp.repair, g)
            o = o.view(B, KVH, g, nq, D).permute(0, 3, 1, 2, 4).reshape(B, nq, H * D)
            out[grp.q_index[grp.q_valid]] = o[grp.q_valid]
        return out


def _repaired(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              repair: tuple[torch.Tensor, torch.Tensor, torch.Tensor], g: int) -> torch.Tensor:
    """Attention of q [B, KVH, g*nq, D] over k, v [B, KVH, N, D] with the rows' repair
    (plan.Repair), in float32: what SDPA computes when nothing is changed."""
    B, _, M, D = q.shape
    changed, inv_t, log_s = repair
    changed = changed[:, None, None].expand(B, 1, g, M // g, -1).reshape(B, 1, M, -1)
    s = torch.einsum("bhmd,bhnd->bhmn", q.float(), k.float()) / D ** 0.5
    p = repaired_softmax(s, mask, changed, inv_t[:, None, None, None], log_s[:, None, None, None])
    return torch.einsum("bhmn,bhnd->bhmd", p, v.float()).to(q.dtype)


def repaired_softmax(s: torch.Tensor, visible: torch.Tensor, context: torch.Tensor, inv_t: "torch.Tensor | float",
                     log_s: "torch.Tensor | float") -> torch.Tensor:
    """The attention weights [..., N] of scores s [..., N] (q.k / sqrt(D)) over the visible keys,
    the `context` ones (plus-segment keys read after their segment) read as one group (APE): their
    weights within the group are softmax(s / T), and the group weighs as one key of logit
    T * logsumexp(s / T) + log_scale beside the others (inv_t = 1 / T). With T = 1 this is
    softmax(s + log_scale on the context keys). A query always sees its own key, which is never
    context, so the others are never empty."""
    ninf = torch.tensor(float("-inf"), dtype=s.dtype, device=s.device)
    ctx = context & visible
    sc = torch.where(ctx, s * inv_t, ninf)
    lse = torch.logsumexp(sc, -1, keepdim=True)  # -inf where a query sees no context key
    group = torch.where(torch.isfinite(lse), lse / inv_t + log_s, ninf)
    so = torch.where(visible & ~ctx, s, ninf)
    z = torch.logsumexp(torch.cat([so, group], -1), -1, keepdim=True)
    return torch.where(ctx, torch.exp(group + sc - lse - z), torch.exp(so - z))
