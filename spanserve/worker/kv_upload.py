"""Whole KV blocks from host memory into the paged pool in a few large transfers.

A tier hit of a long layout is thousands of blocks (an 8B model's 2 MiB each). Copied one block
at a time with a synchronising index upload per batch, the link idles between batches; here the
sources are first merged into runs (blocks that are consecutive views of one host buffer, as a
batched capture leaves them, travel as one copy), the destination ids go up once from pinned
memory, and on CUDA the host-to-device copies run on a side stream into two alternating device
buffers while the compute stream scatters the previous buffer into the pool, so nothing waits
for the host until the caller does.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Upload:
    """What to copy: `slots[i]` (unique pool block ids) receives row i of the concatenation of
    `runs` (each [n, 2, L, bs, KVH, D]), in order; or, when no two sources are adjacent in one
    host buffer (blocks the tier captured one by one), row i of `singles` (each one block)."""

    slots: np.ndarray
    runs: list[torch.Tensor]
    singles: list[torch.Tensor] | None = None


def plan(ids: list[int], kvs: list[torch.Tensor]) -> Upload:
    """Drop writes a later write to the same block overrides (as sequential copies would leave
    it: the last one wins; unique ids also keep the scatter deterministic) and merge consecutive
    views of one host buffer into runs."""
    if len(ids) != len(kvs):
        raise ValueError(f"{len(ids)} block ids for {len(kvs)} KV tensors")
    arr = np.asarray(ids, dtype=np.int64)
    keep = range(len(ids))
    if len(np.unique(arr)) != len(arr):
        _, first_from_end = np.unique(arr[::-1], return_index=True)
        keep = np.sort(len(arr) - 1 - first_from_end).tolist()
        arr = arr[keep]
    srcs = kvs if len(arr) == len(kvs) else [kvs[j] for j in keep]
    # a block continues the run before it when it is the next contiguous view of the same base
    # tensor (attribute reads per block, the comparison vectorized: a layout is thousands)
    ptrs = np.array([kv.data_ptr() for kv in srcs], dtype=np.int64)
    size = np.array([kv.nbytes for kv in srcs], dtype=np.int64)
    adjacent = ptrs[1:] == ptrs[:-1] + size[:-1]
    if not adjacent.any():  # nothing to merge: skip the per-block run building (host time the
        return Upload(arr, [], list(srcs))  # link would idle through before the first copy)
    bases = [kv._base for kv in srcs]
    contig = [kv.is_contiguous() for kv in srcs]
    joins = adjacent.tolist()
    runs: list[torch.Tensor] = []
    first = 0
    for j in range(1, len(srcs) + 1):
        if (j < len(srcs) and joins[j - 1] and contig[j] and contig[j - 1] and bases[j] is not None
                and bases[j] is bases[j - 1] and srcs[j].shape == srcs[first].shape
                and srcs[j].dtype == srcs[first].dtype):
            continue
        runs.append(_run(srcs[first], j - first))
        first = j
    return Upload(arr, runs)


def _run(first: torch.Tensor, n: int) -> torch.Tensor:
    """`first` and the n - 1 blocks after it in its base tensor, as one [n, ...] view."""
    if n == 1:
        return first.unsqueeze(0)
    return first.as_strided((n, *first.shape), (first.numel(), *first.stride()), first.storage_offset())


def upload(k: torch.Tensor, v: torch.Tensor, up: Upload, chunk_blocks: int,
           stream: "torch.cuda.Stream | None" = None) -> None:
    """Scatter `up` into the pool tensors k and v ([L, blocks, bs, KVH, D] each) through device
    buffers of `chunk_blocks` blocks. On CUDA (`stream`: the side stream the host-to-device
    copies run on) the copies are queued, not waited for; the caller's stream is ordered after
    them. Elsewhere the same steps run in order."""
    upload_parts([(k, 0, slice(None)), (v, 1, slice(None))], k.dtype, up, chunk_blocks, stream)


def upload_parts(parts: list[tuple[torch.Tensor, int, slice]], dtype: torch.dtype, up: Upload, chunk_blocks: int,
                 stream: "torch.cuda.Stream | None" = None) -> None:
    """`upload` into any pool tensors: each part (tensor [L, blocks, bs, KVH, w], K or V, columns)
    receives those columns of the K or V rows of blocks whose elements are `dtype` (an 8-bit pool:
    bytes, values then scale, `KVStorage`)."""
    n = len(up.slots)
    if n == 0:
        return
    k = parts[0][0]
    cuda = k.device.type == "cuda"
    if cuda and stream is None:
        raise ValueError("a CUDA upload needs its copy stream")
    main = torch.cuda.current_stream(k.device) if cuda else None
    idx = torch.from_numpy(up.slots)
    idx = idx.pin_memory().to(k.device, non_blocking=True) if cuda else idx
    chunk = max(1, min(chunk_blocks, n))
    dims = up.singles[0].shape if up.singles is not None else up.runs[0].shape[1:]
    bufs = [torch.empty((chunk, *dims), dtype=dtype, device=k.device) for _ in range(1 if n <= chunk else 2)]
    free: list["torch.cuda.Event | None"] = [None] * len(bufs)
    if cuda:
        stream.wait_stream(main)  # the buffers and the index were made on the compute stream
    loads = _pieces(up.runs, chunk) if up.singles is None else _singles(up.singles, chunk)
    for c, (lo, rows, pieces) in enumerate(loads):
        buf = bufs[c % len(bufs)][:rows]
        landed = _fill(buf, pieces, stream, free[c % len(bufs)], up.singles is not None)
        if landed is not None:
            main.wait_event(landed)
        for dst, which, cols in parts:
            dst.index_copy_(1, idx[lo: lo + len(buf)], buf[:, which, ..., cols].transpose(0, 1))
        if cuda:
            free[c % len(bufs)] = done = torch.cuda.Event()
            done.record(main)
    if cuda:
        for b in bufs:
            b.record_stream(stream)  # not handed out again before the side stream's copies finish


def _fill(buf: torch.Tensor, pieces: list[torch.Tensor], stream: "torch.cuda.Stream | None",
          free: "torch.cuda.Event | None", singles: bool = False) -> "torch.cuda.Event | None":
    """Copy `pieces` (runs [n, ...], or with `singles` one block each) into `buf` back to back;
    on CUDA on `stream`, after `free` (the scatter that last read this buffer), returning the
    event that marks them landed."""
    if singles:
        pieces = [p.unsqueeze(0) for p in pieces] if stream is None else pieces
    if stream is None:
        at = 0
        for src in pieces:
            buf[at: at + len(src)].copy_(src)
            at += len(src)
        return None
    with torch.cuda.stream(stream):
        if free is not None:
            stream.wait_event(free)
        # One foreach call queues every copy from C++: a Python loop of copy_ (and is_pinned) per
        # 2 MiB block enqueued more slowly than the link moves the bytes (59% of the pinned
        # ceiling on an H100). non_blocking is safe for pageable sources too (CUDA stages them).
        if singles:
            dsts = list(buf.unbind(0))
        else:
            dsts, at = [], 0
            for src in pieces:
                n = src.shape[0]
                dsts.append(buf.narrow(0, at, n))
                at += n
        torch._foreach_copy_(dsts, pieces, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record(stream)
    return landed


def _singles(blocks: list[torch.Tensor], chunk: int) -> Iterator[tuple[int, int, list[torch.Tensor]]]:
    for lo in range(0, len(blocks), chunk):
        part = blocks[lo: lo + chunk]
        yield lo, len(part), part


def _pieces(runs: list[torch.Tensor], chunk: int) -> Iterator[tuple[int, int, list[torch.Tensor]]]:
    """The runs cut at every multiple of `chunk` rows: (first row, rows, sources) of each buffer
    load, made as the loads go (the first copies start without waiting for the last cut)."""
    lo, rows, part = 0, 0, []
    for r in runs:
        at = 0
        while at < len(r):
            if rows == chunk:
                yield lo, rows, part
                lo, rows, part = lo + rows, 0, []
            take = min(chunk - rows, len(r) - at)
            part.append(r[at: at + take])
            at += take
            rows += take
    if part:
        yield lo, rows, part
