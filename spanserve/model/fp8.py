"""FP8 (e4m3) linear weights, one float32 scale per output channel: `LLM(quantization="fp8")`, or a
checkpoint saved FP8 in the compressed-tensors layout.

Why per output channel: a row's scale depends on that row alone, so quantizing the fused qkv (or
gate_up) equals quantizing its pieces apart, a column-parallel shard's rows equal the whole's, and
the per-tensor scales of other checkpoints become the same form (the scale repeated over the
rows). A row-parallel piece (o, down: split along the inputs) is quantized after slicing, over its
own columns' amax: TP=N and emulate_tp=N quantize the same pieces and compute the same numbers.

What `fp8_linear` computes, the same function on every device up to the order of additions:
- up to WEIGHT_ONLY_ROWS rows (a small decode step), weight-only: y = (x @ q.T) * scale with x in
  its own dtype and a float32 accumulator. Such a step's time is reading the weight, so x gains
  nothing from being 8-bit; on CUDA a Triton kernel (fp8_kernels.py) reads q once.
- more rows, W8A8: x quantized per token (its row's amax / 448, as the weights are), then
  y = (xq @ q.T) * sx * sw in float32; on CUDA with sm89+ that is torch._scaled_mm on the FP8
  tensor cores. This is the scheme FP8 checkpoints declare (dynamic per-token activations).
A token's result therefore depends on whether its step had more than WEIGHT_ONLY_ROWS rows
(padding rows included: a short step's CUDA graph may pad past it where the eager step does not).
The CPU computes the same two functions in float32 and is the reference the tests check the
kernels against."""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# The tensor cores' tile holds 16 rows of x: up to 16 cost what one does. Also a decode graph's
# batch size (1, 2, 4, 8, 16, ...): padding a decode step never moves it across the threshold.
WEIGHT_ONLY_ROWS = 16
QUANTIZATIONS = ("fp8",)
# The projections a checkpoint may hold in FP8 (embeddings, norms and the LM head stay dense).
PROJECTIONS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


@dataclass(frozen=True)
class Fp8Weight:
    """W [out, in] as q * scale[:, None]."""

    q: torch.Tensor  # [out, in] float8_e4m3fn, contiguous
    scale: torch.Tensor  # [out] float32

    def __post_init__(self) -> None:
        if self.q.dtype != FP8 or self.q.dim() != 2:
            raise ValueError(f"Fp8Weight.q must be a 2-d float8_e4m3fn tensor, got {self.q.dtype} {tuple(self.q.shape)}")
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (self.q.shape[0],):
            raise ValueError(f"Fp8Weight.scale must be float32 of shape ({self.q.shape[0]},), got "
                             f"{self.scale.dtype} {tuple(self.scale.shape)}")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def narrow(self, dim: int, start: int, length: int) -> "Fp8Weight":
        """A slice along the outputs (dim 0: the rows' scales go with them) or the inputs (dim 1:
        every row keeps its scale, as a row-parallel shard of an FP8 checkpoint does)."""
        if dim == 0:
            return Fp8Weight(self.q.narrow(0, start, length).contiguous(), self.scale.narrow(0, start, length).contiguous())
        return Fp8Weight(self.q.narrow(1, start, length).contiguous(), self.scale)


Weight = torch.Tensor | Fp8Weight


@dataclass(frozen=True)
class Fp8Rows:
    """Activations already quantized per token for the W8A8 product (`quantize_rows` of the
    `dtype` rows they replace): what the norm and SiLU ops hand an FP8 projection of a step with
    more than WEIGHT_ONLY_ROWS rows, so that the rows are written once, in 8 bits, instead of
    written in bf16, read back and quantized by a pass of their own."""

    q: torch.Tensor  # [M, K] float8_e4m3fn, contiguous
    scale: torch.Tensor  # [M, 1] float32
    dtype: torch.dtype  # the rows' dtype before quantization: the product's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def rows_of(x: torch.Tensor) -> Fp8Rows:
    """x [M, K] quantized per row, for ops that have no fused form."""
    if x.is_cuda and _has_triton():
        from spanserve.model import fp8_kernels
        q, s = fp8_kernels.quantize_rows(x)
    else:
        q, s = quantize_rows(x)
    return Fp8Rows(q, s, x.dtype)


# ---- quantization -----------------------------------------------------------------------------
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale [rows, 1] float32) with each row over its own amax: the weights' rows and, in the
    W8A8 path, the activations' tokens. An all-zero row gets scale 1 (its q is 0 either way)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # times 1/448 rather than / 448: torch does that for a scalar divisor on CUDA (and the Triton
    # kernel copies it), so the scales are the same bits on every device
    scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    if w.dim() != 2:
        raise ValueError(f"quantize_weight takes a 2-d [out, in] weight, got shape {tuple(w.shape)}")
    q, scale = quantize_rows(w)
    return Fp8Weight(q.contiguous(), scale.view(-1).contiguous())


