"""One engine configuration: what to load, how large the KV cache is, how requests are scheduled,
how the model is split over devices and how it runs.

`LLM(...)`, the command line, `spanserve serve` and the cluster's replicas all build an
`EngineConfig` (from flat keyword arguments, `from_kwargs`) and hand it to `resolve`, the one
place where every value is checked and every `auto` becomes this machine's choice
(`engine/runtime.py`, a pure function of the request and the `Platform`). A config of plain
values (names, paths, numbers) survives `to_dict` / `from_dict` and pickling, so a cluster can
ship it to replicas that resolve it on their own machines; a LoadedModel, backend or Policy
object is for in-process use only.
"""
from __future__ import annotations

import difflib
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

from spanserve.attention.backend import AttentionBackend
from spanserve.cache.tiers.config import OffloadConfig
from spanserve.engine.config_checks import check_config
from spanserve.engine.runtime import Platform, Runtime, RuntimeRequest, detect_platform, resolve_runtime


# The running batch when none is asked for: a GPU's decode step costs its weight reads whatever the
# batch (up to a few hundred rows), so a large batch is nearly free throughput; a CPU's grows with it.
GPU_MAX_NUM_SEQS = 256
CPU_MAX_NUM_SEQS = 64
GPU_BATCHED_TOKENS = 8192
CPU_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class ModelOptions:
    # a name (smollm2), a .gguf file or Hugging Face directory; in process also a LoadedModel or
    # RandomWeights. The keyword is `model`.
    source: Any = "smollm2"
    device: str = "auto"  # auto | cpu | cuda | cuda:N (or another torch device)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # None: the checkpoint's own (an FP8 checkpoint stays FP8); fp8: linear weights quantized to
    # float8 e4m3 at load, one scale per output channel, activations per token
    quantization: str | None = None


@dataclass(frozen=True)
class CacheOptions:
    block_size: int = 16  # token slots per KV block
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8: float8 e4m3 with a scale per token and KV head
    num_blocks: int | None = None  # None: as many as kv_cache_memory holds
    kv_cache_memory: int | None = None  # bytes; None: 80% of free GPU memory, 1 GiB on a CPU
    pin_fraction: float = 0.5  # share of the pool pinned segments may hold, all owners together
    pin_quota: float | None = None  # share of the pool one owner's (tenant's) pins may hold; None: pin_fraction
    reposition: str = "deferred"  # deferred: rotate keys when read; eager: copy-and-rotate
    kv_offload: dict[str, Any] | None = None  # OffloadConfig fields; None: no tiers below the pool
    sink_prefix: tuple[int, ...] | None = None  # anchor="sink" tokens; None: BOS + chat opening


@dataclass(frozen=True)
class SchedulerOptions:
    max_num_seqs: int | None = None  # requests in the running batch; None: 256 on a GPU (fewer if the
    # KV pool is small, engine/builder.py), 64 on a CPU
    max_num_batched_tokens: int | None = None  # tokens per step (the chunked-prefill budget); None:
    # 8192 on a GPU (its prefill steps fill the GPU: measured best of 2k, 8k and 16k), 2048 on a CPU
    max_model_len: int | None = None  # prompt + generated tokens; None: the model's, within the pool
    default_policy: Any = "none"  # recomputation policy for requests naming none (name or Policy)


@dataclass(frozen=True)
class ParallelOptions:
    tensor_parallel_size: int = 1  # > 1: worker processes hold the other shards (distributed/)
    tp_on_failure: str = "raise"  # a dead worker: raise WorkerDied, or "exit" the process (a server)
    tp_float32_reduce: bool = False  # row-parallel partial sums in float32
    tp_peer_sum: bool = True  # short steps' sums through GPU peer memory
    emulate_tp: int = 1  # N: one device computing bit for bit as N ranks do (model/cuts.py)


@dataclass(frozen=True)
class RuntimeOptions:
    backend: Any = "auto"  # attention: auto | triton | reference, or an AttentionBackend object
    # auto: decode steps as CUDA graphs on CUDA with Triton; False: never; "eager": the graphs'
    # fixed buffers without capture (tests the graph path on a CPU)
    cuda_graphs: bool | str = "auto"
    fused_ops: str = "auto"  # auto | on | off: Triton kernels for norms, rotary and SiLU
    overlap: bool | None = None  # decode steps chained on the device; None: where CUDA graphs run
    enforce_eager: bool = False  # no CUDA graphs (vLLM's name)


_PARTS: dict[str, type] = {"model": ModelOptions, "cache": CacheOptions, "scheduler": SchedulerOptions,
                           "parallel": ParallelOptions, "runtime": RuntimeOptions}
# keyword -> (part, field): the field's own name, except the model source, which is `model`
_KEYS: dict[str, tuple[str, str]] = {("model" if (p, f.name) == ("model", "source") else f.name): (p, f.name)
                                     for p, cls in _PARTS.items() for f in fields(cls)}
_FIELD_KEYS = {v: k for k, v in _KEYS.items()}


