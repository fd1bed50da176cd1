"""Decode steps as CUDA graphs: at batch 1 an 8B model's decode step is ~500 kernel launches of a
few microseconds each, so launching them from Python costs more than running them. A step whose
rows are all plain decodes is copied into fixed-address buffers (the backend's static layout) and
replays the graph captured for its batch size; anything else runs eagerly."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spanserve.attention.plan import AttentionPlan
from spanserve.model.llama import LlamaModel


@dataclass
class _Buffers:
    static: Any  # the backend's StaticDecode for this batch size
    ids: torch.Tensor
    positions: torch.Tensor


class DecodeGraphs:
    """`capture=False` runs the same fixed-buffer forward without a graph (CPU tests of the
    buffer path; a debugging aid on GPUs)."""

    def __init__(self, model: LlamaModel, backend: Any, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 max_batch: int = 64, capture: bool = True):
        self.model, self.backend = model, backend
        self.k_caches, self.v_caches = k_caches, v_caches
        self.max_batch = max_batch
        self.capture = capture
        self.buffers: dict[int, _Buffers] = {}
        self.graphs: dict[tuple[int, bool], tuple[Any, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps served by a graph (or the fixed-buffer path)
        self.capacity = 1 << 14  # initial keys per batch size's buffers (they grow by doubling)

    def run(self, ids: torch.Tensor, plan: AttentionPlan) -> torch.Tensor | None:
        """Hidden states of a decode-only step, or None when the step is not one (run it eagerly)."""
        B = ids.numel()
        c = self.model.config
        if B == 0 or B > self.max_batch:
            return None
        block_size = self.k_caches[0].shape[1]
        lay = self.backend.prepare(plan, self.model.rotary, block_size)
        small, big = self.backend.launches(lay, c.num_heads // c.num_kv_heads)
        if not type(self.backend).static_eligible(lay, small, big):
            return None
        buf = self.buffers.get(B)
        if buf is None:
            dev = ids.device
            buf = _Buffers(self.backend.static_decode(B, self.model.rotary.inv_freq, dev, self.capacity),
                           torch.zeros(B, dtype=torch.long, device=dev), torch.zeros(B, dtype=torch.long, device=dev))
            self.buffers[B] = buf
        static, moved = buf.static.load(lay, small)
        if moved:  # captured graphs of this batch size read the old buffers
            for key in [k for k in self.graphs if k[0] == B]:
                del self.graphs[key]
        buf.ids.copy_(ids, non_blocking=True)
        buf.positions.copy_(plan.positions, non_blocking=True)
        fixed_plan = AttentionPlan(rows=[], positions=buf.positions, write_slots=static.write_slots)
        self.replays += 1
        if not self.capture:
            return self._forward(buf, fixed_plan, static)
        key = (B, small.fused_delta)
        if key not in self.graphs:
            self.graphs[key] = self._capture(buf, fixed_plan, static)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _forward(self, buf: _Buffers, plan: AttentionPlan, static: Any) -> torch.Tensor:
        return self.model.forward(buf.ids, plan, self.backend, self.k_caches, self.v_caches, prepared=static)

    def _capture(self, buf: _Buffers, plan: AttentionPlan, static: Any) -> tuple[Any, torch.Tensor]:
        # Warm up on a side stream (kernel compilation, allocator) as CUDA graph capture requires;
        # the warm-up computes exactly this step, so the KV it writes is what the replay writes.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(buf, plan, static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(buf, plan, static)
        return graph, out
