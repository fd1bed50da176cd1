"""A one-shot all-reduce through GPU peer memory for the small sums of decode steps.

A decode step at batch 1 sums [1, hidden] twice per layer: 64 all-reduces of 8 KB for an 8B
model. NCCL's ring/tree kernels pay a fixed latency per call that dwarfs moving 8 KB over NVLink.
Here each rank copies its partial sum into a buffer every peer can read (torch's symmetric
memory: the allocation is mapped on every GPU of the group), and one kernel per rank waits on the
others at a signal pad, reads every rank's buffer and adds them in rank order. Every rank therefore
computes the same sum in the same order: the ranks' residual streams stay bit-identical, as they
must. Capturable in CUDA graphs (the barrier lives on the device).

Messages above `max_bytes` (prefill), of dtypes the kernel does not take (it has bf16 and
float32) or not a multiple of 16 bytes go to NCCL."""
from __future__ import annotations

import logging
import torch

log = logging.getLogger("spanserve.tp")

_DTYPES = (torch.bfloat16, torch.float32)


class PeerAllReduce:
    def __init__(self, buffer: torch.Tensor, group_name: str, max_bytes: int):
        self.buffer = buffer  # uint8, symmetric: viewed as each message's dtype
        self.group_name = group_name
        self.max_bytes = max_bytes

    @classmethod
    def make(cls, device: torch.device, group_name: str, max_bytes: int = 1 << 20) -> "PeerAllReduce | None":
        """The reducer, or None where peer memory is not available (then NCCL does every sum).
        Collective: every rank of the group calls it, in the same order as its other collectives."""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
                return None
            buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buf, group_name)
        except Exception as e:  # noqa: BLE001 - any failure means: no peer path on this platform
            log.info("tensor parallel: peer-memory all-reduce unavailable (%s: %s); NCCL does every sum",
                     type(e).__name__, e)
            return None
        return cls(buf, group_name, max_bytes)

    def fits(self, x: torch.Tensor) -> bool:
        n = x.numel() * x.element_size()
        return x.dtype in _DTYPES and 0 < n <= self.max_bytes and n % 16 == 0 and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x (a new tensor); the caller checked `fits`. The kernel copies x
        into this rank's buffer, meets the peers at the signal pad, sums every buffer in rank
        order, and meets them again before returning (so the next call may overwrite the buffer)."""
        staged = self.buffer[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name,
                                                               torch.empty_like(x))

