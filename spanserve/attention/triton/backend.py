"""TritonBackend, used by every step on CUDA: it launches the kernels a step's description asks for
(eager steps from Python, graph steps at capture), makes the fixed-address layouts of decode and
step graphs, and wraps the KV write and the eager copy-and-rotate used to compare repositioning
with deferred rotation. Which path a step and each of its rows take: `attention/paths.py`."""
from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import triton

from spanserve.attention.backend import AttentionBackend
from spanserve.attention.kv_cache import Fp8Cache
from spanserve.attention.plan import AttentionPlan
from spanserve.attention.triton.dense import attend_dense
from spanserve.attention.triton.graph_decode import StaticDecode
from spanserve.attention.triton.graph_step import StaticSteps
from spanserve.attention.triton.kernels import (
    attention_kernel,
    combine_kernel,
    kv_write_kernel,
    reposition_kernel,
    rotate_keys_kernel,
)
from spanserve.attention.triton.kv_quant import kv_write_fp8_kernel
from spanserve.attention.triton.launch import NUM_FIELDS, Launch, Prerotation, StepLayout, build_layout
from spanserve.attention.triton.split import SplitPolicy
from spanserve.rope import Rotary


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape of one of the two attention launches. BLOCK_M counts (token, head) pairs, so a
    program holds BLOCK_M // G tokens; it is raised to a power of two >= G when G is larger."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Hopper defaults for head_dim 128 (H100: benchmarks/attention_kernels.py, docs/gpu.md):
# prefill tiles are compute-bound (wide M), decode tiles only have G useful rows, so they stay at
# the 16-row minimum of a tensor-core dot.
PREFILL = LaunchConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
DECODE = LaunchConfig(block_m=16, block_n=128, num_warps=4, num_stages=3)
# Programs up to this many rows keep Q and swap(Q) in registers for the fused rotation.
_KEEP_Q_ROWS = 32


def _pow2_at_least(x: int, lo: int) -> int:
    return max(lo, triton.next_power_of_2(x))