def as_fp8(w: Weight) -> Fp8Weight:
    return w if isinstance(w, Fp8Weight) else quantize_weight(w)


def dequantize(wt: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (wt.q.float() * wt.scale[:, None]).to(dtype)


def cat(ws: list[Fp8Weight]) -> Fp8Weight:
    """Stacked along the outputs (the fused qkv and gate_up)."""
    if len(ws) == 1:
        return ws[0]
    return Fp8Weight(torch.cat([w.q for w in ws]), torch.cat([w.scale for w in ws]))


# ---- the product ------------------------------------------------------------------------------
def fp8_linear(x: "torch.Tensor | Fp8Rows", wt: Fp8Weight, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., in] @ W.T (+ bias) in out_dtype (x's by default); see the module's docstring.
    Fp8Rows (more than WEIGHT_ONLY_ROWS of them) go straight to the W8A8 product."""
    N, K = wt.shape
    if x.shape[-1] != K:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, the weight takes {K}")
    if isinstance(x, Fp8Rows):
        if x.shape[0] <= WEIGHT_ONLY_ROWS:
            raise ValueError(f"{x.shape[0]} quantized rows: steps of up to {WEIGHT_ONLY_ROWS} rows take the "
                             "weight-only product of unquantized rows")
        return _scaled(x.q, x.scale, wt, bias, out_dtype or x.dtype)
    x2 = x.reshape(-1, K)
    out_dtype = out_dtype or x.dtype
    if x2.shape[0] <= WEIGHT_ONLY_ROWS:
        y = weight_only_linear(x2, wt, bias, out_dtype)
    else:
        y = scaled_linear(x2, wt, bias, out_dtype)
    return y.view(*x.shape[:-1], N)


def weight_only_linear(x: torch.Tensor, wt: Fp8Weight, bias: torch.Tensor | None,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """(x @ q.T) * scale (+ bias), x [M, K] unquantized, float32 accumulation."""
    if x.is_cuda and x.shape[0] <= WEIGHT_ONLY_ROWS and _has_triton():
        from spanserve.model import fp8_kernels
        return fp8_kernels.gemv(x, wt.q, wt.scale, bias, out_dtype)
    y = (x.float() @ wt.q.float().t()) * wt.scale
    return (y if bias is None else y + bias.float()).to(out_dtype)


def scaled_linear(x: torch.Tensor, wt: Fp8Weight, bias: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """(xq @ q.T) * sx * scale (+ bias), x [M, K] quantized per token, float32 accumulation."""
    rows = rows_of(x)
    return _scaled(rows.q, rows.scale, wt, bias, out_dtype)


def _scaled(xq: torch.Tensor, sx: torch.Tensor, wt: Fp8Weight, bias: torch.Tensor | None,
            out_dtype: torch.dtype) -> torch.Tensor:
    N, K = wt.shape
    if xq.is_cuda and K % 16 == 0 and N % 16 == 0 and scaled_mm_supported(xq.device, out_dtype):
        # use_fast_accum off: Hopper's fast mode keeps fewer accumulator bits than float32
        y = torch._scaled_mm(xq, wt.q.t(), scale_a=sx, scale_b=wt.scale.view(1, N), out_dtype=out_dtype)
        return y if bias is None else y + bias.to(out_dtype)
    y = (xq.float() @ wt.q.float().t()) * sx * wt.scale
    return (y if bias is None else y + bias.float()).to(out_dtype)


_SCALED_MM: dict[tuple[int, torch.dtype], bool] = {}


def scaled_mm_supported(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm takes per-row scales with this output dtype on this GPU (FP8 needs
    sm89+, row-wise scales a recent torch). Probed once per (GPU, dtype): `probe` runs it ahead of
    any CUDA graph capture, where a failing call would spoil the capture."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, out_dtype)
    if key not in _SCALED_MM:
        ok = torch.cuda.get_device_capability(index) >= (8, 9)
        if ok:
            a = torch.ones(16, 32, device=device).to(FP8)
            b = torch.ones(16, 32, device=device).to(FP8)
            try:
                torch._scaled_mm(a, b.t(), scale_a=torch.ones(16, 1, device=device),
                                 scale_b=torch.ones(1, 16, device=device), out_dtype=out_dtype)
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                ok = False
        _SCALED_MM[key] = ok
    return _SCALED_MM[key]


def probe(device: torch.device, dtypes: tuple[torch.dtype, ...]) -> None:
    """Settles what `scaled_linear` takes on `device` for these output dtypes (outside a capture)."""
    if device.type == "cuda":
        for dt in dtypes:
            scaled_mm_supported(device, dt)


@functools.cache  # asked on every product of a CUDA step
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def mixed_linear(dense: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`dense` (F.linear or the bf16 matrix-vector kernel) for dense weights, fp8_linear for FP8 ones:
    a quantized model still has dense projections (an FP8 checkpoint's ignored layers)."""

    def linear(x: "torch.Tensor | Fp8Rows", w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(w, Fp8Weight):
            return fp8_linear(x, w, bias)
        if isinstance(x, Fp8Rows):
            raise ValueError("quantized activations reach a dense projection: only FP8 weights take Fp8Rows")
        return dense(x, w, bias)

    return linear


# ---- checkpoints ------------------------------------------------------------------------------
_SUPPORTED = ("quant_method 'compressed-tensors', format 'float-quantized': 8-bit float weights with "
              "strategy 'channel' or 'tensor' and, if any, 8-bit float input activations")


def checkpoint_quantization(hf_config: Mapping[str, Any], source: str) -> str | None:
    """'fp8' when config.json declares an FP8 checkpoint spanserve reads, None when it declares no
    quantization; a ValueError naming what it found for anything else."""
    qc = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if not qc:
        return None

    def bad(what: str) -> ValueError:
        return ValueError(f"{source}: unsupported quantization_config ({what}); spanserve reads {_SUPPORTED}")

    if qc.get("quant_method") != "compressed-tensors":
        raise bad(f"quant_method {qc.get('quant_method')!r}")
    if qc.get("kv_cache_scheme"):
        raise bad("a kv_cache_scheme: the KV cache's dtype is set by kv_cache_dtype, not by the checkpoint")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise bad(f"sparsity format {sparsity.get('format')!r}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise bad("no config_groups")
    for name, g in groups.items():
        fmt = g.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise bad(f"group {name}: format {fmt!r}")
        w = g.get("weights") or {}
        if (w.get("num_bits"), w.get("type")) != (8, "float") or w.get("strategy") not in ("channel", "tensor"):
            raise bad(f"group {name}: weights {w.get('num_bits')}-bit {w.get('type')} per {w.get('strategy')}")
        if w.get("symmetric") is False or w.get("dynamic"):
            raise bad(f"group {name}: asymmetric or dynamic weights")
        # Static activation scales (input_scale) are not used: activations are always quantized
        # per token from their own amax, which is at least as accurate.
        a = g.get("input_activations")
        if a is not None and (a.get("num_bits"), a.get("type")) != (8, "float"):
            raise bad(f"group {name}: input activations {a.get('num_bits')}-bit {a.get('type')}")
        if g.get("output_activations"):
            raise bad(f"group {name}: output activations")
    return "fp8"


def keeps_dtype(name: str, t: torch.Tensor) -> bool:
    """Tensors loading must not cast to the model's dtype: FP8 weights and their scales."""
    return t.dtype == FP8 or name.endswith(".weight_scale")


def loaded_as(name: str, t: torch.Tensor, dtype: torch.dtype, device: "torch.device | None" = None) -> torch.Tensor:
    """Checkpoint tensor `name` as loading places it: in the model's `dtype` (on `device`), except
    what `keeps_dtype` keeps."""
    return t.to(device=device) if keeps_dtype(name, t) else t.to(device=device, dtype=dtype)


def row_scales(name: str, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's weight_scale ([out, 1] per channel, [1] or [] per tensor) as [out] float32."""
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).contiguous()
    if s.numel() != rows:
        raise ValueError(f"{name}: shape {tuple(scale.shape)} is neither one scale per output channel ({rows}) "
                         "nor one per tensor")
    return s.contiguous()


def checkpoint_weights(weights: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint's tensors as the model reads them: scales as [out] float32, static input
    scales dropped; every FP8 tensor a decoder projection with its scale."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if name.endswith(".input_scale"):
            continue
        if name.endswith(".weight_scale"):
            base = weights.get(name[: -len("_scale")])
            if base is None:
                raise ValueError(f"{source}: {name} has no weight beside it")
            out[name] = row_scales(name, t, base.shape[0])
            continue
        if t.dtype == FP8:
            if not name.endswith(PROJECTIONS):
                raise ValueError(f"{source}: {name} is FP8; only the decoder layers' projections may be")
            if name + "_scale" not in weights:
                raise ValueError(f"{source}: FP8 tensor {name} has no {name}_scale")
        out[name] = t
    return out
