"""The sums of a short step's row-parallel projections through GPU peer memory, fused with the
residual add and RMSNorm that follow them.

A decode step sums [B, hidden] twice per layer. Through NCCL each sum is a kernel of ~7 us on two
H100s, then the residual add and the norm are kernels of their own. Here one kernel per sum does
all of it: every rank writes its partial row into each peer's buffer (torch symmetric memory maps
every rank's allocation on every GPU), waits for theirs, adds the partials in rank order (so every
rank holds the same bits, as NCCL's sum of two bf16 values gives them) and then applies the
residual add and the RMSNorm of the next sublayer.

Each 8-byte word sent carries two values and the row's epoch, as NCCL's low-latency protocol does:
an aligned 8-byte store lands whole, so a reader that sees the epoch in every word of a row has
the row, with no memory fence and no separate flag (a flag needs a system-scope release, which
cost about 2 us of the 5.7 a sum took). Each row has its own epoch counter (advanced by the
program that owns the row) and two buffer slots used in turn: a rank writes a peer's slot e % 2
at epoch e only after it has read that peer's row of epoch e - 1, which the peer wrote after it
finished reading the slot at epoch e - 2. A peer that never arrives leaves the kernel spinning,
as NCCL's would: the driver's monitor sees the dead worker and ends the process."""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger("spanserve.tp")

MAX_ROWS = 64  # rows a sum may have (decode batches up to 64): larger ones go to NCCL


@triton.jit
def _halves(words, DT: tl.constexpr):
    """The two 16-bit values of each 32-bit word, as float32 (low half first in memory)."""
    lo = (words & 0xFFFF).to(tl.uint16).to(DT, bitcast=True).to(tl.float32)
    hi = (words >> 16).to(tl.uint16).to(DT, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _word(lo, hi, DT: tl.constexpr):
    return lo.to(DT).to(tl.uint16, bitcast=True).to(tl.uint32) | (hi.to(DT).to(tl.uint16, bitcast=True).to(tl.uint32) << 16)


@triton.jit
def _peer_sum_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, sum_words_ptr, bufs_ptr, count_ptr, N, eps,
                     DT: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr, ROWS: tl.constexpr,
                     WORDS: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr):
    # x, res and sum_words are [T, N / 2] int32 views of 16-bit rows; sum is the same memory as
    # sum_words, as [T, N] values; bufs hold [2 slots, WORLD, ROWS, N / 2] uint64 words per rank.
    p = tl.program_id(0)
    P = N // 2
    i = tl.arange(0, WORDS)
    m = i < P
    e = tl.load(count_ptr + p) + 1
    slot = (e % 2) * WORLD
    row = p.to(tl.int64) * P
    xw = tl.load(x_ptr + row + i, mask=m, other=0).to(tl.uint32, bitcast=True)
    packed = (e.to(tl.uint64) << 32) | xw.to(tl.uint64)
    for r in tl.static_range(WORLD):
        if r != RANK:
            theirs = tl.load(bufs_ptr + r).to(tl.pointer_type(tl.uint64))
            tl.store(theirs + ((slot + RANK) * ROWS + p).to(tl.int64) * P + i, packed, mask=m)
    mine = tl.load(bufs_ptr + RANK).to(tl.pointer_type(tl.uint64))
    acc_lo = tl.zeros([WORDS], dtype=tl.float32)
    acc_hi = tl.zeros([WORDS], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            lo, hi = _halves(xw, DT)
        else:
            src = mine + ((slot + r) * ROWS + p).to(tl.int64) * P + i
            got = tl.load(src, mask=m, other=0, volatile=True)
            ready = ((got >> 32).to(tl.uint32) == e.to(tl.uint32)) | (i >= P)
            while tl.min(ready.to(tl.int32), axis=0) == 0:
                got = tl.load(src, mask=m, other=0, volatile=True)
                ready = ((got >> 32).to(tl.uint32) == e.to(tl.uint32)) | (i >= P)
            lo, hi = _halves(got.to(tl.uint32), DT)
        acc_lo += lo
        acc_hi += hi
    # the sum rounded as NCCL rounds it, then the residual added and rounded as torch adds
    r_lo, r_hi = _halves(tl.load(res_ptr + row + i, mask=m, other=0).to(tl.uint32, bitcast=True), DT)
    h_lo = acc_lo.to(DT).to(tl.float32) + r_lo
    h_hi = acc_hi.to(DT).to(tl.float32) + r_hi
    tl.store(sum_words_ptr + row + i, _word(h_lo, h_hi, DT).to(tl.int32, bitcast=True), mask=m)
    if NORM:  # as spanserve.model.fused's RMSNorm of a residual sum, over the row as it reads it
        tl.debug_barrier()  # the row just stored, read back whole by other threads of this program
        cols = tl.arange(0, BLOCK)
        cmask = cols < N
        mask = cmask[None, :]
        hf = tl.load(sum_ptr + p.to(tl.int64) * N + cols[None, :], mask=mask, other=0.0, volatile=True).to(tl.float32)
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(hf * hf, axis=1) / N + eps))
        normed = (hf * inv[:, None]).to(DT).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + p.to(tl.int64) * N + cols[None, :], (normed * w[None, :]).to(DT), mask=mask)
    tl.store(count_ptr + p, e)


class PeerSum:
    """One rank's peer-memory sums for rows of `hidden` values of `dtype`."""

    def __init__(self, rank: int, world: int, hidden: int, dtype: torch.dtype, bufs: torch.Tensor,
                 keep: list[torch.Tensor]):
        self.rank, self.world, self.hidden, self.dtype = rank, world, hidden, dtype
        self.bufs = bufs  # int64 device addresses, one per rank
        self.count = torch.zeros(MAX_ROWS, dtype=torch.int32, device=bufs.device)
        self._keep = keep  # the symmetric allocation the addresses point into

    @classmethod
    def make(cls, rank: int, world: int, hidden: int, dtype: torch.dtype, device: torch.device,
             group_name: str) -> "PeerSum | None":
        """Collective over the group. None where peer memory is not available (NCCL then sums)."""
        if hidden % 2 or torch.finfo(dtype).bits != 16:
            return None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            data = symm_mem.empty(2 * world * MAX_ROWS * hidden // 2, dtype=torch.int64, device=device)
            data.zero_()  # epoch 0 in every word: no row of epoch >= 1 is there yet
            hd = symm_mem.rendezvous(data, group_name)
            bufs = torch.tensor(list(hd.buffer_ptrs), dtype=torch.int64, device=device)
            torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - any failure means: no peer path on this platform
            log.info("tensor parallel: peer-memory sums unavailable (%s: %s); NCCL does every sum",
                     type(e).__name__, e)
            return None
        return cls(rank, world, hidden, dtype, bufs, [data])

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
        _peer_sum_kernel[(T,)](x.view(torch.int32), residual.view(torch.int32), weight if weight is not None else x,
                               out, summed, summed.view(torch.int32), self.bufs, self.count, N, eps, DT=_TL[x.dtype], RANK=self.rank,
                               WORLD=self.world, ROWS=MAX_ROWS, WORDS=triton.next_power_of_2(N // 2),
                               BLOCK=triton.next_power_of_2(N), NORM=weight is not None,
                               num_warps=min(8, max(1, triton.next_power_of_2(N) // 256)))
        return (out if weight is not None else None), summed


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
