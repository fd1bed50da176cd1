"""Where and how the model runs: device, dtype, attention backend, CUDA graphs and fused ops.

Every choice defaults to `auto`, which picks the fast option for the machine (on a GPU: CUDA,
bfloat16, the Triton kernels, CUDA graphs, fused elementwise ops; on a CPU: float32 and the
reference backend). `resolve_runtime` is a pure function of what was asked and what the machine
offers (`Platform`), so every branch, the CUDA ones included, is testable without a GPU; each
choice carries the reason it was made, for the start-up log.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")  # plus cuda:N and any other torch device string
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
BACKEND_CHOICES = ("auto", "triton", "reference")
FUSED_CHOICES = ("auto", "on", "off")
_HALF = ("bfloat16", "float16")
_INTERPRET_HINT = "set TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter (slow; for testing)"


@dataclass(frozen=True)
class Platform:
    """What the machine offers; `detect_platform` reads it, tests make it up."""

    cuda_available: bool
    bf16_supported: bool = True  # on the CUDA device (pre-Ampere GPUs lack bfloat16)
    triton_available: bool = True  # the triton package imports
    triton_interpret: bool = False  # TRITON_INTERPRET=1: Triton kernels run on the CPU
    checkpoint_dtype: str | None = None  # config.json's torch_dtype, when the model says


@dataclass(frozen=True)
class RuntimeRequest:
    """What the user asked for; `auto` everywhere is the fast default."""

    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs
    fused_ops: str = "auto"


@dataclass(frozen=True)
class Runtime:
    device: str
    dtype: str
    attention_backend: str  # "triton" or "reference"
    cuda_graphs: bool | str  # "eager": the graphs' buffers without capture (tests)
    fused_ops: bool
    reasons: dict[str, str] = field(default_factory=dict, compare=False)

    def summary(self) -> str:
        """One line for the start-up log: each choice and why it was made."""
        items = [("device", self.device), ("dtype", self.dtype), ("attention", self.attention_backend),
                 ("cuda_graphs", _onoff(self.cuda_graphs)), ("fused_ops", _onoff(self.fused_ops))]
        return ", ".join(f"{k}={v} ({self.reasons[k]})" if k in self.reasons else f"{k}={v}" for k, v in items)


def _onoff(flag: bool | str) -> str:
    return flag if isinstance(flag, str) else "on" if flag else "off"


def resolve_runtime(req: RuntimeRequest, platform: Platform) -> Runtime:
    """The concrete runtime for `req` on `platform`; ValueError (naming the option) when a
    choice cannot work there."""
    device, why_device = _device(req.device, platform)
    cuda = device.startswith("cuda")
    dtype, why_dtype = _dtype(req.dtype, device, platform)
    triton_ok, why_not = _triton_usable(cuda, platform)
    backend, why_backend = _backend(req.attention_backend, cuda, triton_ok, why_not)
    fused, why_fused = _fused(req.fused_ops, cuda, triton_ok, why_not)
    if req.enforce_eager:
        graphs, why_graphs = False, "enforce_eager"
    elif not cuda:
        graphs, why_graphs = False, "not CUDA"
    elif backend != "triton":
        graphs, why_graphs = False, "the reference backend has no fixed-address layouts"
    else:
        graphs, why_graphs = True, "auto: CUDA with Triton"
    reasons = {"device": why_device, "dtype": why_dtype, "attention": why_backend,
               "cuda_graphs": why_graphs, "fused_ops": why_fused}
    return Runtime(device, dtype, backend, graphs, fused, reasons)


def _device(asked: str, p: Platform) -> tuple[str, str]:
    name = asked.strip().lower()
    if name == "auto":
        return ("cuda", "auto: CUDA available") if p.cuda_available else ("cpu", "auto: no CUDA device")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"device {asked!r} is not a device; use auto, cpu, cuda or cuda:N") from e
    if dev.type == "cuda" and not p.cuda_available:
        raise ValueError(f"device {asked!r} asks for CUDA but torch sees no CUDA device here "
                         "(torch.cuda.is_available() is False); use --device cpu or auto")
    return str(dev), "explicit"


def _dtype(asked: str, device: str, p: Platform) -> tuple[str, str]:
    if asked not in DTYPE_CHOICES:
        raise ValueError(f"dtype {asked!r} is not supported; use one of {', '.join(DTYPE_CHOICES)}")
    if asked != "auto":
        if asked == "bfloat16" and device.startswith("cuda") and not p.bf16_supported:
            raise ValueError("dtype bfloat16: this GPU has no bfloat16 support; use float16 or float32")
        return asked, "explicit"
    if device.startswith("cuda"):
        # Half the bytes of float32 on every weight and KV read, and the tensor cores' native type.
        return ("bfloat16", "auto: CUDA") if p.bf16_supported else ("float16", "auto: CUDA without bfloat16")
    if device == "cpu":
        # CPU matmuls are fastest (and exact to the reference) in float32; half types are emulated.
        return "float32", "auto: CPU"
    if p.checkpoint_dtype in _HALF:
        return p.checkpoint_dtype, "auto: the checkpoint's dtype"
    return "float32", "auto: checkpoint dtype unknown or float32"


def _triton_usable(cuda: bool, p: Platform) -> tuple[bool, str]:
    """(usable, why not) for Triton kernels on the chosen device."""
    if not p.triton_available:
        return False, "the triton package is not installed"
    if cuda or p.triton_interpret:
        return True, ""
    return False, f"Triton kernels need a CUDA device; {_INTERPRET_HINT}"


def _backend(asked: str, cuda: bool, triton_ok: bool, why_not: str) -> tuple[str, str]:
    if asked not in BACKEND_CHOICES:
        raise ValueError(f"attention backend {asked!r} is not a backend; use one of {', '.join(BACKEND_CHOICES)}")
    if asked == "reference":
        return "reference", "explicit"
    if asked == "triton":
        if not triton_ok:
            raise ValueError(f"attention backend triton: {why_not}; or use the reference backend")
        return "triton", "explicit" if cuda else "explicit, Triton interpreter"
    if cuda and triton_ok:
        return "triton", "auto: CUDA"
    return "reference", "auto: not CUDA" if not cuda else f"auto: {why_not}"


def _fused(asked: str, cuda: bool, triton_ok: bool, why_not: str) -> tuple[bool, str]:
    if asked not in FUSED_CHOICES:
        raise ValueError(f"fused ops {asked!r}: use one of {', '.join(FUSED_CHOICES)}")
    if asked == "off":
        return False, "explicit"
    if asked == "on":
        if not triton_ok:
            raise ValueError(f"fused ops on: {why_not}; or turn fused ops off")
        return True, "explicit" if cuda else "explicit, Triton interpreter"
    if cuda and triton_ok:
        return True, "auto: CUDA"
    return False, "auto: not CUDA" if not cuda else f"auto: {why_not}"


def detect_platform(model: Any = None) -> Platform:
    """The machine as it is: CUDA, bfloat16 support, Triton, and the checkpoint's dtype."""
    cuda = torch.cuda.is_available()
    return Platform(
        cuda_available=cuda,
        bf16_supported=bool(cuda and torch.cuda.is_bf16_supported()) or not cuda,
        triton_available=importlib.util.find_spec("triton") is not None,
        triton_interpret=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        checkpoint_dtype=checkpoint_dtype(model),
    )


def checkpoint_dtype(model: Any) -> str | None:
    """A Hugging Face directory's declared dtype (config.json), or None (GGUF, objects, unknown)."""
    if not isinstance(model, (str, Path)):
        return None
    cfg = Path(model).expanduser() / "config.json"
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None
    value = data.get("torch_dtype") or data.get("dtype")
    return value if value in ("float32", *_HALF) else None


def make_backend(name: str) -> Any:
    """The attention backend object for a resolved backend name."""
    if name == "triton":
        from spanserve.attention.triton import TritonBackend

        return TritonBackend()
    if name == "reference":
        from spanserve.attention.reference import ReferenceBackend

        return ReferenceBackend()
    raise ValueError(f"attention backend {name!r} is not one of triton, reference")
