"""Whole blocks in and out of a tensor-parallel KV pool, for the tiers below it.

A tier keeps a block whole: every layer's K and V for all of the model's KV heads, so a store
written at TP=2 serves TP=1 and the other way round, and every tier decision is the driver's. Each
rank's pool holds only its heads, so the driver's `TPStorage` turns the pool's two whole-block
operations into messages and collectives:

- `read_blocks` (a capture for write-back, write-through or the disk at close): a `GatherBlocks`
  message, then every rank's head slice of those blocks gathered on the driver and put side by
  side in head order (a replicated head is taken once);
- `write_blocks` (blocks loaded from a tier): an `InstallBlocks` message, then each rank's head
  slice scattered to it from the driver, which writes its own.

Both run on the engine thread between steps, where the workers wait on the control channel: the
message tells them which collective comes next, so none waits on the other in a different one.
A worker handles a message after finishing the step before it, and replays the storage log the
message carries first, so a capture reads what every earlier step and block copy wrote, and a
load lands on every rank before the next step's message arrives."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from spanserve.distributed.storage_log import Op, RecordingStorage
from spanserve.model.config import ModelConfig
from spanserve.model.shard import ShardPlan
from spanserve.worker.storage import KVStorage

_CHUNK = 64  # blocks per collective: bounds the driver's buffer (world x 64 MiB, 8B model in bf16)


@dataclass
class GatherBlocks:
    """Workers: send your heads of blocks `ids` to the driver."""

    ops: list[Op]  # storage operations since the last message, replayed first
    ids: list[int]


@dataclass
class InstallBlocks:
    """Workers: receive your heads of blocks `ids` from the driver and write them."""

    ops: list[Op]
    ids: list[int]


BlockTransfer = (GatherBlocks, InstallBlocks)


def _chunks(ids: Sequence[int]) -> list[tuple[int, list[int]]]:
    return [(lo, list(ids[lo: lo + _CHUNK])) for lo in range(0, len(ids), _CHUNK)]


def local_blocks(storage: KVStorage, ids: list[int]) -> torch.Tensor:
    """This rank's heads of blocks `ids`: [n, 2, L, bs, local KV heads, row] (`KVStorage.packed`),
    contiguous."""
    return storage.packed(torch.tensor(ids, device=storage.k.device)).contiguous()


def put_blocks(storage: KVStorage, ids: list[int], kv: torch.Tensor) -> None:
    """Write `kv` [n, 2, L, bs, local KV heads, row] (on the storage's device) into blocks `ids`."""
    storage.unpack(torch.tensor(ids, device=storage.k.device), kv)


def _wait(storage: KVStorage) -> None:
    """NCCL fails by never finishing: the driver waits for its collectives inside `collective()`,
    where a worker's death is noticed, not later on a tier's thread or at shutdown."""
    if storage.k.is_cuda:
        torch.cuda.current_stream(storage.k.device).synchronize()


def serve_transfer(storage: KVStorage, msg: Any) -> None:
    """Worker: this rank's side of a GatherBlocks or InstallBlocks (the ops already replayed)."""
    if isinstance(msg, GatherBlocks):
        for _, ids in _chunks(msg.ids):
            dist.gather(local_blocks(storage, ids), None, dst=0)
        return
    for _, ids in _chunks(msg.ids):
        mine = torch.empty((len(ids), 2, *storage.packed_dims), dtype=storage.host_dtype, device=storage.k.device)
        dist.scatter(mine, None, src=0)
        put_blocks(storage, ids, mine)


class TPStorage(RecordingStorage):
    """The driver's KV storage: its own heads, the storage log, and whole-block reads and writes
    over every rank's heads (the tiers' view: all of the model's KV heads)."""

    def __init__(self, *args: Any, driver: Any, whole: ModelConfig, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.driver = driver  # a TPDriver: its group, and its failure handling around collectives
        world = driver.group.world
        plans = [ShardPlan(whole, r, world) for r in range(world)]
        # where each rank's heads sit among all of them; the ranks that together hold each head once
        self.head_ranges = [(p.kv_head0, p.kv_head0 + p.kv_heads) for p in plans]
        self.distinct = [r for r, p in enumerate(plans) if r == 0 or p.kv_head0 != plans[r - 1].kv_head0]

    def read_blocks(self, ids: list[int], out: torch.Tensor) -> None:
        """Copy whole blocks (all ranks' heads) into `out` [n, 2, L, bs, KVH, D] on the host."""
        if not ids:
            return
        group = self.driver.group
        with self.driver.collective():
            group.send(GatherBlocks(self.drain(), [int(i) for i in ids]))
            for lo, part in _chunks(ids):
                mine = local_blocks(self, part)
                parts = [torch.empty_like(mine) for _ in range(group.world)]
                dist.gather(mine, parts, dst=0)
                whole = torch.cat([parts[r] for r in self.distinct], dim=4)
                out[lo: lo + len(part)].copy_(whole, non_blocking=out.is_pinned())
            _wait(self)

    def write_blocks(self, ids: list[int], kvs: "Sequence[torch.Tensor] | torch.Tensor") -> None:
        """Fill whole blocks from host tensors [2, L, bs, KVH, D] each (all of the model's heads):
        every rank receives and writes its heads."""
        if not ids:
            return
        group = self.driver.group
        with self.driver.collective():
            group.send(InstallBlocks(self.drain(), [int(i) for i in ids]))
            for lo, part in _chunks(ids):
                src = kvs[lo: lo + len(part)]
                whole = torch.empty((len(part), *src[0].shape), dtype=self.host_dtype, device=self.k.device)
                if isinstance(src, torch.Tensor):
                    whole.copy_(src, non_blocking=src.is_pinned())
                else:
                    for i, kv in enumerate(src):
                        whole[i].copy_(kv, non_blocking=kv.is_pinned())
                slices = [whole[..., a:b, :].contiguous() for a, b in self.head_ranges]
                mine = torch.empty_like(slices[0])
                dist.scatter(mine, slices, src=0)
                put_blocks(self, part, mine)
            _wait(self)
