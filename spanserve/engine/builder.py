"""An engine's parts from a resolved EngineConfig: the model on one device or behind a
tensor-parallel driver, the KV pool sized for it, the tiers below the pool, the cache manager,
scheduler, executor, sampler and grammars. What differs between one device and tensor
parallelism is in `_load` and `_executor`; everything else is built the same way for both."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spanserve.attention.backend import AttentionBackend
from spanserve.attention.kv_cache import cache_dtype
from spanserve.cache.block_pool import BlockPool
from spanserve.cache.manager import CacheManager
from spanserve.cache.tiers import BlockShape, OffloadConfig, model_fingerprint
from spanserve.cache.tiers.stack import TierStack
from spanserve.engine.config import EngineConfig
from spanserve.engine.layout import sink_prefix as layout_sink_prefix
from spanserve.engine.runtime import make_backend
from spanserve.engine.sampling import Sampler
from spanserve.engine.scheduler import Scheduler
from spanserve.engine.structured import Grammars
from spanserve.model.config import ModelConfig
from spanserve.model.llama import LlamaModel
from spanserve.model.loader import LoadedModel, load_model
from spanserve.model.weights import RandomWeights
from spanserve.worker.executor import Executor
from spanserve.worker.runner import ModelRunner
from spanserve.worker.storage import KVStorage, bytes_per_block

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MIN_CONTEXT = 1024  # tokens of KV pool per running request when the batch is sized from memory
CPU_KV_BYTES = 1 << 30  # the KV pool on a CPU when neither num_blocks nor kv_cache_memory is given
FREE_SHARE = 0.8  # of free GPU memory (the tightest rank's under TP) for the KV pool by default


@dataclass
class LoadedSide:
    """The model as the engine drives it: on this device, or rank 0's shard of a TP driver."""

    model: Any  # LlamaModel (this rank's shard under TP)
    config: ModelConfig  # the whole model's architecture
    tokenizer: Any
    tp: Any = None  # the TPDriver, under tensor parallelism
    fingerprint: bytes | None = None  # the tiers' model identity, when tiers are configured


@dataclass
class EngineParts:
    device: torch.device
    dtype: torch.dtype
    side: LoadedSide
    storage: Any
    tiers: TierStack | None
    pool: BlockPool
    manager: CacheManager
    scheduler: Scheduler
    executor: Executor
    sampler: Sampler
    grammars: Grammars
    sink_prefix: tuple[int, ...]
    max_model_len: int


def build(config: EngineConfig) -> EngineParts:
    """Everything `LLMEngine` runs, for a resolved `config`."""
    if not config.resolved:
        raise ValueError("build() takes a resolved EngineConfig: call config.resolve() first")
    device, dtype = torch.device(config.model.device), DTYPES[config.model.dtype]
    cache, block_size = config.cache, config.cache.block_size
    cuts = config.parallel.emulate_tp if config.parallel.tensor_parallel_size == 1 else 1
    kv_dtype = cache_dtype(cache.kv_cache_dtype, dtype)
    side = _load(config, device, dtype, cuts, kv_dtype)
    num_blocks = _num_blocks(config, side, device, kv_dtype)
    backend = config.runtime.backend
    backend = make_backend(backend) if isinstance(backend, str) else backend
    backend = backend.sized_for(dtype, side.config.head_dim).for_shards(cuts).for_kv_cache(kv_dtype)
    storage, executor = _executor(config, side, num_blocks, backend, (device, kv_dtype))
    tiers = None
    if side.fingerprint is not None:
        c = side.config
        shape = BlockShape(c.num_layers, block_size, c.num_kv_heads, c.head_dim, kv_dtype)
        tiers = TierStack(OffloadConfig.of(cache.kv_offload), storage, shape, side.fingerprint)
    pool = BlockPool(num_blocks, on_evict=tiers.on_evict if tiers else None)
    manager = CacheManager(pool, storage, block_size, cache.reposition, side.model.rotary, tiers)
    scheduler = Scheduler(manager, max_num_seqs(config, num_blocks), config.scheduler.max_num_batched_tokens)
    grammars = Grammars(side.tokenizer, side.config.vocab_size, eos_token_ids(side.config, side.tokenizer))
    sink = tuple(cache.sink_prefix) if cache.sink_prefix is not None else layout_sink_prefix(side.tokenizer)
    limit = min(side.config.max_position_embeddings, num_blocks * block_size)
    max_model_len = min(config.scheduler.max_model_len or limit, limit)
    return EngineParts(device, dtype, side, storage, tiers, pool, manager, scheduler, executor, Sampler(), grammars,
                       sink, max_model_len)


