"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from spanserve.attention.backend import AttentionBackend
from spanserve.attention.plan import AttentionPlan
from spanserve.model import fp8
from spanserve.model.config import ModelConfig
from spanserve.model.fp8 import Fp8Weight, Weight
from spanserve.model.layers import has_mm_out_dtype, mm_float32, rms_norm
from spanserve.rope import Rotary, apply_rotary


Proj = Weight | list[Weight]


@dataclass
class _Layer:
    # Projections: whole tensors, or with cuts (`model/cuts.py`) one piece per emulated rank.
    qkv: Proj  # q, k and v projections stacked: one matmul instead of three
    qkv_bias: torch.Tensor | None | list[torch.Tensor | None]
    o: Proj
    gate_up: Proj
    down: Proj
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class LayerHooks(Protocol):
    """Per-layer active sets for selective recomputation (see spanserve.reuse.recompute)."""

    def active(self, layer: int) -> torch.Tensor | None:
        """Sorted flat indices of the tokens computed at this layer; None = all."""

    def after_write(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    idx: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Runs between the layer's K/V write and its attention."""


class _Eager:
    """The elementwise ops as plain torch (any device); spanserve.model.fused has the same four
    as Triton kernels, one memory pass each."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quant: bool = False) -> "torch.Tensor | fp8.Fp8Rows":
        out = rms_norm(x, weight, eps)
        return fp8.rows_of(out.reshape(-1, out.shape[-1])) if quant else out

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, quant: bool = False) -> "tuple[torch.Tensor | fp8.Fp8Rows, torch.Tensor]":
        h = residual + x
        return _Eager.rms_norm(h, weight, eps, quant), h

    @staticmethod
    def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, cos, sin).contiguous()

    @staticmethod
    def silu_mul(gate_up: torch.Tensor, quant: bool = False) -> "torch.Tensor | fp8.Fp8Rows":
        gate, up = gate_up.chunk(2, dim=-1)
        out = F.silu(gate) * up
        return fp8.rows_of(out) if quant else out


def _ops(fused: bool | None, device: torch.device) -> object:
    if fused is None:  # auto: the Triton kernels on a GPU when Triton is there
        fused = device.type == "cuda"
        try:
            import triton  # noqa: F401
        except ImportError:
            fused = False
    if not fused:
        return _Eager
    from spanserve.model import fused as ops
    return ops


def _linears(kernels: bool) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """(x @ w.T, the same with a float32 result): with `kernels`, single rows go to the Triton
    matrix-vector kernel (spanserve.model.gemv)."""
    if kernels:
        from spanserve.model import gemv
        return gemv.linear, gemv.linear_float32
    return F.linear, lambda x, w, native: mm_float32(x, w.t(), native)


class Collectives(Protocol):
    """What a tensor-parallel shard of the model needs from its process group."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def row_linear(self, x: torch.Tensor, weight: Weight,
                   linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor: ...

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor: ...

    def broadcast_ids(self, ids: torch.Tensor) -> None: ...

    def fuses(self, residual: torch.Tensor) -> bool: ...

    def reduce_add(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                   eps: float) -> "tuple[torch.Tensor | None, torch.Tensor]": ...


def _fetcher(weights: dict[str, torch.Tensor], dtype: torch.dtype,
             device: torch.device) -> Callable[[str], torch.Tensor]:
    """name -> that checkpoint tensor on `device` in `dtype`; a clear error when it is missing."""

    def w(name: str) -> torch.Tensor:
        if name not in weights:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        # On CPU copy: loaders may hand out views of memory-mapped files, which page in slowly.
        # On a GPU the tensor is already device memory; a copy would double an 8B model.
        # Contiguous, so that a GEMM's kernel (and its rounding) follows the shape alone.
        return weights[name].to(device=device, dtype=dtype, copy=device.type == "cpu").contiguous()

    return w


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device,
                 fused: bool | None = None, group: Collectives | None = None, vocab_size: int | None = None,
                 cuts: int = 1, quantization: str | None = None):
        """`group`: this model is one rank's shard (`config` has its share of the heads and MLP
        columns; o and down outputs are summed over ranks, the LM head's vocabulary gathered);
        `vocab_size`: the whole model's, when the LM head holds a padded share of it; `cuts` > 1:
        the whole model computing bit for bit as that many ranks would (`model/cuts.py`);
        `quantization` "fp8": the projections quantized at load (`model/fp8.py`). FP8 tensors in
        `weights` (an FP8 checkpoint) run FP8 whatever `quantization` says; `self.quantization`
        is what the model runs."""
        if quantization is not None and quantization not in fp8.QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {fp8.QUANTIZATIONS}, got {quantization!r}")
        self.quantize = quantization is not None  # dense projections too, not just an FP8 checkpoint's
        fp8_checkpoint = any(t.dtype == fp8.FP8 for t in weights.values())
        self.quantization = quantization or ("fp8" if fp8_checkpoint else None)
        self.config = config
        self.group = group
        self.vocab_size = vocab_size or config.vocab_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.ops = _ops(fused, self.device)
        self.linear, self.linear_float32 = _linears(self.ops is not _Eager and self.device.type == "cuda")
        if self.quantization is not None:
            self.linear = fp8.mixed_linear(self.linear)
            fp8.probe(self.device, (dtype, torch.float32))  # before any CUDA graph capture
        w = _fetcher(weights, dtype, self.device)
        self.cuts = None
        if cuts > 1:
            from spanserve.model.cuts import Cuts
            self.cuts = Cuts(config, cuts)
        self.layers: list[_Layer] = [self._load_layer(w, weights, i) for i in range(config.num_layers)]
        # A W8A8 product's rows come quantized out of the norm or SiLU before it (one pass over
        # them, not three); shards and cuts hand their products whole rows.
        self._quantized_inputs = self.quantization is not None and self.cuts is None and group is None
        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        head = weights.get("lm_head.weight")
        self.lm_head = self.embed if (config.tie_word_embeddings or head is None) else w("lm_head.weight")
        if self.cuts is not None:  # the ranks' padded vocabulary shards
            self.lm_head = [plan.slice(self.lm_head, "lm_head.weight").contiguous() for plan in self.cuts.plans]
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.rope_scaling, self.device)
        # Logits keep the LM head's float32 accumulator: rounded to bf16 they are multiples of
        # 1/32 near the top of the vocabulary, and greedy picks between exact ties (the lower id)
        # that the model did not make.
        self._head_f32 = dtype != torch.float32 and has_mm_out_dtype(self.device, dtype)

    def _proj(self, w: Callable[[str], torch.Tensor], weights: dict[str, torch.Tensor], names: list[str]) -> Proj:
        """The named tensors stacked along the outputs; with cuts, one such stack per rank. In a
        quantized model an FP8 checkpoint's tensors are taken as they are and dense ones quantized
        (after the cuts' slicing: a row-parallel piece over its own columns' amax); an FP8
        checkpoint's dense projections (its ignored layers) stay dense unless quantization is asked."""
        if self.quantization is not None and not names[0].endswith(".bias"):
            pieces = {n: self._fp8_piece(w, weights, n) for n in names}
            if self.quantize or any(isinstance(p, Fp8Weight) for p in pieces.values()):
                if self.cuts is None:
                    return fp8.cat([fp8.as_fp8(p) for p in pieces.values()])
                return self.cuts.fp8_pieces(pieces.__getitem__, names)
            w = pieces.__getitem__  # fetched already: a worker's dict hands each tensor out once
        if self.cuts is None:
            return torch.cat([w(n) for n in names]) if len(names) > 1 else w(names[0])
        return self.cuts.pieces(w, names)

    def _fp8_piece(self, w: Callable[[str], torch.Tensor], weights: dict[str, torch.Tensor], name: str) -> Weight:
        t = weights.get(name)  # a look only (a worker's dict hands each tensor out once)
        if t is None or t.dtype != fp8.FP8:
            return w(name)
        scale = name + "_scale"
        if scale not in weights:
            raise ValueError(f"checkpoint is missing tensor {scale!r}")
        q = weights[name].to(self.device).contiguous()
        return Fp8Weight(q, weights[scale].to(device=self.device, dtype=torch.float32).contiguous())

    def _load_layer(self, w: Callable[[str], torch.Tensor], weights: dict[str, torch.Tensor], i: int) -> _Layer:
        c = self.config
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = None
        if c.attention_bias:
            bias = self._proj(w, weights, [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"])
        elif self.cuts is not None:
            bias = [None] * self.cuts.n

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if c.qk_norm and name in weights else None

        return _Layer(
            qkv=self._proj(w, weights, [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
            qkv_bias=bias,
            o=self._proj(w, weights, [a + "o_proj.weight"]),
            gate_up=self._proj(w, weights, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            down=self._proj(w, weights, [p + "mlp.down_proj.weight"]),
            input_norm=w(p + "input_layernorm.weight"),
            post_norm=w(p + "post_attention_layernorm.weight"),
            q_norm=opt(a + "q_norm.weight"),
            k_norm=opt(a + "k_norm.weight"),
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        plan: AttentionPlan,
        backend: AttentionBackend,
        k_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, KVH, D]
        v_caches: list[torch.Tensor],
        hooks: LayerHooks | None = None,
        prepared: object = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden] (rows of tokens dropped from the
        active set by `hooks` hold stale values). `prepared`: the backend's layout of `plan`,
        when the caller made it (fixed-address layouts for CUDA graphs)."""
        block_size = k_caches[0].shape[1]
        cos_all, sin_all = self.rotary.cos_sin(plan.positions, self.dtype)
        h = self.embed[input_ids]
        idx: torch.Tensor | None = None
        if prepared is None:
            prepared = backend.prepare(plan, self.rotary, block_size)
        cos, sin = cos_all, sin_all
        # Without recomputation hooks (which may shrink the active rows between layers) the MLP's
        # sum applies the next layer's input norm (the final norm after the last layer): one kernel
        # instead of two per layer, the same bits.
        chain_norms = hooks is None
        x: torch.Tensor | None = None  # this layer's normed input, when the last sum made it
        for i, L in enumerate(self.layers):
            new_idx = hooks.active(i) if hooks is not None else None
            if new_idx is not idx:  # the active set shrank: a sub-plan for the remaining tokens
                idx = new_idx
                sub = plan if idx is None else plan.select(idx)
                prepared = backend.prepare(sub, self.rotary, block_size)
                cos, sin = (cos_all, sin_all) if idx is None else (cos_all[idx], sin_all[idx])
            hx = h if idx is None else h[idx]
            last = i + 1 == len(self.layers)
            nxt = (self.norm if last else self.layers[i + 1].input_norm) if chain_norms else None
            quant_next = nxt is not None and not last and self._feeds(self.layers[i + 1].qkv, hx.shape[0])
            x, hx = self._layer(i, L, x, hx, nxt, quant_next, cos, sin, backend, prepared, k_caches[i], v_caches[i],
                                hooks, idx)
            if idx is None:
                h = hx
            else:
                h[idx] = hx
        return x if x is not None else self.ops.rms_norm(h, self.norm, self.config.rms_norm_eps)

    def _feeds(self, w: Weight, rows: int) -> bool:
        """Whether the input of projection `w` over `rows` rows comes quantized (fp8.Fp8Rows)."""
        return self._quantized_inputs and isinstance(w, fp8.Fp8Weight) and rows > fp8.WEIGHT_ONLY_ROWS

    def _layer(self, i: int, L: _Layer, x: "torch.Tensor | fp8.Fp8Rows | None", hx: torch.Tensor,
               nxt: torch.Tensor | None, quant_next: bool, cos: torch.Tensor, sin: torch.Tensor,
               backend: AttentionBackend, prepared: object, k_cache: torch.Tensor, v_cache: torch.Tensor,
               hooks: LayerHooks | None, idx: torch.Tensor | None) -> "tuple[torch.Tensor | fp8.Fp8Rows | None, torch.Tensor]":
        """Decoder layer i over the active rows hx: (the sum normed by `nxt` or None, the sum).
        x: hx normed by this layer's input norm, when the previous layer's sum made it;
        `quant_next`: the normed sum goes to the next layer's projection quantized."""
        c, ops = self.config, self.ops
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        T = hx.shape[0]
        if x is None:
            x = ops.rms_norm(hx, L.input_norm, c.rms_norm_eps, self._feeds(L.qkv, T))
        if self.cuts is None:
            qkv = self.linear(x, L.qkv, L.qkv_bias)
        else:
            qkv = self.cuts.qkv(x, L.qkv, L.qkv_bias, self.linear)
        v = qkv[:, (H + KVH) * D:].view(T, KVH, D)  # a strided view: the KV write takes it as is
        if L.q_norm is not None:
            q, k = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
            q = ops.rotary(ops.rms_norm(q, L.q_norm, c.rms_norm_eps), cos, sin)
            k = ops.rotary(ops.rms_norm(k, L.k_norm, c.rms_norm_eps), cos, sin)
        else:
            # Q and K are adjacent columns of qkv: rotate them as one [T, H + KVH, D] tensor,
            # one launch instead of two (small steps are launch-bound on a GPU).
            qk = ops.rotary(qkv[:, :(H + KVH) * D].view(T, H + KVH, D), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
        backend.write(prepared, k, v, k_cache, v_cache)
        if hooks is not None:
            hooks.after_write(i, q, k, v, idx, k_cache, v_cache)
        attn = backend.attend(prepared, q, k_cache, v_cache)
        x, hx = self._add(attn if self.cuts is None else self.cuts.heads(attn), L.o, hx, L.post_norm,
                          self._feeds(L.gate_up, T))
        if self.cuts is None:
            act = ops.silu_mul(self.linear(x, L.gate_up), self._feeds(L.down, T))
        else:
            act = [ops.silu_mul(self.linear(x, g)) for g in L.gate_up]
        return self._add(act, L.down, hx, nxt, quant_next)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.group is None else self.group.all_reduce(x)

    def _add(self, x: "torch.Tensor | fp8.Fp8Rows", weight: Weight, residual: torch.Tensor,
             norm: torch.Tensor | None, quant: bool = False) -> "tuple[torch.Tensor | fp8.Fp8Rows | None, torch.Tensor]":
        """(rms_norm(h) * norm or None, h) with h = residual + x @ weight.T (on a shard: summed
        over ranks, through peer memory with the add and norm fused where the group can);
        `quant`: the normed rows quantized for an FP8 projection (fp8.Fp8Rows)."""
        if self.group is not None and self.group.fuses(residual):
            return self.group.reduce_add(self.linear(x, weight), residual, norm, self.config.rms_norm_eps)
        y = self.row_linear(x, weight)
        if norm is None:
            return None, residual + y
        return self.ops.add_rms_norm(y, residual, norm, self.config.rms_norm_eps, quant)

    def row_linear(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        """x @ weight.T; on a shard, the partial products summed over ranks (o and down); with
        cuts, x and weight are the ranks' pieces."""
        if self.cuts is not None:
            return self.cuts.row_sum(x, weight, self.linear)
        return self.linear(x, weight) if self.group is None else self.group.row_linear(x, weight, self.linear)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, vocab] of hidden states [n, hidden]."""
        if self.cuts is not None:
            parts = [self.linear_float32(hidden, h, self._head_f32) for h in self.lm_head]
            return torch.cat(parts, dim=-1)[:, :self.vocab_size].float()
        out = self.linear_float32(hidden, self.lm_head, self._head_f32)
        if self.group is not None:
            out = self.group.gather_vocab(out, self.vocab_size)
        return out.float()
