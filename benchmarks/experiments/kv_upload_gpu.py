"""Where a host-tier load's time goes on a GPU: pinned host blocks (one 2 MiB block of a
Llama-3-8B-shaped model each, as the host tier keeps them) into the paged pool, each stage timed
alone and the whole `KVStorage.write_blocks` path, against the link's one-copy ceiling.

    python benchmarks/experiments/kv_upload_gpu.py            # CUDA: 2048 blocks (4 GiB)
    python benchmarks/experiments/kv_upload_gpu.py --dry      # CPU: 64 blocks of a small shape, the script end to end
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, llama3_8b_config, write_json  # noqa: E402
from spanserve.worker import kv_upload  # noqa: E402
from spanserve.worker.storage import KVStorage  # noqa: E402


def timeit(fn: Callable[[], None], device: torch.device, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.dry else "cuda")
    cfg = llama3_8b_config()
    if args.dry:
        cfg = type(cfg)(**{**cfg.__dict__, "num_layers": 2, "num_kv_heads": 2, "head_dim": 16})
        args.blocks = 64
    n, bs, dtype, pin = args.blocks, 16, torch.bfloat16, dev.type == "cuda"
    storage = KVStorage(cfg, 2 * n, bs, dtype, dev)
    dims = (2, cfg.num_layers, bs, cfg.num_kv_heads, cfg.head_dim)
    blocks = [torch.empty(dims, dtype=dtype, pin_memory=pin).fill_(float(i % 13)) for i in range(n)]
    slab = torch.empty((n, *dims), dtype=dtype, pin_memory=pin)
    for i, b in enumerate(blocks):
        slab[i].copy_(b)
    nbytes = n * blocks[0].numel() * blocks[0].element_size()
    ids = np.random.default_rng(0).permutation(2 * n)[:n].tolist()
    dst = torch.empty((n, *dims), dtype=dtype, device=dev)
    idx = torch.tensor(ids, device=dev)
    rows = []

    def gbps(label: str, fn: Callable[[], None]) -> None:
        t = timeit(fn, dev)
        rows.append([label, f"{t * 1e3:.1f}", f"{nbytes / t / 1e9:.1f}"])

    gbps("one copy (slab -> device buffer)", lambda: dst.copy_(slab, non_blocking=True))
    gbps("a copy_ per block, Python loop (separate pinned blocks)",
         lambda: [dst[i].copy_(b, non_blocking=True) for i, b in enumerate(blocks)])
    gbps("foreach_copy_ per block (separate pinned blocks)",
         lambda: torch._foreach_copy_(list(dst.unbind(0)), blocks, non_blocking=True))
    gbps("scatter into the pool (index_copy_, device buffer -> k, v)",
         lambda: (storage.k.index_copy_(1, idx, dst[:, 0].transpose(0, 1)),
                  storage.v.index_copy_(1, idx, dst[:, 1].transpose(0, 1))))
    gbps("plan only (host: dedupe, runs)", lambda: kv_upload.plan(ids, blocks))
    up = kv_upload.plan(ids, blocks)
    chunk = 128 if not args.dry else 16
    stream = torch.cuda.Stream() if dev.type == "cuda" else None
    gbps("upload of a ready plan (separate pinned blocks)", lambda: kv_upload.upload(storage.k, storage.v, up, chunk, stream))
    big = 512 if not args.dry else 32
    gbps("upload of a ready plan, 1 GiB buffers", lambda: kv_upload.upload(storage.k, storage.v, up, big, stream))

    def copies_only() -> None:  # the same double-buffered copies on the side stream, no scatter
        bufs = [torch.empty((chunk, *dims), dtype=dtype, device=dev) for _ in range(2)]
        loads = kv_upload._pieces(up.runs, chunk) if up.singles is None else kv_upload._singles(up.singles, chunk)
        for c, (lo, rows, pieces) in enumerate(loads):
            kv_upload._fill(bufs[c % 2][:rows], pieces, stream, None, up.singles is not None)
    gbps("double-buffered copies only, no scatter", copies_only)
    gbps("write_blocks (separate pinned blocks)", lambda: storage.write_blocks(ids, blocks))
    gbps("write_blocks (views of one slab, in order)", lambda: storage.write_blocks(ids, list(slab.unbind(0))))
    got = storage.k[:, idx[:4]].transpose(0, 1).cpu()
    assert torch.equal(got, slab[:4, 0]), "write_blocks put the wrong bytes in the pool"
    print(format_table(["stage", "ms", "GB/s"], rows))
    print(f"{n} blocks of {blocks[0].numel() * blocks[0].element_size() / 2**20:.2f} MiB, {nbytes / 2**30:.2f} GiB")
    write_json("kv_upload_gpu_dry.json" if args.dry else "kv_upload_gpu.json",
               {"benchmark": "kv_upload_gpu", "blocks": n, "bytes": nbytes, "rows": rows})


if __name__ == "__main__":
    main()
