"""Peer-memory sums (spanserve/distributed/peer_sum.py) against NCCL's all-reduce followed by the
fused residual add and RMSNorm, on two GPUs: bitwise equality on random rows, then time per call
inside CUDA graphs of 64 calls (a decode step's count for an 8B model).

    NCCL_NVLS_ENABLE=0 python benchmarks/experiments/peer_sum_gpu.py
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, write_json  # noqa: E402

from spanserve.distributed.group import TPGroup, free_port  # noqa: E402
from spanserve.model import fused  # noqa: E402


def reference(group: TPGroup, x: torch.Tensor, res: torch.Tensor, w: torch.Tensor | None,
              eps: float) -> tuple[torch.Tensor | None, torch.Tensor]:
    s = group.all_reduce(x.clone())
    if w is None:
        return None, res + s
    return fused.add_rms_norm(s, res, w, eps)


def worker(rank: int, port: int, args: argparse.Namespace, out: dict) -> None:
    group = TPGroup.join(rank, 2, port, "cuda")
    dev = group.device
    H, dt, eps = args.hidden, torch.bfloat16, 1e-5
    group.enable_peer_sum(H, dt)
    assert group.peer is not None, "no peer memory on this machine"
    shared = torch.Generator(device=dev).manual_seed(1)
    own = torch.Generator(device=dev).manual_seed(100 + rank)
    checks, bad = 0, 0
    for it in range(args.iters):
        for T in (1, 3, 17, 64):
            x = torch.randn(T, H, generator=own, device=dev).to(dt)
            res = torch.randn(T, H, generator=shared, device=dev).to(dt)
            w = torch.randn(H, generator=shared, device=dev).to(dt) if it % 2 == 0 else None
            want = reference(group, x, res, w, eps)
            got = group.peer.add(x, res, w, eps)  # every row count the buffers hold, fused or not
            ok = torch.equal(got[1], want[1]) and (w is None or torch.equal(got[0], want[0]))
            checks += 1
            bad += not ok
    # the ranks agree bit for bit (their residual streams must stay equal)
    x = torch.randn(64, H, generator=own, device=dev).to(dt)
    res = torch.randn(64, H, generator=shared, device=dev).to(dt)
    _, mine = group.peer.add(x, res, None, eps)
    both = [torch.empty_like(mine) for _ in range(2)]
    torch.distributed.all_gather(both, mine)
    same_across = torch.equal(both[0], both[1])
    timing = {}
    for T in (1, 4, 8, 16, 64):
        x = torch.randn(T, H, generator=own, device=dev).to(dt)
        res = torch.randn(T, H, generator=shared, device=dev).to(dt)
        w = torch.randn(H, generator=shared, device=dev).to(dt)
        for name, fn in (("nccl + add_rms_norm", lambda: reference(group, x, res, w, eps)),
                         ("peer sum + add + norm", lambda: group.peer.add(x, res, w, eps))):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(64):
                    fn()
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.replays):
                g.replay()
            torch.cuda.synchronize()
            timing[f"{name}, T={T}"] = 1e6 * (time.perf_counter() - t0) / (args.replays * 64)
            del g
    if rank == 0:
        out.update(checks=checks, mismatches=bad, same_across_ranks=same_across, us_per_call=timing)
    torch.distributed.barrier()
    group.leave()


def run(rank: int, port: int, args: argparse.Namespace, q: "mp.Queue") -> None:
    out: dict = {}
    worker(rank, port, args, out)
    if rank == 0:
        q.put(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run, args=(r, port, args, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    print(f"{res['checks']} random sums (rows 1, 3, 17, 64; with and without the norm): "
          f"{res['mismatches']} differ from NCCL + add_rms_norm bitwise; ranks agree: {res['same_across_ranks']}")
    print(format_table(["per call, in CUDA graphs of 64", "us"], [(k, f"{v:.2f}") for k, v in res["us_per_call"].items()]))
    write_json("peer_sum_gpu.json", {"benchmark": "peer_sum_gpu", "args": vars(args), **res,
                                     "device": torch.cuda.get_device_name(0)})


if __name__ == "__main__":
    main(sys.argv[1:])
