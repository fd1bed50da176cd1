"""Steps as CUDA graphs: at batch 1 an 8B model's decode step is ~500 kernel launches of a few
microseconds each, so launching them from Python costs more than running them; a short prefill
step (a judge's question over its cached candidates) is the same. A step whose rows are all plain
decodes is sent, in one host-to-device copy, into fixed-address buffers (the backend's static
layout) and replays the graph captured for its batch size (`DecodeGraphs`); any other short step
without recomputation does the same with buffers and graphs per padded shape (`StepGraphs`);
anything else runs eagerly. Which one a step takes: `attention/paths.py`."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from spanserve.attention.decode import DecodeRows
from spanserve.attention.host_plan import HostPlan
from spanserve.attention.plan import AttentionPlan
from spanserve.model.llama import LlamaModel


@dataclass
class _Buffers:
    static: Any  # the backend's StaticDecode for this batch size
    plan: AttentionPlan  # the model's view of it (positions, write slots); remade when it moves


def batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes decode graphs are captured for; a step pads its rows up to the next one.
    Powers of two to 16, then every 16 to 64, then every 32: a decode step's time is its weight
    reads, so a few padding rows cost little, and each size is one capture."""
    sizes = [s for s in (1, 2, 4, 8, 16) if s < max_batch]
    step = 16
    while not sizes or sizes[-1] < max_batch:
        nxt = (sizes[-1] if sizes else 0) + step
        sizes.append(min(nxt, max_batch))
        if nxt >= 64:
            step = 32
    return sizes


def padded(rows: DecodeRows, size: int, scratch_slot: int) -> DecodeRows:
    """`rows` and size - len(rows) padding rows: token 0 at position 0, its one key at the
    storage's scratch slot (nothing reads what they compute)."""
    n = size - len(rows)
    if n <= 0:
        return rows
    slot = np.array([scratch_slot], dtype=np.int64)
    return DecodeRows(rows.ids + [0] * n, rows.pos + [0] * n, rows.slots + [slot] * n, rows.deltas + [None] * n,
                      None if rows.repairs is None else rows.repairs + [None] * n)


