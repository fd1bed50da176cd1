"""The preallocated paged KV tensors: all layers' K and V for every block slot."""
from __future__ import annotations

import numpy as np
import torch

from spanserve.model.config import ModelConfig
from spanserve.worker import kv_upload


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


class KVStorage:
    """`num_blocks` blocks for the pool, and one more no request ever holds: its first slot is
    `scratch_slot`, where the padding rows of a CUDA-graph step write and read (their results
    are thrown away)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (config.num_layers, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_slot = num_blocks * block_size
        self._upload_stream: "torch.cuda.Stream | None" = None  # write_blocks's host-to-device copies

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def copy_rotated(self, src: list[int], dst: list[int], delta: int, rotary) -> None:
        """Eager repositioning: copy whole blocks src -> dst, turning K's rotation by `delta`
        (RoPE composes, so a key stored at local position p then reads as p + delta)."""
        from spanserve.rope import apply_rotary

        s, d = torch.tensor(src, device=self.k.device), torch.tensor(dst, device=self.k.device)
        k = self.k[:, s]  # [L, n, bs, KVH, D]
        cos, sin = rotary.cos_sin(torch.tensor([delta], device=self.k.device), torch.float32)
        flat = k.reshape(-1, *k.shape[-2:]).float()
        rot = apply_rotary(flat, cos.expand(flat.shape[0], -1), sin.expand(flat.shape[0], -1))
        self.k[:, d] = rot.view_as(k).to(self.k.dtype)
        self.v[:, d] = self.v[:, s]

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy the first n slots of block src into block dst, every layer (copy on write)."""
        self.k[:, dst, :n] = self.k[:, src, :n]
        self.v[:, dst, :n] = self.v[:, src, :n]

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
        for t in (self.k, self.v):
            flat = t.view(t.shape[0], -1, *t.shape[3:])
            flat[:, idx_t[1]] = flat[:, idx_t[0]]

    def read_blocks(self, ids: list[int], out: torch.Tensor) -> None:
        """Copy whole blocks into `out` [n, 2, L, bs, KVH, D] (host memory: pinned makes it async
        on CUDA, nothing here waits for the device; the caller waits on the stream before reading
        it). The pool evicting a block captures it through here, on the step path."""
        dev = self.k.device
        for lo in range(0, len(ids), _WRITE_CHUNK):  # bounds the device buffer
            idx = torch.tensor(ids[lo: lo + _WRITE_CHUNK])
            if dev.type == "cuda":  # from pinned memory: a pageable upload would wait for the stream
                idx = idx.pin_memory().to(dev, non_blocking=True)
            kv = torch.stack((self.k[:, idx], self.v[:, idx])).permute(2, 0, 1, 3, 4, 5)  # [n, 2, L, ...]
            out[lo: lo + len(idx)].copy_(kv, non_blocking=out.is_pinned())

    def write_blocks(self, ids: list[int], kvs: list[torch.Tensor]) -> None:
        """Fill whole blocks from host tensors [2, L, bs, KVH, D] each (a repeated id: the last
        one wins). On CUDA the copies are queued, not waited for: pinned sources go as a few large
        DMA transfers, overlapped with the scatter into the pool (`kv_upload`)."""
        if self.k.device.type == "cuda" and self._upload_stream is None:
            self._upload_stream = torch.cuda.Stream(self.k.device)
        chunk = max(1, _UPLOAD_BUFFER_BYTES // (2 * self.k[:, 0].numel() * self.k.element_size()))
        kv_upload.upload(self.k, self.v, kv_upload.plan(ids, kvs), chunk, self._upload_stream)


_WRITE_CHUNK = 256  # blocks per device buffer in read_blocks (512 MiB for an 8B model in bf16)
# each of write_blocks's two device buffers (128 blocks of an 8B model in bf16): large enough that
# a transfer is long against a launch, small enough to fit beside a full pool
_UPLOAD_BUFFER_BYTES = 256 << 20
