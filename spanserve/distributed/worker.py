"""A worker process: joins the group, loads its shard, then runs every step the driver sends
until told to stop (or until the driver is gone: its connection closes)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from spanserve.distributed.block_transfer import BlockTransfer, serve_transfer
from spanserve.distributed.group import TPGroup, quiet_threads
from spanserve.distributed.step import ScoreRows, StepMessage, unpack
from spanserve.distributed.storage_log import replay
from spanserve.model.config import ModelConfig
from spanserve.model.llama import LlamaModel
from spanserve.model.shard import ShardPlan
from spanserve.worker.runner import ModelRunner
from spanserve.worker.storage import KVStorage

log = logging.getLogger("spanserve.tp")


@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    world: int
    port: int
    device_type: str
    dtype: torch.dtype
    config: ModelConfig  # the whole model's
    source: Any  # a spanserve.model.weights source
    float32_reduce: bool = False
    peer_sum: bool = True
    quantization: str | None = None  # LlamaModel's: None, or "fp8"


@dataclass(frozen=True)
class EngineInit:
    """What the driver decides once every rank has loaded: the KV pool and the attention path."""

    num_blocks: int
    block_size: int
    backend: Any
    cuda_graphs: Any
    max_batch: int = 256  # the largest decode step a graph replays
    kv_dtype: torch.dtype | None = None  # the KV pool's element type; None: the model's dtype


class _Consumed(dict):
    """Hands each tensor out once and forgets it: the model's stacked copies (qkv, gate_up)
    replace the pieces as it builds, instead of both living until it is done (a 70B shard's
    pieces are ~44 GB)."""

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.pop(name)


def load_shard(group: TPGroup, config: ModelConfig, source: Any, dtype: torch.dtype,
               quantization: str | None = None) -> LlamaModel:
    plan = ShardPlan(config, group.rank, group.world)
    weights = _Consumed(source.shard(plan, dtype, group.device))
    # quantized after slicing: a row-parallel shard over its own columns, as emulate_tp's pieces
    model = LlamaModel(plan.local_config(), weights, dtype, group.device, group=group, vocab_size=config.vocab_size,
                       quantization=quantization)
    del weights
    if group.device.type == "cuda":
        torch.cuda.empty_cache()  # what loading freed is free for the KV pool
    group.enable_peer_sum(config.hidden_size, dtype)
    return model


def free_memory(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


def worker_main(args: WorkerArgs) -> None:
    quiet_threads()
    group = TPGroup.join(args.rank, args.world, args.port, args.device_type, args.float32_reduce, args.peer_sum)
    try:
        model = load_shard(group, args.config, args.source, args.dtype, args.quantization)
        group.min_over_ranks(free_memory(group.device))
        init = group.recv()
        if not isinstance(init, EngineInit):  # the driver failed before its engine was built
            return
        storage = KVStorage(model.config, init.num_blocks, init.block_size, init.kv_dtype or args.dtype,
                            group.device)
        runner = ModelRunner(model, storage, init.backend, init.cuda_graphs, init.max_batch)
        serve(group, runner, storage)
        runner.release_graphs()  # on a clean stop only: after a failure a collective may never finish
    finally:
        group.leave()


def serve(group: TPGroup, runner: ModelRunner, storage: KVStorage) -> None:
    hidden = None  # the last step's, for ScoreRows
    while True:
        msg: StepMessage = group.recv()
        replay(storage, msg.ops, runner.model.rotary)
        if isinstance(msg, BlockTransfer):  # a tier's capture or load, between steps
            serve_transfer(storage, msg)
            continue
        if isinstance(msg, ScoreRows):
            runner.logits_at(hidden, msg.rows)
            continue
        if msg.step is None:
            return
        step = unpack(msg.step)
        hidden, _ = runner.execute(step)
        runner.logits(hidden, step.sample_at)  # the LM head's vocabulary gather is a collective
