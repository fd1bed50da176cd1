"""Batch-1 decode attention (Llama-3-8B heads: G = 4 query heads per KV head, head_dim 128) as a
TP=1 model (8 KV heads) and a TP=2 rank (4) see it, with the decode launch split along keys into
programs of at least 4, 2 or 1 tiles (`TritonBackend(decode_min_tiles=...)`). Each variant is checked
against the float32 reference backend, then timed as a CUDA graph of 32 layers' calls, each layer
over its own cache (as a model step runs them).

    python benchmarks/experiments/decode_attention_gpu.py
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, graph_us, write_json  # noqa: E402

from spanserve.attention.plan import AttentionPlan, Row  # noqa: E402
from spanserve.attention.reference import ReferenceBackend  # noqa: E402
from spanserve.attention.triton import TritonBackend  # noqa: E402
from spanserve.rope import Rotary  # noqa: E402

G, D, BS, LAYERS = 4, 128, 16, 32
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[640, 2048, 8192])
    ap.add_argument("--out", default="decode_attention_gpu.json")
    args = ap.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    rot = Rotary(D, 500000.0, LLAMA3, dev)
    rows, res = [], {}
    for kvh in (8, 4):
        H = G * kvh
        for n in args.contexts:
            nb = n // BS + 8
            blocks = list(range(1, nb + 1))
            random.Random(n).shuffle(blocks)
            slots = torch.tensor([blocks[i // BS] * BS + i % BS for i in range(n)], device=dev)
            row = Row(0, 1, torch.tensor([n - 1], device=dev), slots)
            plan = AttentionPlan([row], row.q_pos, slots[-1:])
            kcs = [torch.randn(nb + 1, BS, kvh, D, device=dev).to(dt) for _ in range(LAYERS)]
            vcs = [torch.randn(nb + 1, BS, kvh, D, device=dev).to(dt) for _ in range(LAYERS)]
            q = torch.randn(1, H, D, device=dev).to(dt)
            ref = ReferenceBackend()
            want = ref.attend(ref.prepare(plan, rot, BS), q.float(), kcs[0].float(), vcs[0].float())
            entry = {}
            for mt in (4, 2, 1):
                tb = TritonBackend(decode_min_tiles=mt, dense_prefill=0)
                lay = tb.prepare(plan, rot, BS)
                got = tb.attend(lay, q, kcs[0], vcs[0]).float()
                err = ((got - want).norm() / want.norm()).item()
                ways = tb.launches(lay, G, kvh)[0].split
                us = graph_us(lambda i, tb=tb, lay=lay: tb.attend(lay, q, kcs[i], vcs[i]), LAYERS, reps=30)
                entry[f"min_tiles {mt}"] = {"us": us, "ways": ways, "rel_err": err, "ok": err < 1e-2}
                rows.append((f"{kvh} KV heads, {n} keys", mt, ways, f"{us:.2f}", f"{err:.1e}"))
            res[f"kvh {kvh}, {n} keys"] = entry
            del kcs, vcs
            torch.cuda.empty_cache()
    print(format_table(["batch-1 decode", "min tiles", "ways", "us per layer", "rel err"], rows))
    write_json(args.out, {"benchmark": "decode_attention_gpu", "device": torch.cuda.get_device_name(0),
                          "results": res, "table": [list(map(str, r)) for r in rows]})


if __name__ == "__main__":
    main(sys.argv[1:])
