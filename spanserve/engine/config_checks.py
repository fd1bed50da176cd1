"""The machine-independent checks of an EngineConfig: types, ranges and names, each failure a
ValueError that names the option and says what to give instead. (What depends on the machine,
such as CUDA being there, is checked where `auto` is resolved: engine/runtime.py.)"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from spanserve.attention.backend import AttentionBackend
from spanserve.cache.tiers.config import OffloadConfig
from spanserve.engine.runtime import BACKEND_CHOICES, DTYPE_CHOICES, FUSED_CHOICES
from spanserve.reuse.policies import Policy, resolve_policy

if TYPE_CHECKING:
    from spanserve.engine.config import (CacheOptions, EngineConfig, ModelOptions, ParallelOptions, RuntimeOptions,
                                         SchedulerOptions)

REPOSITION_CHOICES = ("deferred", "eager")
ON_FAILURE_CHOICES = ("raise", "exit")
GRAPH_CHOICES = ("auto", True, False, "eager")
QUANTIZATION_CHOICES = ("fp8",)
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8")


def check_config(cfg: "EngineConfig") -> None:
    _model(cfg.model)
    _cache(cfg.cache)
    _scheduler(cfg.scheduler)
    _parallel(cfg.parallel)
    _runtime(cfg.runtime)


def _model(m: "ModelOptions") -> None:
    if isinstance(m.source, str) and not m.source.strip():
        raise ValueError("model is empty; give smollm2, a .gguf file or a Hugging Face model directory")
    if not isinstance(m.device, str):
        raise ValueError(f"device must be a name such as auto, cpu, cuda or cuda:N, got {m.device!r}")
    if m.device.strip().lower() != "auto":
        try:
            torch.device(m.device.strip().lower())
        except RuntimeError as e:
            raise ValueError(f"device {m.device!r} is not a device; use auto, cpu, cuda or cuda:N") from e
    _choice("dtype", m.dtype, DTYPE_CHOICES)
    if m.quantization is not None:
        _choice("quantization", m.quantization, QUANTIZATION_CHOICES, "(or None: the checkpoint's own weights)")


def _cache(c: "CacheOptions") -> None:
    _int("block_size", c.block_size, 1)
    _choice("kv_cache_dtype", c.kv_cache_dtype, KV_CACHE_DTYPE_CHOICES)
    if c.num_blocks is not None:
        _int("num_blocks", c.num_blocks, 2, "a KV pool needs at least 2 blocks; raise num_blocks or leave it "
                                            "unset to size the pool by kv_cache_memory")
    if c.kv_cache_memory is not None:
        _int("kv_cache_memory", c.kv_cache_memory, 1, "give the KV pool's size in bytes (on the command line "
                                                      "--kv-cache-memory takes units such as 512MiB)")
    if not _is_share(c.pin_fraction):
        raise ValueError(f"pin_fraction must be a number in [0, 1] (the share of the KV pool pinned segments "
                         f"may hold), got {c.pin_fraction!r}")
    if c.pin_quota is not None and not _is_share(c.pin_quota):
        raise ValueError(f"pin_quota must be a number in [0, 1] (the share of the KV pool one tenant's pins may "
                         f"hold) or None for pin_fraction, got {c.pin_quota!r}")
    _choice("reposition", c.reposition, REPOSITION_CHOICES)
    OffloadConfig.of(c.kv_offload)  # raises, naming the bad setting
    if c.sink_prefix is not None and not (isinstance(c.sink_prefix, tuple)
                                          and all(_is_int(t) and t >= 0 for t in c.sink_prefix)):
        raise ValueError(f"sink_prefix must be a list of token ids (ints >= 0) or None for the model's "
                         f"default, got {c.sink_prefix!r}")


def _scheduler(s: "SchedulerOptions") -> None:
    if s.max_num_seqs is not None:
        _int("max_num_seqs", s.max_num_seqs, 1, "or leave it unset: 256 on a GPU, 64 on a CPU")
    if s.max_num_batched_tokens is not None:
        _int("max_num_batched_tokens", s.max_num_batched_tokens, 1, "or leave it unset: 8192 on a GPU, 2048 on a CPU")
    if s.max_model_len is not None:
        _int("max_model_len", s.max_model_len, 2, "leave it unset for the model's own context length")
    if not isinstance(s.default_policy, (str, Policy)):
        raise ValueError(f"default_policy must be a policy name or a Policy object, got {s.default_policy!r}")
    resolve_policy(s.default_policy)


def _parallel(p: "ParallelOptions") -> None:
    _int("tensor_parallel_size", p.tensor_parallel_size, 1)
    _choice("tp_on_failure", p.tp_on_failure, ON_FAILURE_CHOICES)
    _flag("tp_float32_reduce", p.tp_float32_reduce)
    _flag("tp_peer_sum", p.tp_peer_sum)
    _int("emulate_tp", p.emulate_tp, 1)
    if p.tensor_parallel_size > 1 and p.emulate_tp not in (1, p.tensor_parallel_size):
        raise ValueError(f"emulate_tp={p.emulate_tp} with tensor_parallel_size={p.tensor_parallel_size}: "
                         "emulate_tp=N makes one device compute as N ranks do; give it with "
                         "tensor_parallel_size=1 (one device)")


def _runtime(r: "RuntimeOptions") -> None:
    if not isinstance(r.backend, AttentionBackend):
        _choice("backend", r.backend, BACKEND_CHOICES, "(or an AttentionBackend object)")
    if not any(r.cuda_graphs is g or (isinstance(g, str) and r.cuda_graphs == g) for g in GRAPH_CHOICES):
        raise ValueError(f"cuda_graphs must be auto, True, False or 'eager', got {r.cuda_graphs!r}")
    _choice("fused_ops", r.fused_ops, FUSED_CHOICES)
    if r.overlap is not None:
        _flag("overlap", r.overlap, " or None (on where CUDA graphs run)")
    _flag("enforce_eager", r.enforce_eager)
    if r.enforce_eager and r.cuda_graphs not in ("auto", False):
        raise ValueError(f"enforce_eager=True turns CUDA graphs off but cuda_graphs={r.cuda_graphs!r} asks for "
                         "them; drop one of the two")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_share(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1


def _int(name: str, value: Any, least: int, hint: str = "") -> None:
    if not _is_int(value) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}" + (f"; {hint}" if hint else ""))


def _flag(name: str, value: Any, also: str = "") -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False{also}, got {value!r}")


def _choice(name: str, value: Any, choices: tuple, also: str = "") -> None:
    if value not in choices or not isinstance(value, str):
        named = ", ".join(map(str, choices))
        raise ValueError(f"{name} {value!r} is not one of {named}" + (f" {also}" if also else ""))
