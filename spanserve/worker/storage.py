"""The preallocated paged KV tensors: all layers' K and V for every block slot.

An 8-bit pool (dtype float8_e4m3fn) keeps each row's scale in tensors of its own beside K and V
(`attention/kv_cache.py`). Away from the device, a block of it is one uint8 tensor whose rows are
the D value bytes followed by the scale's 2 bytes: whatever moves whole blocks (tiers, tensor-
parallel transfers) moves the scales with the values and cuts heads as before."""
from __future__ import annotations

import numpy as np
import torch

from spanserve.attention.kv_cache import (
    FP8, SCALE_BYTES, SCALE_DTYPE, Fp8Cache, dequantize, packed_dtype, packed_row, quantize,
)
from spanserve.model.config import ModelConfig
from spanserve.worker import kv_upload


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """All layers' K and V of one block in a pool of `dtype` (an 8-bit row carries its scale)."""
    row = packed_row(config.head_dim, dtype) * torch.empty((), dtype=packed_dtype(dtype)).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * row


class KVStorage:
    """`num_blocks` blocks for the pool, and one more no request ever holds: its first slot is
    `scratch_slot`, where the padding rows of a CUDA-graph step write and read (their results
    are thrown away)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (config.num_layers, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.fp8 = dtype == FP8
        # an 8-bit pool's row scales [L, blocks, bs, KVH] (ones: a fresh pool reads as zeros)
        self.k_scale = torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=device) if self.fp8 else None
        self.v_scale = torch.ones(shape[:-1], dtype=SCALE_DTYPE, device=device) if self.fp8 else None
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_slot = num_blocks * block_size
        self._upload_stream: "torch.cuda.Stream | None" = None  # write_blocks's host-to-device copies

    @property
    def host_dtype(self) -> torch.dtype:
        """The element type of a block away from the device (`packed`)."""
        return packed_dtype(self.k.dtype)

    @property
    def packed_dims(self) -> tuple[int, int, int, int]:
        """[L, bs, KVH, row] of one side (K or V) of a packed block."""
        L, _, bs, kvh, d = self.k.shape
        return L, bs, kvh, packed_row(d, self.k.dtype)

    def _tensors(self) -> list[torch.Tensor]:
        """Every pool tensor indexed [layer, block, slot, ...]."""
        return [self.k, self.v] + ([self.k_scale, self.v_scale] if self.fp8 else [])

    def layer(self, i: int) -> "tuple[torch.Tensor | Fp8Cache, torch.Tensor | Fp8Cache]":
        if self.fp8:
            return Fp8Cache(self.k[i], self.k_scale[i]), Fp8Cache(self.v[i], self.v_scale[i])
        return self.k[i], self.v[i]

    def copy_rotated(self, src: list[int], dst: list[int], delta: int, rotary) -> None:
        """Eager repositioning: copy whole blocks src -> dst, turning K's rotation by `delta`
        (RoPE composes, so a key stored at local position p then reads as p + delta). An 8-bit
        pool's keys are quantized again after they turn."""
        from spanserve.rope import apply_rotary

        s, d = torch.tensor(src, device=self.k.device), torch.tensor(dst, device=self.k.device)
        k = self.k[:, s]  # [L, n, bs, KVH, D]
        cos, sin = rotary.cos_sin(torch.tensor([delta], device=self.k.device), torch.float32)
        flat = dequantize(k, self.k_scale[:, s]) if self.fp8 else k.float()
        flat = flat.reshape(-1, *k.shape[-2:])
        rot = apply_rotary(flat, cos.expand(flat.shape[0], -1), sin.expand(flat.shape[0], -1)).view(k.shape)
        if self.fp8:
            self.k[:, d], self.k_scale[:, d] = quantize(rot)
            self.v_scale[:, d] = self.v_scale[:, s]
        else:
            self.k[:, d] = rot.to(self.k.dtype)
        self.v[:, d] = self.v[:, s]

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy the first n slots of block src into block dst, every layer (copy on write)."""
        for t in self._tensors():
            t[:, dst, :n] = t[:, src, :n]

    def copy_many(self, jobs: list[tuple[int, int, int]]) -> None:
        """`copy(src, dst, n)` for every job, in one gather and one scatter per tensor: all
        sources are read before any destination is written (a block released as a source may be
        a later job's destination). On a GPU, two launches instead of two per job."""
        if not jobs:
            return
        if len(jobs) == 1:
            self.copy(*jobs[0])
            return
        bs = self.block_size
        idx = np.concatenate([np.stack([s * bs + np.arange(n), d * bs + np.arange(n)]) for s, d, n in jobs], axis=1)
        idx_t = torch.from_numpy(idx).to(self.k.device)
        for t in self._tensors():
            flat = t.view(t.shape[0], -1, *t.shape[3:])
            flat[:, idx_t[1]] = flat[:, idx_t[0]]

    def _byte_views(self) -> list[tuple[torch.Tensor, int, slice]]:
        """(pool tensor, K or V, the columns of a packed row it fills): how a packed block's rows
        map onto the pool tensors ([L, blocks, bs, KVH, bytes] views of an 8-bit pool)."""
        if not self.fp8:
            return [(self.k, 0, slice(None)), (self.v, 1, slice(None))]
        D = self.k.shape[-1]
        views = []
        for which, (rows, scale) in enumerate(((self.k, self.k_scale), (self.v, self.v_scale))):
            views.append((rows.view(torch.uint8), which, slice(0, D)))
            views.append((scale.view(torch.uint8).view(*scale.shape, SCALE_BYTES), which, slice(D, None)))
        return views

    def packed(self, idx: torch.Tensor) -> torch.Tensor:
        """Blocks `idx` (a device index) as [n, 2, L, bs, KVH, row] in `host_dtype`, on the device."""
        if not self.fp8:
            return torch.stack((self.k[:, idx], self.v[:, idx])).permute(2, 0, 1, 3, 4, 5)
        sides = [torch.cat([t[:, idx] for t, w, _ in self._byte_views() if w == which], dim=-1) for which in (0, 1)]
        return torch.stack(sides).permute(2, 0, 1, 3, 4, 5)

    def unpack(self, idx: torch.Tensor, kv: torch.Tensor) -> None:
        """Write packed blocks kv [n, 2, L, bs, KVH, row] (on the device) into blocks `idx`."""
        for t, which, cols in self._byte_views():
            t[:, idx] = kv[:, which, ..., cols].transpose(0, 1)

    def read_blocks(self, ids: list[int], out: torch.Tensor) -> None:
        """Copy whole blocks into `out` [n, 2, L, bs, KVH, row] (`packed`; host memory: pinned
        makes it async on CUDA, nothing here waits for the device; the caller waits on the stream
        before reading it). The pool evicting a block captures it through here, on the step path."""
        dev = self.k.device
        for lo in range(0, len(ids), _WRITE_CHUNK):  # bounds the device buffer
            idx = torch.tensor(ids[lo: lo + _WRITE_CHUNK])
            if dev.type == "cuda":  # from pinned memory: a pageable upload would wait for the stream
                idx = idx.pin_memory().to(dev, non_blocking=True)
            out[lo: lo + len(idx)].copy_(self.packed(idx), non_blocking=out.is_pinned())

    def write_blocks(self, ids: list[int], kvs: list[torch.Tensor]) -> None:
        """Fill whole blocks from host tensors [2, L, bs, KVH, row] each (`packed`; a repeated id:
        the last one wins). On CUDA the copies are queued, not waited for: pinned sources go as a
        few large DMA transfers, overlapped with the scatter into the pool (`kv_upload`)."""
        if self.k.device.type == "cuda" and self._upload_stream is None:
            self._upload_stream = torch.cuda.Stream(self.k.device)
        block = sum(t[:, 0].numel() * t.element_size() for t in self._tensors())
        chunk = max(1, _UPLOAD_BUFFER_BYTES // block)
        kv_upload.upload_parts(self._byte_views(), self.host_dtype, kv_upload.plan(ids, kvs), chunk,
                               self._upload_stream)


_WRITE_CHUNK = 256  # blocks per device buffer in read_blocks (512 MiB for an 8B model in bf16)
# each of write_blocks's two device buffers (128 blocks of an 8B model in bf16): large enough that
# a transfer is long against a launch, small enough to fit beside a full pool
_UPLOAD_BUFFER_BYTES = 256 << 20
