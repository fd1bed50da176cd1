"""cuDNN's FP8 attention (through the cudnn frontend) against its bfloat16 attention, one GPU.

A fresh prompt's causal attention, the shape the engine's dense rows take, Llama-3-8B heads
(32 query heads over 8 KV heads, dim 128): a whole `--tokens` row, and its second half over all
its keys (a later chunk: its own keys causally and the earlier ones in full, merged by their
log-sum-exps). bfloat16 through torch's cuDNN op, FP8 through `spanserve.attention.cudnn_fp8`
(Q, K, V rounded to e4m3 under a power-of-two scale per tensor; O in e4m3 under V's), timed with
and without the rounding passes. Errors against float32 attention on a `--check-tokens` row.

    python benchmarks/experiments/cudnn_fp8_attention_gpu.py    # results/cudnn_fp8_attention_gpu.json
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import format_table, write_json  # noqa: E402
from spanserve.attention import cudnn_fp8  # noqa: E402

H, KVH, D = 32, 8, 128


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 causal attention of q [n_q, H, D], the last n_q of the keys' positions."""
    n_q, n = q.shape[0], k.shape[0]
    out = torch.empty(n_q, H, D, device=q.device)
    visible = torch.arange(n, device=q.device)[None, :] <= torch.arange(n - n_q, n, device=q.device)[:, None]
    for h in range(H):
        s = (q[:, h].float() @ k[:, h * KVH // H].float().T) / math.sqrt(D)
        out[:, h] = s.masked_fill(~visible, float("-inf")).softmax(-1) @ v[:, h * KVH // H].float()
    return out


def inputs(T: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, D, generator=g, device="cuda") * 2
    k, v = (torch.randn(T, KVH, D, generator=g, device="cuda") * (1 + 3 * torch.rand(T, KVH, 1, generator=g, device="cuda"))
            for _ in range(2))
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def merge(o_own, lse_own, o_pre, lse_pre):
    """Two partial attentions over disjoint keys, [n, H, D] and [H, n] each, into one."""
    top = torch.maximum(lse_own, lse_pre)
    w_own, w_pre = (lse_own - top).exp(), (lse_pre - top).exp()
    total = w_own + w_pre
    w_own, w_pre = (w_own / total).T.unsqueeze(-1), (w_pre / total).T.unsqueeze(-1)
    return (o_own.float() * w_own + o_pre.float() * w_pre).bfloat16()


def bf16_call(q, k, v, causal):
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True, 0.0, causal, False)
    return out[0][0].transpose(0, 1), out[1].reshape(H, -1).float()


def bf16_row(q, k, v):
    first = k.shape[0] - q.shape[0]
    if first == 0:
        return bf16_call(q, k, v, True)[0]
    return merge(*bf16_call(q, k[first:], v[first:], True), *bf16_call(q, k[:first], v[:first], False))


def fp8_row(att, q, k, v):
    first = k.shape[0] - q.shape[0]
    if first == 0:
        return att.attend(q, k, v, True)[0]
    return merge(*att.attend(q, k[first:], v[first:], True, True), *att.attend(q, k[:first], v[:first], False, True))


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv: list[str]) -> None:
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--check-tokens", type=int, default=4096)
    ap.add_argument("--out", default="cudnn_fp8_attention_gpu.json")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    if not cudnn_fp8.available(dev):
        raise SystemExit("needs a Hopper GPU and the nvidia-cudnn-frontend package")
    att = cudnn_fp8.Fp8Attention()
    info = {"cudnn_backend": cudnn_fp8.cudnn.backend_version(), "cudnn_frontend": cudnn_fp8.cudnn.__version__,
            "torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    print(info)

    T = args.check_tokens
    q, k, v = inputs(T, 1)
    err = []
    for first in (0, T // 2):
        ref = reference(q[first:], k, v)
        err.append([f"{T - first} queries over {T} keys", _rel(bf16_row(q[first:], k, v), ref),
                    _rel(fp8_row(att, q[first:], k, v), ref)])
    print(format_table(["row", "bf16 cuDNN err", "fp8 cuDNN err"], err))

    T = args.tokens
    q, k, v = inputs(T, 0)
    half = T // 2
    flops = {0: 4 * T * T / 2 * H * D, half: 4 * T * T / 2 * H * D * 3 / 4}
    rows, res = [], {}

    def timed(what, first, fn):
        fn()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        rows.append([what, {0: "whole row", -1: "whole row"}.get(first, "second half"), ms, flops[first] / ms / 1e9])
        res[f"{what}, {rows[-1][1]}"] = {"ms": ms, "tflops": rows[-1][3]}

    for first in (0, half):
        timed("cuDNN bf16", first, lambda first=first: bf16_row(q[first:], k, v))
        timed("cuDNN fp8, with rounding", first, lambda first=first: fp8_row(att, q[first:], k, v))
    # the attention alone: inputs already in e4m3
    parts = []
    for x in (q, k, v):
        s = cudnn_fp8.tensor_scale(x)
        x8 = cudnn_fp8.padded(T, x.shape[1], D, dev)
        x8[:T] = cudnn_fp8.to_e4m3(x, s)
        parts += [x8, s]
    timed("cuDNN fp8, attention only", 0, lambda: att.attend_e4m3(*parts, T, True))
    timed("rounding q, k, v to e4m3", 0, lambda: [cudnn_fp8.to_e4m3(x, cudnn_fp8.tensor_scale(x)) for x in (q, k, v)])
    # a length off the 256-row buckets (padded), and a new graph's build time
    n = T - 100
    t0 = time.perf_counter()
    att.attend(q[:n], k[:n], v[:n], True)
    torch.cuda.synchronize()
    info["graph_build_s"] = time.perf_counter() - t0
    flops[-1] = 4 * n * n / 2 * H * D
    timed(f"cuDNN fp8, with rounding, {n} tokens", -1, lambda: att.attend(q[:n], k[:n], v[:n], True))
    info["grouped_heads"] = att.grouped
    print(format_table(["call", "queries", "ms", "TFLOP/s"], rows))
    print(info)
    path = write_json(args.out, {"benchmark": "cudnn_fp8_attention_gpu", **info, "tokens": args.tokens,
                                 "check_tokens": args.check_tokens,
                                 "errors": [dict(zip(["row", "err_bf16", "err_fp8"], r)) for r in err],
                                 "timings": res})
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
