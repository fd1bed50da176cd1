"""A prefill launch's key copies beside the attention of the layer before, one GPU.

A warm 32-document RAG request (91,424 keys, 96 queries, Llama-3-8B heads) attends over its keys
in 32 layers, each first copying the keys into scratch, rotated to where they are read: bfloat16
keys alone, or an 8-bit cache's keys and values, dequantized. The copies read the cache alone, so
a layer's could run on a side stream while the layer before attends. This times 32 layers of the
attention kernel alone, of the copies alone, of both in order, and of both with each layer's
copies a layer ahead on a side stream (after all the main stream holds, or ordered once and then
free to run ahead). On an H100 the copies ahead take as long as in order: the attention kernel
leaves them no room (docs/fp8.md).

    python benchmarks/experiments/staging_overlap_gpu.py    # results/staging_overlap_gpu.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import format_table, write_json  # noqa: E402
from spanserve.attention.kv_cache import Fp8Cache, quantize  # noqa: E402
from spanserve.attention.plan import AttentionPlan, Row  # noqa: E402
from spanserve.attention.triton import TritonBackend  # noqa: E402
from spanserve.attention.triton.launch import Prerotation  # noqa: E402
from spanserve.attention.triton.backend import rotate_keys  # noqa: E402
from spanserve.rope import Rotary  # noqa: E402

H, KVH, D, BS = 32, 8, 128, 16


def main(argv: list[str]) -> None:
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=91424)
    ap.add_argument("--queries", type=int, default=96)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--out", default="staging_overlap_gpu.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    dev, N, NQ, L = torch.device("cuda"), args.keys, args.queries, args.layers
    g = torch.Generator(device=dev).manual_seed(0)
    blocks = N // BS + 8
    kc, vc = (torch.randn(blocks, BS, KVH, D, generator=g, device=dev).bfloat16() for _ in range(2))
    k8, v8 = (Fp8Cache(*quantize(torch.randn(blocks, BS, KVH, D, device=dev, generator=g))) for _ in range(2))
    slots = torch.randperm(blocks * BS, generator=g, device=dev)[:N]
    q = torch.randn(NQ, H, D, generator=g, device=dev).bfloat16()
    pos = torch.arange(N - NQ, N, device=dev)
    rot = Rotary(D, 500000.0, None, dev)
    be = TritonBackend(dense_prefill=0)
    lay = be.prepare(AttentionPlan([Row(0, NQ, pos, slots)], pos, slots[N - NQ:].clone()), rot, BS)
    pre = Prerotation(slots.int(), torch.randint(1, 90000, (N,), device=dev, dtype=torch.int32))
    inv = rot.inv_freq.float().to(dev)
    side = torch.cuda.Stream()

    def attention():
        return be.attend(lay, q, kc, vc)

    copies = {"bf16 keys": lambda: rotate_keys(kc, pre, inv, torch.bfloat16),
              "8-bit keys and values": lambda: rotate_keys(k8, pre, inv, torch.bfloat16, v8)}

    def in_order(copy):
        for _ in range(L):
            copy()
            attention()

    def ahead(copy, wait_each: bool):
        """Layer i's copies on the side stream, started before layer i - 1 attends: after all the
        main stream holds (wait_each), or ordered once, at the first layer, and then free to run
        ahead (scratch taken from the side stream's memory, marked as read on the main stream)."""
        main = torch.cuda.current_stream()
        ready, keep = [], []
        for i in range(L + 1):
            if i < L:
                if wait_each or i == 0:
                    side.wait_stream(main)
                with torch.cuda.stream(side):
                    made = copy()
                    for t in made:
                        if t is not None:
                            t.record_stream(main)
                    keep.append(made)
                    ready.append(torch.cuda.Event())
                    ready[-1].record(side)
            if i:
                main.wait_event(ready[i - 1])
                attention()
        main.wait_stream(side)

    runs = {"attention alone": lambda: [attention() for _ in range(L)]}
    for name, copy in copies.items():
        runs[f"{name}: copies alone"] = lambda copy=copy: [copy() for _ in range(L)]
        runs[f"{name}: copies, then attention"] = lambda copy=copy: in_order(copy)
        runs[f"{name}: copies a layer ahead, each after the layer before"] = lambda copy=copy: ahead(copy, True)
        runs[f"{name}: copies a layer ahead, ordered once"] = lambda copy=copy: ahead(copy, False)
    res = {}
    for name, fn in runs.items():
        fn()
        torch.cuda.synchronize()
        res[name] = triton.testing.do_bench(fn, warmup=3, rep=100, return_mode="median")
    print(f"{L} layers, {NQ} queries over {N} keys, {torch.cuda.get_device_name()}")
    print(format_table(["what", "ms"], [[k, v] for k, v in res.items()]))
    path = write_json(args.out, {"benchmark": "staging_overlap_gpu", "device": torch.cuda.get_device_name(),
                                 "args": vars(args), "ms": res})
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
