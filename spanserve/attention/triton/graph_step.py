"""Step graphs: padded shapes and fixed-address buffers of short general steps (prefill chunks,
plus rows, decodes, any mix, nothing recomputed), so a step of a few dozen tokens replays a CUDA
graph (`engine/cuda_graphs.StepGraphs`) instead of ~400 launches from Python.

A short step over a long cached context (a judge over its candidates, a warm RAG question) runs
~10 ms of kernels but issues them in ~17 ms of host time (docs/gpu.md). A graph fixes the
grid of every launch and the address of every buffer, so here everything whose *size* varies is
padded to a bucket and only *contents* change between steps:

- tokens to a power of two (>= 16): padding tokens have id 0, position 0, write slot -1 (the KV
  write skips it) and belong to no program, so their rows are garbage that nothing reads;
- each launch's programs to a power of two: padding descriptors are all zero, an empty query
  range with no tiles, which stores nothing;
- split launches index their partial results by launch-local token over the whole padded token
  range; `tokens` (`tokens_small` for the decode launch) maps padding indices to -1, which the
  combine pass skips;
- keys and tiles live in buffers that grow by doubling (a growth moves them: graphs that read
  them are stale, and `load` says so).

The prefill launch's prerotation pass reads its key count from the buffer and strides over it
with a fixed grid; its scratch has the capacity's rows. The shares of a split prefill launch
follow the program count alone (not also the tile count, as in eager steps), so one workload keeps
one shape; a decode launch's follow the tile count rounded down to a power of two, as in eager
steps, so decodes over short contexts are not cut into empty shares.
All of it goes in one packed host buffer sent in one copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from spanserve.attention.host_plan import HostPlan
from spanserve.attention.plan import key_ends_of
from spanserve.attention.paths import RowPath, row_path
from spanserve.attention.triton.graph_buffers import carve, grown, pack_offsets
from spanserve.attention.triton.launch import (
    F_PART0,
    NUM_FIELDS,
    HostLaunch,
    Launch,
    Prerotation,
    StepLayout,
    _describe_host,
    copies_keys,
    _RowHost,
    empty_launch,
    host_rows,
)
from spanserve.attention.triton.split import SplitPolicy, decode_split

_TILE_FIELDS = [F_PART0 + 2, F_PART0 + 3, F_PART0 + 6, F_PART0 + 7]


def bucket(n: int, lo: int = 1) -> int:
    return 0 if n == 0 else max(lo, 1 << (n - 1).bit_length())


@dataclass(frozen=True)
class Shape:
    """What a graph's launches are fixed by: padded token and program counts, the prefill
    launch's split ways, and the kernel variants (fused rotation per launch, plus-form rows)."""

    tokens: int
    small: int
    big: int
    ways: int
    small_ways: int
    small_fused: bool
    big_fused: bool
    big_prerotated: bool
    has_plus: bool
    repaired: bool = False  # some row reads its plus segments repaired (key ends sent)

    @property
    def buffers(self) -> tuple[int, int, int]:
        return self.tokens, self.small, self.big