@dataclass(frozen=True)
class EngineConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    reasons: dict[str, str] = field(default_factory=dict)  # resolve(): why each runtime choice was made
    resolved: bool = False  # True: concrete values for this machine, checked

    # ---- building ----------------------------------------------------------------------------
    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """From the flat keyword arguments `LLM(...)` takes (model, device, block_size, ...)."""
        return cls().updated(**kwargs)

    def updated(self, **kwargs: Any) -> "EngineConfig":
        """This config with some options changed (flat keywords); unresolved again."""
        changes: dict[str, dict[str, Any]] = {}
        for key, value in kwargs.items():
            if key not in _KEYS:
                raise ValueError(unknown_option(key))
            part, name = _KEYS[key]
            changes.setdefault(part, {})[name] = _normalized(key, value)
        parts = {p: replace(getattr(self, p), **c) for p, c in changes.items()}
        return replace(self, **parts, reasons={}, resolved=False)

    def to_kwargs(self) -> dict[str, Any]:
        """The flat keyword arguments that build this config again."""
        return {_FIELD_KEYS[(p, f.name)]: getattr(getattr(self, p), f.name) for p in _PARTS
                for f in fields(_PARTS[p])}

    def to_dict(self) -> dict[str, Any]:
        """Plain data (names, numbers, lists, dicts) for shipping to another process; ValueError
        when an option holds an object (a loaded model, backend or Policy), which only works in process."""
        for key, value in self.to_kwargs().items():
            if not _plain(value):
                raise ValueError(f"{key} is a {type(value).__name__}, which cannot be shipped to another "
                                 f"process; give it as a name or path instead")
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EngineConfig":
        """The inverse of `to_dict`."""
        unknown = set(data) - {*_PARTS, "reasons", "resolved"}
        if unknown:
            raise ValueError(f"unknown engine config sections {sorted(unknown)}; known: {sorted(_PARTS)}")
        flat = {}
        for part in _PARTS:
            for name, value in dict(data.get(part, {})).items():
                flat[_FIELD_KEYS.get((part, name), f"{part}.{name}")] = value
        return replace(cls.from_kwargs(**flat), reasons=dict(data.get("reasons", {})),
                       resolved=bool(data.get("resolved", False)))

    # ---- checking and resolving ------------------------------------------------------------------
    def check(self) -> "EngineConfig":
        """Every check that does not depend on the machine; itself, or ValueError saying what to change."""
        check_config(self)
        return self

    def resolve(self, platform: Platform | None = None) -> "EngineConfig":
        """Checked, with every `auto` replaced by the choice for `platform` (default: this machine,
        and the checkpoint's dtype read from the model directory). A resolved config is returned as is."""
        if self.resolved:
            return self
        self.check()
        rt = self.runtime
        obj = rt.backend if isinstance(rt.backend, AttentionBackend) else None
        name = backend_kind(obj) if obj is not None else rt.backend
        run = resolve_runtime(RuntimeRequest(self.model.device, self.model.dtype, name,
                                             rt.enforce_eager or rt.cuda_graphs is False, rt.fused_ops),
                              platform if platform is not None else detect_platform(self.model.source))
        reasons = dict(run.reasons)
        graphs = run.cuda_graphs
        if rt.cuda_graphs not in ("auto", False):  # True or "eager": asked for by name
            graphs, reasons["cuda_graphs"] = rt.cuda_graphs, "explicit"
        offload = OffloadConfig.of(self.cache.kv_offload)
        sched, gpu = self.scheduler, run.device.startswith("cuda")
        if sched.max_num_seqs is None:
            sched = replace(sched, max_num_seqs=GPU_MAX_NUM_SEQS if gpu else CPU_MAX_NUM_SEQS)
            reasons["max_num_seqs"] = "auto: " + ("CUDA" if gpu else "CPU")
        if sched.max_num_batched_tokens is None:
            sched = replace(sched, max_num_batched_tokens=GPU_BATCHED_TOKENS if gpu else CPU_BATCHED_TOKENS)
        return replace(self, model=replace(self.model, device=run.device, dtype=run.dtype), scheduler=sched,
                       cache=replace(self.cache, kv_offload=asdict(offload) if offload and offload.enabled else None),
                       runtime=replace(rt, backend=obj or run.attention_backend, cuda_graphs=graphs,
                                       fused_ops="on" if run.fused_ops else "off"),
                       reasons=reasons, resolved=True)

    def choices(self) -> Runtime:
        """The runtime choices of a resolved config, with their reasons."""
        if not self.resolved:
            raise ValueError("resolve() the config first: its auto choices are not made yet")
        rt = self.runtime
        name = rt.backend if isinstance(rt.backend, str) else backend_kind(rt.backend)
        return Runtime(self.model.device, self.model.dtype, name, rt.cuda_graphs, rt.fused_ops == "on",
                       dict(self.reasons))

    def summary(self) -> str:
        """The start-up log line: each runtime choice and why it was made, and the 8-bit options
        when asked for."""
        fp8 = [f"kv_cache_dtype={self.cache.kv_cache_dtype}"] if self.cache.kv_cache_dtype != "auto" else []
        fp8 += [f"quantization={self.model.quantization}"] if self.model.quantization else []
        return ", ".join([self.choices().summary(), *fp8])


def unknown_option(key: str) -> str:
    close = difflib.get_close_matches(key, list(_KEYS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown engine option {key!r}{hint}; known options: {', '.join(sorted(_KEYS))}"


def backend_kind(backend: AttentionBackend) -> str:
    """The name of a backend object's kind, as `resolve_runtime` takes it."""
    from spanserve.attention.reference import ReferenceBackend

    return "reference" if isinstance(backend, ReferenceBackend) else "triton"


def _normalized(key: str, value: Any) -> Any:
    """The spellings older call sites use, in the config's own terms."""
    if key == "dtype":
        return str(value).removeprefix("torch.")  # a torch.dtype, or its name
    if key == "backend" and value is None:
        return "auto"
    if key == "fused_ops" and (value is None or isinstance(value, bool)):
        return {None: "auto", True: "on", False: "off"}[value]
    if key == "kv_offload" and isinstance(value, OffloadConfig):
        return asdict(value)
    if key == "sink_prefix" and value is not None and not isinstance(value, (str, Mapping)):
        try:
            return tuple(value)
        except TypeError:
            return value  # not a sequence: check() says so
    return value


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False
