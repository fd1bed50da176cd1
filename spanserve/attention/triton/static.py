"""Fixed-address decode layouts, so a decode step can be captured once as a CUDA graph and replayed.

A graph replays kernel launches with the pointers and grid sizes seen at capture. Per step only the
*contents* of the layout change (slots, positions, tile ranges), so each batch size gets device
buffers at fixed addresses that every step's layout is copied into; the grid is one program per
decode row, which a batch size fixes. Capacity for keys and tiles grows by doubling; a growth moves
the buffers, and the caller must capture again (`load` says so).
"""
from __future__ import annotations

import torch

from spanserve.attention.triton.layout import NUM_FIELDS, Launch, StepLayout, empty_launch


class StaticDecode:
    def __init__(self, batch: int, inv_freq: torch.Tensor, device: torch.device, capacity: int = 1 << 14):
        self.batch = batch
        self.device = device
        self.inv_freq = inv_freq
        self.capacity = 0
        i32 = dict(dtype=torch.int32, device=device)
        self.write_slots = torch.zeros(batch, dtype=torch.long, device=device)
        self.q_pos = torch.zeros(batch, **i32)
        self.zeros = torch.zeros(batch, **i32)  # anchor / seg: decode rows are causal
        self.desc = torch.zeros(batch, NUM_FIELDS, **i32)
        self._grow(capacity)

    def _grow(self, need: int) -> None:
        cap = max(self.capacity, 64)
        while cap < need:
            cap *= 2
        if cap == self.capacity:
            return
        self.capacity = cap
        self.key_slots = torch.zeros(cap, dtype=torch.int32, device=self.device)
        # tiles never outnumber keys (each holds at least one)
        self.tiles = torch.zeros(3, cap, dtype=torch.int32, device=self.device)

    @staticmethod
    def eligible(lay: StepLayout, small: Launch, big: Launch) -> bool:
        """Decode rows only (one query each, causal), no prerotation: what a graph can replay."""
        return (big.desc.shape[0] == 0 and not lay.has_plus and small.prerotation is None
                and small.desc.shape[0] == lay.q_pos.numel())

    def load(self, lay: StepLayout, small: Launch) -> tuple[StepLayout, bool]:
        """Copy one step's decode layout into the fixed buffers (device-to-device, no sync).
        Returns the fixed-address layout and whether the buffers moved (captured graphs that
        read them are stale)."""
        B = self.batch
        if lay.q_pos.numel() != B:
            raise ValueError(f"this static layout holds {B} decode rows, the step has {lay.q_pos.numel()}")
        n_keys, n_tiles = lay.key_slots.numel(), small.tile_start.numel()
        old = self.capacity
        self._grow(max(n_keys, n_tiles))
        self.write_slots.copy_(lay.write_slots, non_blocking=True)
        self.q_pos.copy_(lay.q_pos, non_blocking=True)
        self.desc.copy_(small.desc, non_blocking=True)
        self.key_slots[:n_keys].copy_(lay.key_slots, non_blocking=True)
        for i, t in enumerate((small.tile_start, small.tile_end, small.tile_delta)):
            self.tiles[i, :n_tiles].copy_(t, non_blocking=True)
        fixed = Launch(self.desc, self.tiles[0], self.tiles[1], self.tiles[2], small.fused_delta, None)
        static = StepLayout(write_slots=self.write_slots, key_slots=self.key_slots, q_pos=self.q_pos,
                            anchor=self.zeros, seg=self.zeros, inv_freq=self.inv_freq, has_delta=small.fused_delta,
                            has_plus=False, rows=[], fixed=(fixed, empty_launch(self.device)))
        return static, self.capacity != old
