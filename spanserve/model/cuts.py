"""One device computing exactly as N tensor-parallel ranks do: `LLM(..., emulate_tp=N)`.

A bf16 model sharded over N GPUs computes the same function as on one, but rounds differently:
each rank rounds its partial o/down products before the all-reduce adds them, where one GPU rounds
the whole dot product once, and cuBLAS picks its kernels (and with them the order of a dot
product's additions) by shape. Greedy decoding parts at the first near-tie, which a random-weight
model meets every few tokens. Here every projection runs in the ranks' pieces with the ranks'
shapes (column-parallel ones per cut, their outputs put back in the whole model's layout;
row-parallel ones per cut on that cut's columns), and the partial products are added in rank order
in float32 and rounded once: what NCCL's all-reduce of two ranks and the peer-memory sums
(`distributed/peer_sum.py`) give. The attention backend splits its launches as a rank with
KV heads / N heads would (`AttentionBackend.for_shards`). The logits then equal TP=N's bit for bit
(for N = 2 through NCCL; for more ranks wherever the peer-memory sums carry them, since a ring
all-reduce adds in an order of its own). It is the reference TP=N is checked against, at some
cost in speed: more, smaller kernels and the copies that reassemble Q, K and V.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from spanserve.model import fp8
from spanserve.model.config import ModelConfig
from spanserve.model.fp8 import Fp8Weight, Weight
from spanserve.model.shard import ShardPlan, check_divisible, shard_dim


@dataclass(frozen=True)
class Cuts:
    """The whole model's shapes cut over `n` ranks (`plans[r]`: rank r's slices)."""

    config: ModelConfig
    n: int

    def __post_init__(self) -> None:
        check_divisible(self.config, self.n)
        if self.config.num_kv_heads % self.n:
            raise ValueError(f"emulate_tp={self.n} needs the KV heads ({self.config.num_kv_heads}) split "
                             "evenly over the ranks; replicated KV heads are not emulated")

    @cached_property
    def plans(self) -> list[ShardPlan]:
        return [ShardPlan(self.config, r, self.n) for r in range(self.n)]

    def pieces(self, get: Callable[[str], torch.Tensor], names: list[str]) -> list[torch.Tensor]:
        """Per rank: its slices of the named whole tensors, stacked along the outputs (each whole
        tensor fetched once: on the CPU fetching copies it)."""
        whole = {n: get(n) for n in names}
        return [torch.cat([p.slice(whole[n], n) for n in names]).contiguous() for p in self.plans]

    def fp8_pieces(self, get: Callable[[str], Weight], names: list[str]) -> list[Fp8Weight]:
        """`pieces` of FP8 projections: a dense tensor's slices quantized after slicing, as a rank
        quantizes the shard it loaded; an FP8 checkpoint's sliced as a rank loads them (a
        row-parallel slice keeps its rows' scales)."""
        whole = {n: get(n) for n in names}

        def cut(plan: ShardPlan, w: Weight, name: str) -> Fp8Weight:
            if not isinstance(w, Fp8Weight):
                return fp8.quantize_weight(plan.slice(w, name).contiguous())
            rows = plan.rows(name, w.shape[shard_dim(name) or 0])
            return w if rows is None else w.narrow(rows[0], rows[1], rows[2] - rows[1])

        return [fp8.cat([cut(p, whole[n], n) for n in names]) for p in self.plans]

    def qkv(self, x: torch.Tensor, weights: list[Weight], biases: list[torch.Tensor | None],
            linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
        """The fused q/k/v projection, each rank's [q_r, k_r, v_r] computed alone, returned in the
        whole model's [q, k, v] column layout."""
        c = self.config
        hq, hk = c.num_heads // self.n * c.head_dim, c.num_kv_heads // self.n * c.head_dim
        outs = [linear(x, w, b) for w, b in zip(weights, biases)]
        return torch.cat([o[:, :hq] for o in outs] + [o[:, hq:hq + hk] for o in outs]
                         + [o[:, hq + hk:] for o in outs], dim=1)

    def heads(self, attn: torch.Tensor) -> list[torch.Tensor]:
        """Attention output [T, H * D] as each rank holds it: its heads' columns, contiguous."""
        return [part.contiguous() for part in attn.chunk(self.n, dim=1)]

    @staticmethod
    def row_sum(xs: list[torch.Tensor], weights: list[Weight],
                linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
        """Sum over ranks of x_r @ w_r.T: each partial rounded to the working dtype (as a rank's
        GEMM rounds it), then added in rank order in float32 and rounded once."""
        parts = [linear(x, w) for x, w in zip(xs, weights)]
        acc = parts[0].float()
        for p in parts[1:]:
            acc = acc + p.float()
        return acc.to(parts[0].dtype)