class _Regions:
    """Byte offsets of the packed step input (device buffer and host buffers alike): fixed-size
    fields, then tiles, then key slots, so a step copies one prefix."""

    def __init__(self, tokens: int, small: int, big: int, key_cap: int, tile_cap: int):
        T, i64, i32 = tokens, torch.int64, torch.int32
        self.key_cap, self.tile_cap = key_cap, tile_cap
        self.offsets = pack_offsets([
            ("ids", i64, (T,)), ("positions", i64, (T,)), ("write_slots", i64, (T,)),
            ("q_pos", i32, (T,)), ("anchor", i32, (T,)), ("seg", i32, (T,)), ("tokens", i32, (T,)),
            ("tokens_small", i32, (T,)),
            ("rot_count", i32, (1,)),
            ("desc_small", i32, (small, NUM_FIELDS)), ("desc_big", i32, (big, NUM_FIELDS)),
            ("tile_start", i32, (tile_cap,)), ("tile_end", i32, (tile_cap,)), ("tile_delta", i32, (tile_cap,)),
            ("rot_delta", i32, (key_cap,)), ("rot_slots", i32, (key_cap,)), ("key_slots", i32, (key_cap,)),
            ("key_end", i32, (key_cap,))])
        self.keys_offset = self.offsets["key_slots"][0]
        self.ends_offset = self.offsets["key_end"][0]  # copied apart, by steps with repaired rows only
        self.nbytes = self.ends_offset + 4 * key_cap

    def carve(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        return carve(buf, self.offsets)


@dataclass
class _Buffers:
    """One bucket's device buffer and the two pinned host buffers that fill it in turn."""

    regions: _Regions
    dev_buf: torch.Tensor
    dev: dict[str, torch.Tensor]  # typed views of dev_buf
    host: list[torch.Tensor]
    arrays: list[dict[str, np.ndarray]]
    copied: list[torch.cuda.Event | None]
    turn: int = 0
    layouts: dict[Shape, StepLayout] = field(default_factory=dict)


class StaticSteps:
    """`split`: the backend's split policy for the prefill launch; (small_q, small_n, big_q,
    big_n): tokens per program and keys per tile of the decode and prefill launches."""

    def __init__(self, small_q: int, small_n: int, big_q: int, big_n: int, split: SplitPolicy | None,
                 prerotate: bool, inv_freq: torch.Tensor, device: torch.device, stage: bool = False):
        """`stage`: the prefill launch always copies its keys and values into scratch (an 8-bit
        cache: `TritonBackend.for_kv_cache`)."""
        self.small_q, self.small_n, self.big_q, self.big_n, self.split = small_q, small_n, big_q, big_n, split
        self.small_split = decode_split(split)
        self.prerotate = prerotate
        self.stage = stage
        self.inv_freq = inv_freq
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.sets: dict[tuple[int, int, int], _Buffers] = {}
        self._unfenced: tuple[_Buffers, int] | None = None

    def describe(self, plan: HostPlan) -> tuple[list[_RowHost], HostLaunch | None, HostLaunch | None, bool]:
        """The layout's rows, the step's two launches on the host, as the general path would cut
        them (but for the number of split shares), and whether some row has the plus form."""
        rows = host_rows(plan.rows)
        paths = [row_path(r.q_end - r.q_start, False, self.small_q, 0) for r in rows]  # no dense rows
        small = [r for r, p in zip(rows, paths) if p is RowPath.DECODE_LAUNCH]
        big = [r for r, p in zip(rows, paths) if p is RowPath.PREFILL_LAUNCH]
        pre = copies_keys(big, self.prerotate, self.stage)
        hs = _describe_host(small, self.small_q, self.small_n, False, self.small_split) if small else None
        hb = _describe_host(big, self.big_q, self.big_n, pre, self.split, fixed_ways=True) if big else None
        has_plus = any(h.anchor_end is not None or h.seg_start is not None for h in plan.rows)
        return rows, hs, hb, has_plus

    def load(self, plan: HostPlan) -> tuple[Shape, StepLayout, dict[str, torch.Tensor], bool]:
        """Send one step into its bucket's fixed buffers (one host-to-device copy, no sync).
        Returns the graph shape, the fixed-address layout, the device views (ids, positions,
        write_slots ...) and whether the bucket's buffers moved. Call `fence` once the step's
        kernels are queued."""
        rows, hs, hb, has_plus = self.describe(plan)
        T = len(plan.ids)
        n_keys = sum(len(h.key_slots) for h in plan.rows)
        ns = 0 if hs is None else len(hs.tile_start)
        nb = 0 if hb is None else len(hb.tile_start)
        shape = Shape(bucket(T, 16), bucket(0 if hs is None else len(hs.desc)), bucket(0 if hb is None else len(hb.desc)),
                      1 if hb is None else hb.split, 1 if hs is None else hs.split, hs is not None and hs.fused_delta,
                      hb is not None and hb.fused_delta, hb is not None and hb.rot_keys is not None, has_plus,
                      any(h.repair is not None for h in plan.rows))
        buf, moved = self._buffers(shape.buffers, n_keys, ns + nb)
        self.fence()
        i = buf.turn
        buf.turn ^= 1
        if buf.copied[i] is not None:
            buf.copied[i].synchronize()  # the step that last read this host buffer (long finished)
        a = buf.arrays[i]
        _fill(a, plan, rows, hs, hb, ns, n_keys)
        n = buf.regions.keys_offset + 4 * n_keys
        buf.dev_buf[:n].copy_(buf.host[i][:n], non_blocking=True)
        if shape.repaired:
            a["key_end"][:n_keys] = key_ends_of([h.repair for h in plan.rows], [len(h.key_slots) for h in plan.rows])
            e = slice(buf.regions.ends_offset, buf.regions.ends_offset + 4 * n_keys)
            buf.dev_buf[e].copy_(buf.host[i][e], non_blocking=True)
        self._unfenced = (buf, i)
        if shape not in buf.layouts:
            buf.layouts[shape] = self._layout(buf, shape)
        return shape, buf.layouts[shape], buf.dev, moved

    def fence(self) -> None:
        """Mark where the work reading the last loaded host buffer ends, so it is not overwritten
        before that."""
        last, self._unfenced = self._unfenced, None
        if last is None or not self._cuda:
            return
        buf, i = last
        if buf.copied[i] is None:
            buf.copied[i] = torch.cuda.Event()
        buf.copied[i].record()

    def _buffers(self, key: tuple[int, int, int], keys: int, tiles: int) -> tuple[_Buffers, bool]:
        old = self.sets.get(key)
        if old is not None and keys <= old.regions.key_cap and tiles <= old.regions.tile_cap:
            return old, False

        kc = grown(0 if old is None else old.regions.key_cap, keys, 1024)
        tc = grown(0 if old is None else old.regions.tile_cap, tiles, 1024)
        reg = _Regions(*key, kc, tc)
        dev_buf = torch.zeros(reg.nbytes, dtype=torch.uint8, device=self.device)
        # The old host buffers may be freed with a copy in flight: torch's pinned allocator holds
        # freed blocks until the copies that read them have completed.
        host = [torch.zeros(reg.nbytes, dtype=torch.uint8, pin_memory=self._cuda) for _ in range(2)]
        arrays = [{k: v.numpy() for k, v in reg.carve(h).items()} for h in host]
        buf = self.sets[key] = _Buffers(reg, dev_buf, reg.carve(dev_buf), host, arrays, [None, None])
        return buf, old is not None

    def _layout(self, buf: _Buffers, shape: Shape) -> StepLayout:
        d = buf.dev

        def launch(desc: torch.Tensor, fused: bool, ways: int, tokens: torch.Tensor,
                   pre: Prerotation | None = None) -> Launch:
            if desc.shape[0] == 0:
                return empty_launch(self.device)
            return Launch(desc, d["tile_start"], d["tile_end"], d["tile_delta"], fused, pre, ways,
                          tokens if ways > 1 else None)

        pre = Prerotation(d["rot_slots"], d["rot_delta"], d["rot_count"]) if shape.big_prerotated else None

        return StepLayout(
            write_slots=d["write_slots"], key_slots=d["key_slots"], q_pos=d["q_pos"], anchor=d["anchor"],
            seg=d["seg"], inv_freq=self.inv_freq, has_delta=shape.small_fused or shape.big_fused,
            has_plus=shape.has_plus, rows=[], key_end=d["key_end"] if shape.repaired else None,
            fixed=(launch(d["desc_small"], shape.small_fused, shape.small_ways, d["tokens_small"]),
                   launch(d["desc_big"], shape.big_fused, shape.ways, d["tokens"], pre)))


def _fill(a: dict[str, np.ndarray], plan: HostPlan, rows: list[_RowHost], hs: HostLaunch | None,
          hb: HostLaunch | None, ns: int, n_keys: int) -> None:
    """Write one step into a host buffer's arrays, padding as the module docstring says."""
    T = len(plan.ids)
    a["ids"][:T], a["ids"][T:] = plan.ids, 0
    a["positions"][:T], a["positions"][T:] = plan.positions, 0
    a["write_slots"][:T], a["write_slots"][T:] = plan.write_slots, -1
    for name in ("q_pos", "anchor", "seg"):
        a[name][:T] = np.concatenate([getattr(r, name) for r in rows]) if rows else 0
        a[name][T:] = 0
    a["tokens"][:] = -1
    a["tokens_small"][:] = -1
    a["desc_small"][:] = 0
    a["desc_big"][:] = 0
    if hs is not None:
        a["desc_small"][:len(hs.desc)] = hs.desc
        a["tile_start"][:ns], a["tile_end"][:ns], a["tile_delta"][:ns] = hs.tile_start, hs.tile_end, hs.tile_delta
        if hs.tokens is not None:
            a["tokens_small"][:len(hs.tokens)] = hs.tokens
    if hb is not None:
        d = hb.desc.copy()
        d[:, _TILE_FIELDS] += ns  # the two launches share one tile array: the prefill tiles follow
        a["desc_big"][:len(d)] = d
        nb = len(hb.tile_start)
        a["tile_start"][ns:ns + nb], a["tile_end"][ns:ns + nb] = hb.tile_start, hb.tile_end
        a["tile_delta"][ns:ns + nb] = hb.tile_delta
        if hb.tokens is not None:
            a["tokens"][:len(hb.tokens)] = hb.tokens
    if plan.rows:
        np.concatenate([h.key_slots for h in plan.rows], out=a["key_slots"][:n_keys], casting="unsafe")
    a["rot_count"][0] = 0
    if hb is not None and hb.rot_keys is not None:
        n = len(hb.rot_keys)
        a["rot_slots"][:n] = a["key_slots"][hb.rot_keys]
        a["rot_delta"][:n] = hb.rot_delta
        a["rot_count"][0] = n