class TritonBackend(AttentionBackend):
    def __init__(self, prefill: LaunchConfig = PREFILL, decode: LaunchConfig = DECODE,
                 prerotate_prefill: bool = True, split_programs: int | None = None,
                 dense_prefill: int | None = None, decode_min_tiles: int = 4):
        """`prerotate_prefill`: when some span of the prefill launch rotates, copy its keys
        (rotated) into a contiguous scratch once per layer, instead of rotating Q per span inside
        the kernel.
        `split_programs`: split a launch (prefill or decode) along keys until it has about this
        many programs (all KV heads together); None = two per SM on CUDA, 0 = never split.
        `dense_prefill`: rows of at least this many queries that attend only to their own new keys
        (a fresh prompt) go to torch's fused attention (`dense.py`) on dense K/V; None = 1024 on
        CUDA, 0 = never.
        `decode_min_tiles`: a decode launch's split gives each program at least this many tiles."""
        self.prefill_cfg = prefill
        self.decode_cfg = decode
        self.prerotate_prefill = prerotate_prefill
        self.split_programs = split_programs
        self.dense_prefill = dense_prefill
        self.decode_min_tiles = decode_min_tiles
        self.kv_shards = 1  # `for_shards`
        # `for_kv_cache`: every prefill launch first copies its keys and values, dequantized, into
        # bfloat16 scratch (an 8-bit cache). Read in the kernel, the converted tiles cost a prefill
        # 1.5x (H100, random Llama-3-8B, benchmarks/fp8.py); decode launches still read 8 bits.
        self.stage_prefill = False

    def for_shards(self, n: int) -> "TritonBackend":
        out = copy.copy(self)
        out.kv_shards = n
        return out

    def for_kv_cache(self, dtype: torch.dtype) -> "TritonBackend":
        out = copy.copy(self)
        out.stage_prefill = dtype.itemsize == 1
        return out

    def sized_for(self, dtype: torch.dtype, head_dim: int) -> "TritonBackend":
        """The tiles above are tuned for 2-byte types at head_dim 128. Wider rows (float32 at 128:
        Q, K, V and the score tile of a 128x128 prefill program took 256 KiB of shared memory on an
        H200, over its 227) cut block_m and block_n by the factor and keep 2 pipeline stages."""
        scale = (torch.finfo(dtype).bits // 8) * head_dim // 256
        if scale <= 1:
            return self

        def shrink(c: LaunchConfig) -> LaunchConfig:
            return replace(c, block_m=max(16, c.block_m // scale), block_n=max(16, c.block_n // scale),
                           num_stages=min(c.num_stages, 2))

        out = copy.copy(self)
        out.prefill_cfg, out.decode_cfg = shrink(self.prefill_cfg), shrink(self.decode_cfg)
        return out

    def prepare(self, plan: AttentionPlan, rotary: Rotary, block_size: int) -> StepLayout:
        return build_layout(plan, rotary.inv_freq)

    def launches(self, prepared: StepLayout, G: int, kvh: int = 1) -> tuple[Launch, Launch]:
        """(decode launch, prefill launch) of a step for G query heads per KV head."""
        dev = prepared.key_slots.device
        return prepared.launches(*self._cuts(G), self.prerotate_prefill, self._split_policy(dev, kvh),
                                 self._dense_min(dev), self.stage_prefill)

    def _block_m(self, G: int) -> tuple[int, int]:
        """(decode, prefill) program rows: BLOCK_M raised to a power of two >= G."""
        return _pow2_at_least(G, self.decode_cfg.block_m), _pow2_at_least(G, self.prefill_cfg.block_m)

    def _cuts(self, G: int) -> tuple[int, int, int, int]:
        """Tokens per program and keys per tile of the decode launch, then of the prefill launch."""
        dec_m, pre_m = self._block_m(G)
        return dec_m // G, self.decode_cfg.block_n, pre_m // G, self.prefill_cfg.block_n

    def _dense_min(self, dev: torch.device) -> int:
        if self.dense_prefill is not None:
            return self.dense_prefill
        return 1024 if dev.type == "cuda" else 0

    def _split_policy(self, dev: torch.device, kvh: int) -> SplitPolicy | None:
        target = self.split_programs
        if target is None:
            target = 2 * _sm_count(dev) if dev.type == "cuda" else 0
        per_rank = max(1, kvh // self.kv_shards)
        return SplitPolicy(-(-target // per_rank), decode_min_tiles=self.decode_min_tiles) if target else None

    def static_decode(self, batch: int, inv_freq: torch.Tensor, device: torch.device,
                      capacity: int = 1 << 14, kv_heads: int = 1) -> StaticDecode:
        """Fixed-address decode layouts of `batch` rows (CUDA graphs), split like `launches`
        splits them for `kv_heads` KV heads."""
        dev = torch.device(device)
        return StaticDecode(batch, inv_freq.to(device=dev, dtype=torch.float32).contiguous(), dev, capacity,
                            self._split_policy(dev, kv_heads))

    def static_steps(self, G: int, kvh: int, inv_freq: torch.Tensor, device: torch.device) -> StaticSteps:
        """Fixed-address layouts for short general steps (CUDA graphs), cut like `launches` cuts
        them for G query heads per KV head."""
        dev = torch.device(device)
        return StaticSteps(*self._cuts(G), self._split_policy(dev, kvh), self.prerotate_prefill,
                           inv_freq.to(device=dev, dtype=torch.float32).contiguous(), dev, self.stage_prefill)

    def write(self, prepared: StepLayout, k: torch.Tensor, v: torch.Tensor, k_cache: "torch.Tensor | Fp8Cache",
              v_cache: "torch.Tensor | Fp8Cache") -> None:
        write_kv(k, v, k_cache, v_cache, prepared.write_slots)

    def attend(self, prepared: StepLayout, q: torch.Tensor, k_cache: "torch.Tensor | Fp8Cache",
               v_cache: "torch.Tensor | Fp8Cache") -> torch.Tensor:
        """Attention alone, over a cache that already holds this step's K/V."""
        T, H, D = q.shape
        KVH = k_cache.shape[2]
        G = H // KVH
        if H != G * KVH:
            raise ValueError(f"{H} query heads do not share {KVH} KV heads evenly")
        out = torch.empty(T, H * D, dtype=q.dtype, device=q.device)
        dec_m, pre_m = self._block_m(G)
        small, big = self.launches(prepared, G, KVH)
        for launch, cfg, bm in ((big, self.prefill_cfg, pre_m), (small, self.decode_cfg, dec_m)):
            if launch.desc.shape[0]:
                # Held until the launch is queued: the kernel reads K rows from it.
                scratch = v_scratch = None
                if launch.prerotation is not None:
                    scratch, v_scratch = rotate_keys(k_cache, launch.prerotation, prepared.inv_freq, q.dtype, v_cache)
                _launch_attention(prepared, launch, cfg, bm, q, k_cache if scratch is None else scratch,
                                  v_cache if v_scratch is None else v_scratch, out, G, v_scratch is not None)
                del scratch, v_scratch
        for r in prepared.dense_rows(self._dense_min(q.device)):
            attend_dense(q, k_cache, v_cache, prepared.key_slots, r.q_start, r.q_end, r.key_base, r.n_keys, out)
        return out


_SMS: dict[int, int] = {}


def _sm_count(dev: torch.device) -> int:
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def _parts(cache: "torch.Tensor | Fp8Cache") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the rows, their scales or None): an 8-bit cache's two tensors, or a plain cache."""
    return (cache.data, cache.scale) if isinstance(cache, Fp8Cache) else (cache, None)


def _launch_attention(lay: StepLayout, launch: Launch, cfg: LaunchConfig, block_m: int,
                      q: torch.Tensor, k_cache: "torch.Tensor | Fp8Cache", v_cache: "torch.Tensor | Fp8Cache",
                      out: torch.Tensor, G: int, v_scratch: bool = False) -> None:
    T, H, D = q.shape
    KVH = k_cache.shape[2]
    (k_rows, k_scale), (v_rows, v_scale) = _parts(k_cache), _parts(v_cache)
    if q.stride(-1) != 1 or not (k_rows.is_contiguous() and v_rows.is_contiguous()):
        raise ValueError("q needs a unit last stride and the caches must be contiguous")
    # k_cache is the layer's K cache, or the launch's prerotated K scratch (same row layout)
    k_flat = k_rows.view(-1, KVH, D)
    v_flat = v_rows.view(-1, KVH, D)
    # The softmax runs in base 2: fold log2(e) into the score scale.
    qk_scale = (1.0 / math.sqrt(D)) * 1.4426950408889634
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    pre = launch.prerotation
    n_loc = 0 if launch.tokens is None else launch.tokens.numel()
    repair = lay.key_end is not None
    part_o = part_lse = part_ts = out
    if launch.split > 1:  # a repaired launch's shares write two results each (kernels.attention_kernel)
        groups = 2 if repair else 1
        part_o = torch.empty(launch.split * groups, n_loc, H, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(launch.split * groups, n_loc, H, dtype=torch.float32, device=q.device)
        if repair:
            part_ts = torch.empty(n_loc, 2, dtype=torch.float32, device=q.device)
    attention_kernel[(launch.desc.shape[0], KVH)](
        q, k_flat, v_flat, k_flat if k_scale is None else k_scale, v_flat if v_scale is None else v_scale, out,
        launch.desc, lay.key_slots, lay.key_slots if lay.key_end is None else lay.key_end,
        lay.q_pos, lay.anchor, lay.seg,
        launch.tile_start, launch.tile_end, launch.tile_delta, lay.inv_freq, part_o, part_lse, part_ts,
        q.stride(0), q.stride(1), k_flat.stride(0), k_flat.stride(1), out.stride(0), n_loc, H, KVH,
        qk_scale,
        G=G, D=D, BLOCK_M=block_m, BLOCK_N=cfg.block_n, NUM_FIELDS=NUM_FIELDS,
        HAS_DELTA=launch.fused_delta, KEEP_Q=block_m <= _KEEP_Q_ROWS, K_SCRATCH=pre is not None,
        HAS_PLUS=lay.has_plus, PREC=prec, SPLIT=launch.split > 1, HAS_REPAIR=repair,
        K_FP8=k_scale is not None, V_FP8=v_scale is not None, V_SCRATCH=v_scratch, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if launch.split > 1:
        block_h = min(triton.next_power_of_2(H), 8)
        combine_kernel[(n_loc, triton.cdiv(H, block_h))](
            part_o, part_lse, part_ts, launch.tokens, out, n_loc, H, out.stride(0), launch.split,
            D=D, BLOCK_H=block_h, REPAIR=repair, num_warps=4,
        )


def rotate_keys(k_cache: "torch.Tensor | Fp8Cache", pre: Prerotation, inv_freq: torch.Tensor,
                dtype: torch.dtype, v_cache: "torch.Tensor | Fp8Cache | None" = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[n, 1, KVH, D] scratch in `dtype` (the queries') holding R(delta) K of the launch's keys
    for one layer, in key order (n: the length of the slot list; with `pre.count` only the first
    count rows are written); keys of an 8-bit cache are dequantized on the way. With an 8-bit
    `v_cache`, also its values dequantized into a second scratch in the same order (else None)."""
    KVH, D = k_cache.shape[2], k_cache.shape[3]
    rows, scale = _parts(k_cache)
    n = pre.src_slots.numel()
    out = torch.empty(n, 1, KVH, D, dtype=dtype, device=k_cache.device)
    v_rows, v_scale = _parts(v_cache) if isinstance(v_cache, Fp8Cache) else (None, None)
    v_out = torch.empty_like(out) if v_rows is not None else None
    block_kvh = triton.next_power_of_2(KVH)
    # 32 (key, head) rows of D per program: more holds the fp32 halves in spilled registers. With
    # an 8-bit cache's values too, 16: 0.25 ms a layer for 91k keys on an H100 against 0.36 at 32
    # (bf16 keys alone: 0.13); programs reading whole rows were slower still.
    block_k = max(1, (16 if v_rows is not None else 32) // block_kvh)
    # A counted launch has a fixed grid whatever the count (graph replay): programs stride.
    programs = triton.cdiv(n, block_k) if pre.count is None else min(triton.cdiv(n, block_k), 2048)
    rotate_keys_kernel[(max(programs, 1),)](
        rows, rows if scale is None else scale, out, pre.src_slots, pre.delta, inv_freq,
        pre.src_slots if pre.count is None else pre.count, n, KVH * D,
        rows if v_rows is None else v_rows, rows if v_scale is None else v_scale, out if v_out is None else v_out,
        KVH=KVH, D=D, BLOCK_K=block_k, BLOCK_KVH=block_kvh, COUNTED=pre.count is not None,
        K_FP8=scale is not None, HAS_V=v_rows is not None, num_warps=4,
    )
    return out, v_out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: "torch.Tensor | Fp8Cache",
             v_cache: "torch.Tensor | Fp8Cache", slots: torch.Tensor) -> None:
    """k, v: [T, KVH, D]; caches [num_blocks, block_size, KVH, D]; token i goes to flat slot slots[i]
    (quantized for an 8-bit cache)."""
    T = k.shape[0]
    if T == 0:
        return
    if isinstance(k_cache, Fp8Cache) and isinstance(v_cache, Fp8Cache):
        _write_fp8(k, v, k_cache, v_cache, slots)
        return
    k2, v2 = k.reshape(T, -1), v.reshape(T, -1)
    if k2.stride(-1) != 1 or v2.stride(-1) != 1:
        k2, v2 = k2.contiguous(), v2.contiguous()
    W = k2.shape[1]
    k_flat = k_cache.view(-1, W)
    v_flat = v_cache.view(-1, W)
    block_w = min(triton.next_power_of_2(W), 1024)
    block_t = max(1, 2048 // block_w)
    grid = (triton.cdiv(T, block_t), triton.cdiv(W, block_w))
    kv_write_kernel[grid](k2, v2, k_flat, v_flat, slots, T, k2.stride(0), v2.stride(0), k_flat.stride(0),
                          W=W, BLOCK_T=block_t, BLOCK_W=block_w, num_warps=4)


def _write_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: Fp8Cache, v_cache: Fp8Cache, slots: torch.Tensor) -> None:
    T, KVH, D = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k.stride(1) != D or v.stride(1) != D:
        k, v = k.contiguous(), v.contiguous()
    block_t = max(1, min(16, 2048 // D))
    kv_write_fp8_kernel[(triton.cdiv(T, block_t), KVH)](
        k, v, k_cache.data, v_cache.data, k_cache.scale, v_cache.scale, slots, T, k.stride(0), v.stride(0),
        KVH=KVH, D=D, BLOCK_T=block_t, num_warps=4)


Job = tuple[int, int, int, int]


def reposition_blocks(k_cache_all_layers: torch.Tensor, v_cache_all_layers: torch.Tensor,
                      jobs: Sequence[Job] | torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Copy the first n slots of block src into block dst in every layer, rotating K forward by
    delta (src, dst, n, delta per job), all in one launch. Caches are
    [num_layers, num_blocks, block_size, KVH, D], contiguous. A job may copy a block onto itself
    (rotation in place); no job may write a block that another job of the same call reads."""
    k, v = k_cache_all_layers, v_cache_all_layers
    if k.element_size() == 1:
        raise ValueError("eager repositioning of an 8-bit KV cache goes through KVStorage.copy_rotated "
                         "(its keys are requantized after they turn)")
    if not (k.is_contiguous() and v.is_contiguous()) or k.shape != v.shape:
        raise ValueError("K and V caches must be contiguous and of one shape")
    L, NB, BS, KVH, D = k.shape
    jt = jobs if isinstance(jobs, torch.Tensor) else torch.tensor(list(jobs), dtype=torch.long).view(-1, 4)
    if jt.numel() == 0:
        return
    jt = jt.to(device=k.device, dtype=torch.long)
    # Per-job angles in float32 exactly as Rotary.cos_sin computes them; only the first half of D
    # is kept since both halves of rotate-half RoPE share each frequency.
    freqs = jt[:, 3].to(torch.float32)[:, None] * inv_freq.to(device=k.device, dtype=torch.float32)[None, :]
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    packed = torch.stack([jt[:, 0], jt[:, 1], jt[:, 2], (jt[:, 3] != 0).long()], dim=1).to(torch.int32).contiguous()
    reposition_kernel[(jt.shape[0], L)](
        k, v, packed, cos, sin, k.stride(0), k.stride(1),
        KVH=KVH, D=D, BLOCK_S=triton.next_power_of_2(BS), BLOCK_H=triton.next_power_of_2(KVH * D // 2),
        num_warps=8,
    )
