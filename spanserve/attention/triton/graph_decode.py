"""Decode graphs: fixed-address buffers of decode-only steps, one set per batch size, so a decode
step is captured once as a CUDA graph and replayed (`engine/cuda_graphs.DecodeGraphs`).

A graph replays kernel launches with the pointers and grid sizes seen at capture. Per step only the
*contents* of the layout change (ids, slots, positions, tile ranges), so each batch size gets one
device staging buffer whose views are the fixed-address tensors the graph reads; the grid is one
program per decode row (times the split ways), which a batch size fixes. A step packs its contents
on the host (`decode_launch`) into a pinned buffer laid out like the staging buffer and sends them
in one non-blocking copy: no per-row device tensors, no device-to-device copies. Capacity for keys
and tiles grows by doubling; a growth moves the buffers, and the caller must capture again (`load`
says so).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spanserve.attention.decode import DecodeRows
from spanserve.attention.triton.decode_launch import HostArrays, spans_of, write_step
from spanserve.attention.triton.graph_buffers import carve, grown, pack_offsets
from spanserve.attention.triton.launch import NUM_FIELDS, Launch, StepLayout, empty_launch
from spanserve.attention.triton.split import SplitPolicy, decode_split


class Regions:
    """Byte offsets of the packed step input; the device staging buffer and the host buffers that
    fill it share this layout. Fixed-size fields first, then the tiles, then the key slots, so a
    step copies one prefix (whole tile arrays, only the keys in use)."""

    def __init__(self, batch: int, key_cap: int, tile_cap: int, max_ways: int = 1):
        self.batch, self.key_cap, self.tile_cap = batch, key_cap, tile_cap
        B, T, i64, i32 = batch, tile_cap, torch.int64, torch.int32
        self.offsets = pack_offsets([
            ("ids", i64, (B,)), ("positions", i64, (B,)), ("write_slots", i64, (B,)),
            ("q_pos", i32, (B,)), ("zeros", i32, (B,)), ("desc", i32, (B * max_ways, NUM_FIELDS)),
            ("tile_start", i32, (T,)), ("tile_end", i32, (T,)), ("tile_delta", i32, (T,)),
            ("key_slots", i32, (key_cap,)), ("key_end", i32, (key_cap,))])
        self.keys_offset = self.offsets["key_slots"][0]
        self.ends_offset = self.offsets["key_end"][0]  # copied apart, by steps with repaired rows only
        self.nbytes = self.ends_offset + 4 * key_cap

    def used_bytes(self, n_keys: int) -> int:
        return self.keys_offset + 4 * n_keys


@dataclass
class Packed:
    """Typed views of one packed buffer (uint8 [nbytes]): the tensors a graph reads, or on the
    host the arrays a step writes (`numpy()` of a CPU buffer)."""

    buf: torch.Tensor
    ids: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    q_pos: torch.Tensor
    zeros: torch.Tensor  # anchor and seg of every row: decode rows are causal
    desc: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor
    tile_delta: torch.Tensor
    key_slots: torch.Tensor
    key_end: torch.Tensor  # repaired rows' key ends (plan.Repair.key_ends), beside key_slots

    @classmethod
    def carve(cls, buf: torch.Tensor, regions: Regions) -> "Packed":
        return cls(buf=buf, **carve(buf, regions.offsets))

    @classmethod
    def allocate(cls, regions: Regions, device: torch.device, pin: bool = False) -> "Packed":
        return cls.carve(torch.zeros(regions.nbytes, dtype=torch.uint8, device=device, pin_memory=pin), regions)


class StaticDecode:
    """`split`: the backend's policy for sharing a row's tiles among several programs when the
    batch has too few rows to fill the GPU (rounded down for decodes, `decode_split`); the ways
    follow the batch size and the longest row's tile count rounded down to a power of two, so a
    graph is captured again only when that doubles."""

    def __init__(self, batch: int, inv_freq: torch.Tensor, device: torch.device, capacity: int = 1 << 14,
                 split: SplitPolicy | None = None):
        self.batch = batch
        self.device = torch.device(device)
        self.inv_freq = inv_freq
        self.split = split = decode_split(split)
        self.max_ways = 1 if split is None else split.ways(batch, None)
        # The combine pass's launch-local token -> flat token map: a decode step's rows in order.
        self._tokens = torch.arange(batch, dtype=torch.int32, device=self.device)
        self.capacity = 0  # keys
        self.tile_capacity = 0
        self._cuda = self.device.type == "cuda"
        self._grow(capacity, max(4, capacity // 16))  # tiles: keys / BLOCK_N plus a span's partial tile

    def _grow(self, keys: int, tiles: int) -> bool:
        """Make room for this many keys and tiles; True when the buffers moved."""
        if keys <= self.capacity and tiles <= self.tile_capacity:
            return False

        kc, tc = grown(self.capacity, keys, 4), grown(self.tile_capacity, tiles, 4)
        self.capacity, self.tile_capacity = kc, tc
        self.regions = Regions(self.batch, kc, tc, self.max_ways)
        self.dev = Packed.allocate(self.regions, self.device)
        # Two host buffers taken in turn: one may still feed the previous step's copy while the
        # other is written. The old ones may be freed with a copy in flight: torch's pinned-memory
        # allocator holds freed blocks until the copies that read them have completed.
        self._host = [Packed.allocate(self.regions, torch.device("cpu"), pin=self._cuda) for _ in range(2)]
        self._arrays = [HostArrays.of(h) for h in self._host]
        self._index = np.arange(kc, dtype=np.int32)  # tile starts are strided slices of it
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._unfenced: int | None = None
        self._layouts: dict[tuple[bool, int, bool], StepLayout] = {}
        return True

    @property
    def ids(self) -> torch.Tensor:
        return self.dev.ids

    @property
    def positions(self) -> torch.Tensor:
        return self.dev.positions

    @property
    def write_slots(self) -> torch.Tensor:
        return self.dev.write_slots

    @staticmethod
    def eligible(lay: StepLayout, small: Launch, big: Launch) -> bool:
        """Decode rows only (one query each, causal), no prerotation: what a graph can replay."""
        return (big.desc.shape[0] == 0 and not lay.has_plus and small.prerotation is None
                and small.desc.shape[0] == lay.q_pos.numel() * small.split)

    def load(self, rows: DecodeRows, block_n: int) -> tuple[StepLayout, bool]:
        """Send one decode step into the fixed buffers (one host-to-device copy, no sync).
        Returns the fixed-address layout and whether the buffers moved (captured graphs that read
        them are stale). `block_n`: keys per tile of the decode launch. Call `fence` once the
        step's kernels are queued."""
        if len(rows) != self.batch:
            raise ValueError(f"this static layout holds {self.batch} decode rows, the step has {len(rows)}")
        spans = spans_of(rows, block_n)
        ways = 1 if self.split is None else self.split.ways(self.batch, spans.max_row_tiles)
        moved = self._grow(spans.total_keys, spans.total_tiles)
        self.fence()  # in case the last step's caller did not
        i = self._turn
        self._turn ^= 1
        done = self._copied[i]
        if done is not None:
            done.synchronize()  # the step that last read this buffer (normally long finished)
        fused = write_step(self._arrays[i], rows, spans, block_n, self._index, ways)
        n = self.regions.used_bytes(spans.total_keys)
        self.dev.buf[:n].copy_(self._host[i].buf[:n], non_blocking=True)
        repaired = rows.repairs is not None
        if repaired:
            e = slice(self.regions.ends_offset, self.regions.ends_offset + 4 * spans.total_keys)
            self.dev.buf[e].copy_(self._host[i].buf[e], non_blocking=True)
        self._unfenced = i
        return self._layout(fused, ways, repaired), moved

    def fence(self) -> None:
        """Mark where the work reading the last loaded host buffer ends, so it is not overwritten
        before. Called after the launches, the event costs no time the GPU waits for."""
        i, self._unfenced = self._unfenced, None
        if i is None or not self._cuda:
            return
        if self._copied[i] is None:
            self._copied[i] = torch.cuda.Event()
        self._copied[i].record()

    def _layout(self, fused: bool, ways: int, repaired: bool = False) -> StepLayout:
        """The fixed layout of a step with rotation `fused`, rows cut into `ways` shares and some
        rows `repaired` or none: a graph's key, with the batch size."""
        if (fused, ways, repaired) not in self._layouts:
            d = self.dev
            launch = Launch(d.desc[:self.batch * ways], d.tile_start, d.tile_end, d.tile_delta, fused, None, ways,
                            self._tokens if ways > 1 else None)
            self._layouts[fused, ways, repaired] = StepLayout(
                write_slots=d.write_slots, key_slots=d.key_slots, q_pos=d.q_pos, anchor=d.zeros, seg=d.zeros,
                inv_freq=self.inv_freq, has_delta=fused, has_plus=False, rows=[],
                fixed=(launch, empty_launch(self.device)), key_end=d.key_end if repaired else None)
        return self._layouts[fused, ways, repaired]