class DecodeGraphs:
    """`capture=False` runs the same fixed-buffer forward without a graph (CPU tests of the
    buffer path; a debugging aid on GPUs). With `scratch_slot` (the KV storage's), a step's rows
    are padded up to one of `batch_sizes(max_batch)`; without, each batch size has its graphs."""

    def __init__(self, model: LlamaModel, backend: Any, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 max_batch: int = 64, capture: bool = True, scratch_slot: int | None = None):
        self.model, self.backend = model, backend
        self.k_caches, self.v_caches = k_caches, v_caches
        self.max_batch = max_batch
        self.scratch_slot = scratch_slot
        self.sizes = batch_sizes(max_batch)
        self.capture = capture
        self.block_n: int = backend.decode_cfg.block_n  # keys per tile of the decode launch
        self.buffers: dict[int, _Buffers] = {}
        self.graphs: dict[tuple[int, bool, int, bool], tuple[Any, torch.Tensor]] = {}
        self.pool = GraphPool() if capture else None
        self.replays = 0  # steps served by a graph (or the fixed-buffer path)
        self.capacity = 1 << 14  # initial keys per batch size's buffers (they grow by doubling)

    def run(self, rows: DecodeRows, feed: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Hidden states [B', hidden] of a decode-only step of B = 1..max_batch rows (the runner's
        `attention.paths.step_path` sends only those here); rows past B are padding. `feed` fills
        the first B input ids on the device after the host arrays land (a step chained on the
        previous one's picks)."""
        real = len(rows)
        if self.scratch_slot is not None:
            rows = padded(rows, next(s for s in self.sizes if s >= real), self.scratch_slot)
        B = len(rows)
        buf = self.buffers.get(B)
        if buf is None:
            static = self.backend.static_decode(B, self.model.rotary.inv_freq, self.model.device, self.capacity,
                                                kv_heads=self.model.config.num_kv_heads)
            buf = self.buffers[B] = _Buffers(static, self._plan(static))
        lay, moved = buf.static.load(rows, self.block_n)
        if moved:  # captured graphs of this batch size read the old buffers
            buf.plan = self._plan(buf.static)
            for key in [k for k in self.graphs if k[0] == B]:
                del self.graphs[key]
        if feed is not None:
            feed(buf.static.ids[:real])
        self.replays += 1
        if not self.capture:
            out = self._forward(buf, buf.plan, lay)
        else:
            key = (B, lay.has_delta, lay.fixed[0].split, lay.key_end is not None)
            if key not in self.graphs:
                self.graphs[key] = self._capture(buf, buf.plan, lay)
            graph, out = self.graphs[key]
            graph.replay()
        buf.static.fence()
        return out

    @staticmethod
    def _plan(static: Any) -> AttentionPlan:
        return AttentionPlan(rows=[], positions=static.positions, write_slots=static.write_slots)

    def _forward(self, buf: _Buffers, plan: AttentionPlan, static: Any) -> torch.Tensor:
        return self.model.forward(buf.static.ids, plan, self.backend, self.k_caches, self.v_caches, prepared=static)

    def _capture(self, buf: _Buffers, plan: AttentionPlan, static: Any) -> tuple[Any, torch.Tensor]:
        return capture(lambda: self._forward(buf, plan, static), self.pool)


class GraphPool:
    """A memory pool shared by all the engine's graphs (they never run concurrently). It holds a
    one-kernel graph of its own: when every real graph of the pool has been dropped (buffers that
    moved, least recently used ones) while a tensor it made is still alive, the pool's use count
    would reach zero and torch's allocator refuses the next capture into it (an internal assert,
    seen on torch 2.11)."""

    def __init__(self) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self._keeper = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._keeper, pool=self.handle):
            self._cell = torch.zeros(1, device="cuda")


def capture(forward: Callable[[], torch.Tensor], pool: GraphPool) -> tuple[Any, torch.Tensor]:
    """(graph, its output tensor) of `forward`, which runs once eagerly first."""
    # Warm up on a side stream (kernel compilation, allocator) as CUDA graph capture requires;
    # the warm-up computes exactly this step, so the KV it writes is what the replay writes.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool.handle):
        out = forward()
    return graph, out


class StepGraphs:
    """Short general steps (up to `max_tokens` tokens, no recomputation) through the backend's
    fixed-address step layouts: one graph per padded shape, at most `max_graphs` of them (least
    recently used dropped). `capture=False` runs the fixed-buffer forward without a graph."""

    def __init__(self, model: LlamaModel, backend: Any, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 pool: GraphPool | None, max_tokens: int = 256, max_graphs: int = 32, capture: bool = True):
        c = model.config
        self.model, self.backend = model, backend
        self.k_caches, self.v_caches = k_caches, v_caches
        self.static = backend.static_steps(c.num_heads // c.num_kv_heads, c.num_kv_heads, model.rotary.inv_freq,
                                           model.device)
        self.pool, self.max_tokens, self.max_graphs, self.capture = pool, max_tokens, max_graphs, capture
        self.graphs: dict[Any, tuple[Any, torch.Tensor]] = {}  # insertion order = least recent first
        self.replays = 0
        self.captured: deque[Any] = deque(maxlen=64)  # the latest captures' shapes (a log for benchmarks)

    def run(self, hp: HostPlan) -> torch.Tensor:
        """Hidden states [padded T, hidden] (rows past the step's T are padding) of a step of up to
        `max_tokens` tokens, nothing recomputed (the runner's `attention.paths.step_path` sends only
        those here)."""
        shape, lay, dev, moved = self.static.load(hp)
        if moved:  # graphs of this bucket read the old buffers
            for key in [k for k in self.graphs if k.buffers == shape.buffers]:
                del self.graphs[key]
        plan = AttentionPlan(rows=[], positions=dev["positions"], write_slots=dev["write_slots"])

        def forward() -> torch.Tensor:
            return self.model.forward(dev["ids"], plan, self.backend, self.k_caches, self.v_caches, prepared=lay)

        self.replays += 1
        if not self.capture:
            out = forward()
        else:
            entry = self.graphs.pop(shape, None)
            if entry is None:
                if len(self.graphs) >= self.max_graphs:
                    del self.graphs[next(iter(self.graphs))]
                entry = capture(forward, self.pool)
                self.captured.append((shape, moved))
            entry[0].replay()
            self.graphs[shape] = entry
            out = entry[1]
        self.static.fence()
        return out
