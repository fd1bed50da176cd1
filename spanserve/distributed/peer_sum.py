"""The sums of a short step's row-parallel projections through GPU peer memory, fused with the
residual add and RMSNorm that follow them.

A decode step sums [B, hidden] twice per layer. Through NCCL each sum is a kernel of ~7 us on two
H100s, then the residual add and the norm are kernels of their own. Here one kernel per sum does
all of it: every rank writes its partial row into each peer's buffer (torch symmetric memory maps every
rank's allocation on every GPU), raises a flag there, waits for theirs, adds the partials in rank
order (so every rank holds the same bits, as NCCL's sum of two bf16 values gives them) and then
applies the residual add and, for the attention output, the RMSNorm of the next sublayer.

Each row has its own epoch counter (advanced by the program that owns the row) and two buffer
slots used in turn: a rank writes a peer's slot e % 2 at epoch e only after that peer raised its
flag for e - 1, that is after it finished reading the slot at e - 2. No barrier at the end.
A peer that never arrives leaves the kernel spinning, as NCCL's would: the driver's monitor
sees the dead worker and ends the process."""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger("spanserve.tp")

MAX_ROWS = 64  # rows a sum may have (decode batches up to 64): larger ones go to NCCL


@triton.jit
def _peer_sum_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, bufs_ptr, flags_ptr, count_ptr, N, eps,
                     RANK: tl.constexpr, WORLD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                     NORM: tl.constexpr):
    p = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    cmask = cols < N
    mask = cmask[None, :]
    dt = x_ptr.dtype.element_ty
    e = tl.load(count_ptr + p) + 1
    slot = (e % 2) * WORLD
    row = p.to(tl.int64) * N
    x = tl.load(x_ptr + row + cols[None, :], mask=mask, other=0.0)
    # Push this rank's row into every peer's buffer (posted writes: nothing waits on them), then
    # raise the flag there; each rank then reads only its own memory.
    for r in tl.static_range(WORLD):
        if r != RANK:
            theirs = tl.load(bufs_ptr + r).to(tl.pointer_type(dt))
            tl.store(theirs + ((slot + RANK) * ROWS).to(tl.int64) * N + row + cols[None, :], x, mask=mask)
    tl.debug_barrier()  # every thread's row stores happen before the flag (release is cumulative)
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer_flags = tl.load(flags_ptr + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + RANK * ROWS + p, e, sem="release", scope="sys")
    own_flags = tl.load(flags_ptr + RANK).to(tl.pointer_type(tl.int32))
    mine = tl.load(bufs_ptr + RANK).to(tl.pointer_type(dt))
    acc = tl.zeros([1, BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += x.to(tl.float32)
        else:
            while tl.atomic_add(own_flags + r * ROWS + p, 0, sem="acquire", scope="sys") < e:
                pass
            tl.debug_barrier()
            got = tl.load(mine + ((slot + r) * ROWS).to(tl.int64) * N + row + cols[None, :], mask=mask, other=0.0,
                          volatile=True)
            acc += got.to(tl.float32)
    s = acc.to(dt).to(tl.float32)  # the sum, rounded as NCCL rounds it
    r = tl.load(res_ptr + p.to(tl.int64) * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    h = (s + r).to(dt)
    tl.store(sum_ptr + p.to(tl.int64) * N + cols[None, :], h, mask=mask)
    if NORM:  # as spanserve.model.fused's RMSNorm of a residual sum
        hf = h.to(tl.float32)
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(hf * hf, axis=1) / N + eps))
        normed = (hf * inv[:, None]).to(dt).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + p.to(tl.int64) * N + cols[None, :], (normed * w[None, :]).to(dt), mask=mask)
    tl.store(count_ptr + p, e)


class PeerSum:
    """One rank's peer-memory sums for rows of `hidden` values of `dtype`."""

    def __init__(self, rank: int, world: int, hidden: int, dtype: torch.dtype, bufs: torch.Tensor,
                 flags: torch.Tensor, keep: list[torch.Tensor]):
        self.rank, self.world, self.hidden, self.dtype = rank, world, hidden, dtype
        self.bufs, self.flags = bufs, flags  # int64 device addresses, one per rank
        self.count = torch.zeros(MAX_ROWS, dtype=torch.int32, device=bufs.device)
        self._keep = keep  # the symmetric allocations the addresses point into

    @classmethod
    def make(cls, rank: int, world: int, hidden: int, dtype: torch.dtype, device: torch.device,
             group_name: str) -> "PeerSum | None":
        """Collective over the group. None where peer memory is not available (NCCL then sums)."""
        try:
            import torch.distributed._symmetric_memory as symm_mem

            data = symm_mem.empty(2 * world * MAX_ROWS * hidden, dtype=dtype, device=device)
            flags = symm_mem.empty(world * MAX_ROWS, dtype=torch.int32, device=device)
            flags.zero_()
            hd, hf = symm_mem.rendezvous(data, group_name), symm_mem.rendezvous(flags, group_name)
            bufs = torch.tensor(list(hd.buffer_ptrs), dtype=torch.int64, device=device)
            fl = torch.tensor(list(hf.buffer_ptrs), dtype=torch.int64, device=device)
            torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - any failure means: no peer path on this platform
            log.info("tensor parallel: peer-memory sums unavailable (%s: %s); NCCL does every sum",
                     type(e).__name__, e)
            return None
        return cls(rank, world, hidden, dtype, bufs, fl, [data, flags])

    def fits(self, residual: torch.Tensor) -> bool:
        """Whether a sum onto this residual stream [T, hidden] goes through peer memory."""
        return (residual.dim() == 2 and 0 < residual.shape[0] <= MAX_ROWS and residual.shape[1] == self.hidden
                and residual.dtype == self.dtype and residual.is_contiguous())

    def add(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
            eps: float) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(rms_norm(residual + sum) * weight, or None without weight; residual + sum), where sum is
        x summed over ranks. Every rank calls it with the same shapes, in the same order."""
        T, N = x.shape
        assert x.shape == residual.shape and x.dtype == residual.dtype and x.is_contiguous()
        summed = torch.empty_like(x)
        out = torch.empty_like(x) if weight is not None else summed
        BLOCK = triton.next_power_of_2(N)
        _peer_sum_kernel[(T,)](x, residual, weight if weight is not None else x, out, summed, self.bufs, self.flags,
                               self.count, N, eps, RANK=self.rank, WORLD=self.world, ROWS=MAX_ROWS, BLOCK=BLOCK,
                               NORM=weight is not None, num_warps=min(8, max(1, BLOCK // 256)))
        return (out if weight is not None else None), summed