def max_num_seqs(config: EngineConfig, num_blocks: int) -> int:
    """The running batch: as asked, or on a GPU by default as many as the KV pool holds at
    MIN_CONTEXT tokens each (an 8B model on an 80 GB GPU holds ~350k tokens: the full 256)."""
    asked = config.scheduler.max_num_seqs
    if config.reasons.get("max_num_seqs") != "auto: CUDA":
        return asked
    return max(1, min(asked, num_blocks * config.cache.block_size // MIN_CONTEXT))


def eos_token_ids(config: ModelConfig, tokenizer: Any) -> set[int]:
    ids = set(config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


# ---- one device or tensor parallelism ------------------------------------------------------------
def _load(config: EngineConfig, device: torch.device, dtype: torch.dtype, cuts: int,
          kv_dtype: torch.dtype) -> LoadedSide:
    """The model (this rank's shard under TP) and, where tiers are configured, the identity of its
    blocks in them (`kv_dtype`: the pool's element type)."""
    src, par = config.model.source, config.parallel
    tiers = OffloadConfig.of(config.cache.kv_offload) is not None  # resolved: None unless enabled
    if par.tensor_parallel_size > 1:
        from spanserve.distributed.driver import TPDriver

        tp = TPDriver(src, par.tensor_parallel_size, device, dtype, par.tp_on_failure, par.tp_float32_reduce,
                      par.tp_peer_sum, config.model.quantization)
        fingerprint = tp.fingerprint(config.cache.block_size, kv_dtype) if tiers else None  # TP=1's identity
        return LoadedSide(tp.model, tp.config, tp.tokenizer, tp, fingerprint)
    if isinstance(src, RandomWeights):
        loaded = src.whole(dtype, device)
    else:
        loaded = src if isinstance(src, LoadedModel) else load_model(src, dtype, device)
    model = LlamaModel(loaded.config, loaded.weights, dtype, device, fused=config.runtime.fused_ops == "on",
                       cuts=cuts, quantization=config.model.quantization)
    fingerprint = None
    if tiers:
        fingerprint = model_fingerprint(loaded.config, loaded.weights, dtype, config.cache.block_size,
                                        model.quantization, kv_dtype)
    side = LoadedSide(model, loaded.config, loaded.tokenizer, None, fingerprint)
    if model.quantization is not None and device.type == "cuda":
        del loaded  # the dense weights quantized from: their memory free for the KV pool sized next
        torch.cuda.empty_cache()
    return side


def _num_blocks(config: EngineConfig, side: LoadedSide, device: torch.device, kv_dtype: torch.dtype) -> int:
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    budget = cache.kv_cache_memory
    if budget is None and device.type == "cuda":
        free = side.tp.min_free if side.tp is not None else torch.cuda.mem_get_info(device)[0]
        budget = int(free * FREE_SHARE)
    per_block = bytes_per_block(side.model.config, cache.block_size, kv_dtype)  # this rank's heads
    num_blocks = int((budget if budget is not None else CPU_KV_BYTES) // per_block)
    if num_blocks < 2:
        raise ValueError(f"a KV pool of {num_blocks} blocks ({per_block} bytes each) is too small; raise "
                         "kv_cache_memory or num_blocks")
    return num_blocks


def _executor(config: EngineConfig, side: LoadedSide, num_blocks: int, backend: AttentionBackend,
              place: tuple[torch.device, torch.dtype]) -> tuple[KVStorage, Executor]:
    """The KV storage (`place`: its device and element type) and the executor that steps the model
    over it: this device's runner, or the TP driver's (whose workers build theirs: same block ids,
    their heads)."""
    block_size, graphs = config.cache.block_size, config.runtime.cuda_graphs
    max_batch = max_num_seqs(config, num_blocks)  # decode graphs up to the largest batch
    if side.tp is not None:
        storage = side.tp.storage(num_blocks, block_size, backend, graphs, max_batch, place[1])
        return storage, side.tp.executor(storage, backend, graphs, max_batch)
    storage = KVStorage(side.config, num_blocks, block_size, place[1], place[0])
    return storage, ModelRunner(side.model, storage, backend, graphs, max_batch)
