"""Packed fixed-address buffers, shared by decode graphs and step graphs: a step's whole input is
laid out in one uint8 buffer of aligned, typed regions, so a pinned host copy and the device
buffer a captured graph reads share one layout and a step moves in one host-to-device copy."""
from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64  # bytes between region starts: Triton specializes kernels on 16-byte-aligned pointers

Offsets = dict[str, tuple[int, torch.dtype, tuple[int, ...]]]


def pack_offsets(fields: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> Offsets:
    """Byte offset of each (name, dtype, shape) region laid out in order, each aligned."""
    out: Offsets = {}
    off = 0
    for name, dt, shape in fields:
        out[name] = (off, dt, shape)
        off += -(-int(np.prod(shape)) * dt.itemsize // _ALIGN) * _ALIGN
    return out


def grown(cap: int, need: int, lo: int) -> int:
    """A buffer capacity of at least `need`: `cap` (at least `lo`) doubled as often as needed."""
    cap = max(cap, lo)
    while cap < need:
        cap *= 2
    return cap


def carve(buf: torch.Tensor, offsets: Offsets) -> dict[str, torch.Tensor]:
    """Typed views of a uint8 buffer laid out by `pack_offsets`."""
    return {name: buf[off:off + int(np.prod(shape)) * dt.itemsize].view(dt).view(shape)
            for name, (off, dt, shape) in offsets.items()}

