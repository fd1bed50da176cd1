"""What sealing a KV block payload costs: the seal alone over one block's bytes, and the tier
payload's encode and decode, per seal: the xxh3-128 checksum (no secret), HMAC-SHA256 (the MAC
the tiers use with a secret) and keyed BLAKE2b (the other candidate, hashlib's own code, swapped
into the same codec). One block of an 8B-shaped model by default: 32 layers x 16 tokens x 8 KV
heads x 128 dims, K and V, bf16 = 2 MiB. Best and median of --reps runs of --number calls, one
thread; a plain copy of the same bytes is the floor.

    python benchmarks/payload_mac.py            # writes benchmarks/results/payload_mac.json
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, write_json  # noqa: E402

from spanserve.cache.tiers.payload import SEAL_BYTES, BlockKV, BlockShape, PayloadCodec  # noqa: E402

SECRET = b"benchmark-secret-0123456789abcdef"


class Blake2bCodec(PayloadCodec):
    """The tier codec with keyed BLAKE2b (16-byte tag) in place of HMAC-SHA256."""

    def __init__(self, shape: BlockShape, fingerprint: bytes, secret: bytes):
        super().__init__(shape, fingerprint, secret)
        self._blake = hashlib.blake2b(key=secret, digest_size=SEAL_BYTES, person=b"spanserve-kv-v2")

    def _seal(self, key: int, body: memoryview) -> bytes:
        h = self._blake.copy()
        h.update(key.to_bytes(16, "little"))
        h.update(body)
        return h.digest()


def measure(fn: Callable[[], Any], number: int, reps: int) -> dict[str, float]:
    fn()
    runs = [t / number * 1e6 for t in timeit.repeat(fn, number=number, repeat=reps)]
    return {"best_us": min(runs), "median_us": statistics.median(runs)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--number", type=int, default=20, help="calls per timed run")
    ap.add_argument("--reps", type=int, default=7, help="timed runs")
    ap.add_argument("--out", default="payload_mac.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shape = BlockShape(args.layers, args.block_size, args.kv_heads, args.head_dim, torch.bfloat16)
    block = BlockKV(7, tuple(range(args.block_size)), torch.randn(shape.dims).to(torch.bfloat16))
    kv = memoryview(block.kv.view(torch.uint8).reshape(-1).numpy())
    fp = bytes(range(16))
    codecs = {"xxh3-128 checksum": PayloadCodec(shape, fp), "HMAC-SHA256": PayloadCodec(shape, fp, SECRET),
              "keyed BLAKE2b": Blake2bCodec(shape, fp, SECRET)}
    seals: dict[str, Callable[[], Any]] = {
        "copy (floor)": lambda: bytes(kv),
        "xxh3-128 checksum": lambda: xxhash.xxh3_128_digest(kv),
        "HMAC-SHA256": lambda: hmac.digest(SECRET, kv, "sha256"),
        "keyed BLAKE2b": lambda: hashlib.blake2b(kv, key=SECRET, digest_size=SEAL_BYTES).digest(),
    }
    rows, out = [], {}
    for name, seal in seals.items():
        res = {"seal": measure(seal, args.number, args.reps)}
        if name in codecs:
            codec = codecs[name]
            data = bytes(codec.encode(block))
            assert torch.equal(codec.decode(data, block.key).kv, block.kv)
            res["encode"] = measure(lambda c=codec: c.encode(block), args.number, args.reps)
            res["decode"] = measure(lambda c=codec, d=data: c.decode(d, block.key), args.number, args.reps)
        out[name] = res
        gbps = shape.kv_bytes / res["seal"]["best_us"] / 1e3
        rows.append([name, res["seal"]["best_us"], gbps] + [res[k]["best_us"] if k in res else "-"
                                                             for k in ("encode", "decode")])
    print(f"one block: {args.layers} layers x {args.block_size} tokens x {args.kv_heads} heads x {args.head_dim} "
          f"dims, K and V, bf16 = {shape.kv_bytes / 2**20:.2f} MiB (payload {shape.payload_bytes} bytes); "
          f"best of {args.reps} x {args.number} calls, microseconds")
    print(format_table(["seal", "seal us", "seal GB/s", "encode us", "decode us"], rows))
    path = write_json(args.out, {"args": vars(args), "kv_bytes": shape.kv_bytes,
                                 "payload_bytes": shape.payload_bytes, "results": out})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
