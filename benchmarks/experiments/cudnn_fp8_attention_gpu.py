"""cuDNN's FP8 attention (through the cudnn frontend) against its bfloat16 attention, one GPU.

torch's fused attention does not reach cuDNN's FP8 attention; the `nvidia-cudnn-frontend`
package's graphs do. On Hopper that attention takes Q, K and V in e4m3 with one scale per tensor
(not per row, as the 8-bit KV cache keeps them) and writes O in e4m3 too. `Fp8Attention` below:
- rounds Q, K and V to e4m3 under a power-of-two scale each (the least 2^k with the tensor's
  largest magnitude at most 448 * 2^k);
- has cuDNN round the softmax's probabilities (at most 1) to e4m3 under 448;
- writes O under V's scale (a convex combination of V's rows cannot overflow it) and returns it
  in bfloat16, with each query's log-sum-exp when asked (to merge two calls);
- builds a graph per shape (~4 ms), queries and a causal call's keys padded with zero rows to a
  multiple of 256 (causally no real query sees them), so prompt lengths share graphs.
Measured on a fresh prompt's causal attention, the shape the engine's dense rows take, at
Llama-3-8B heads (32 query heads over 8 KV heads, dim 128): a whole `--tokens` row, and its
second half over all its keys (a later chunk: its own keys causally and the earlier ones in full,
merged by their log-sum-exps); bfloat16 through the engine's dense path (torch's cuDNN op).
Errors against float32 attention on a `--check-tokens` row. Findings: docs/fp8.md.

    pip install nvidia-cudnn-frontend   # on the GPU machine, beside torch
    python benchmarks/experiments/cudnn_fp8_attention_gpu.py    # results/cudnn_fp8_attention_gpu.json
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import format_table, write_json  # noqa: E402
from fp8_dense_attention_gpu import _rel, reference  # noqa: E402  (the float32 reference, the error)
from spanserve.attention.triton import dense  # noqa: E402

try:
    import cudnn  # the nvidia-cudnn-frontend package
except ImportError:
    cudnn = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def available(device: torch.device) -> bool:
    return (cudnn is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (9, 0))


def tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """The least power of two 2^k with max|x| <= 448 * 2^k, a float32 [1, 1, 1, 1] on x's device
    (no host synchronisation)."""
    amax = torch.linalg.vector_norm(x, float("inf")).float().clamp_min(2.0 ** -120)
    return torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX))).reshape(1, 1, 1, 1)


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3; the division, by a power of two, is exact in x's own type."""
    return (x * (1.0 / scale).reshape(()).to(x.dtype)).to(FP8)


def bucket(n: int) -> int:
    """n rounded up to a multiple of 256: the rows of a causal call's queries and keys, so that
    prompts of every length share a few graphs (a new one takes ~5 ms to build). Rows past n are
    zero and come after every real one, so causally no real query sees them; a call over keys in
    full takes them as they are."""
    return -(-n // 256) * 256


def padded(rows: int, heads: int, dim: int, device: torch.device, exact: bool = False) -> torch.Tensor:
    """An e4m3 [bucket(rows) (or rows, if exact), heads, dim] buffer whose rows past `rows` are zero."""
    out = torch.empty(rows if exact else bucket(rows), heads, dim, dtype=FP8, device=device)
    out[rows:].zero_()
    return out


@dataclass
class _Graph:
    graph: object
    inputs: tuple
    outputs: tuple
    workspace: torch.Tensor


def _token_major(heads: int, n: int, d: int) -> dict:
    """Dims (batch, heads, tokens, dim) and strides of a [n, heads, d] token-major tensor."""
    return {"dim": [1, heads, n, d], "stride": [n * heads * d, d, heads * d, 1]}


class Fp8Attention:
    """cuDNN FP8 attention graphs by shape, on one device."""

    def __init__(self) -> None:
        self._handle = None
        self._graphs: dict[tuple, _Graph] = {}
        self.grouped = True  # K and V with fewer heads than Q in the call; False once cuDNN refuses them

    def _build(self, key: tuple) -> _Graph:
        n_q, n_k, H, KVH, D, causal, stats = key
        if self._handle is None:
            self._handle = cudnn.create_handle()
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32,
                          handle=self._handle)
        tq = g.tensor(name="q", data_type=e4m3, **_token_major(H, n_q, D))
        tk, tv = (g.tensor(name=n, data_type=e4m3, **_token_major(KVH, n_k, D)) for n in ("k", "v"))
        one = {"dim": [1, 1, 1, 1], "stride": [1, 1, 1, 1]}
        scalars = [g.tensor(name=n, data_type=f32, **one)
                   for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")]
        o, lse, amax_s, amax_o = g.sdpa_fp8(q=tq, k=tk, v=tv, descale_q=scalars[0], descale_k=scalars[1],
                                             descale_v=scalars[2], descale_s=scalars[3], scale_s=scalars[4],
                                             scale_o=scalars[5], generate_stats=stats,
                                             attn_scale=1.0 / math.sqrt(D), use_causal_mask=causal, name="sdpa")
        o.set_output(True).set_data_type(e4m3).set_dim(_token_major(H, n_q, D)["dim"]).set_stride(
            _token_major(H, n_q, D)["stride"])
        outputs = [o]
        if stats:
            lse.set_output(True).set_dim([1, H, n_q, 1]).set_stride([H * n_q, n_q, 1, 1]).set_data_type(f32)
            outputs.append(lse)
        for a in (amax_s, amax_o):
            a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        outputs += [amax_s, amax_o]
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
        return _Graph(g, (tq, tk, tv, *scalars), tuple(outputs), ws)

    def _graph(self, key: tuple) -> _Graph:
        gr = self._graphs.get(key)
        if gr is None:
            gr = self._graphs[key] = self._build(key)
        return gr

    def attend_e4m3(self, q8: torch.Tensor, sq: torch.Tensor, k8: torch.Tensor, sk: torch.Tensor, v8: torch.Tensor,
                    sv: torch.Tensor, n_q: int, causal: bool, stats: bool = False,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of q8's rows over all of k8/v8's (e4m3, token-major [rows, heads, D], x = x8
        * sx), causal from the first key (q8 and k8 then of equal rows) or full; its first n_q
        rows: [n_q, H, D] bfloat16, and with `stats` each query's natural log-sum-exp of scaled
        scores, float32 [H, n_q]."""
        H, D, KVH = q8.shape[1], q8.shape[2], k8.shape[1]
        if not self.grouped and KVH != H:
            k8, v8 = k8.repeat_interleave(H // KVH, 1), v8.repeat_interleave(H // KVH, 1)
        rows = q8.shape[0]
        key = (rows, k8.shape[0], H, k8.shape[1], D, causal, stats)
        try:
            gr = self._graph(key)
        except Exception:  # the frontend raises its own error types; grouped heads are the usual refusal
            if k8.shape[1] == H:
                raise
            self.grouped = False
            return self.attend_e4m3(q8, sq, k8, sk, v8, sv, n_q, causal, stats)
        dev = q8.device
        s_scale = torch.full((1, 1, 1, 1), FP8_MAX, device=dev)
        o8 = torch.empty(rows, H, D, dtype=FP8, device=dev)
        lse = torch.empty(H, rows, dtype=torch.float32, device=dev) if stats else None
        amax = torch.empty(2, 1, 1, 1, device=dev)
        pack = dict(zip(gr.inputs, [q8, k8, v8, sq, sk, sv, 1.0 / s_scale, s_scale, 1.0 / sv]))
        outs = [o8] + ([lse.view(1, H, rows, 1)] if stats else []) + [amax[0:1], amax[1:2]]
        pack.update(zip(gr.outputs, outs))
        cudnn.set_stream(handle=self._handle, stream=torch.cuda.current_stream(dev).cuda_stream)
        gr.graph.execute(pack, gr.workspace, handle=self._handle)
        o = (o8[:n_q].to(torch.float32) * sv.reshape(())).to(torch.bfloat16)
        return o, (lse[:, :n_q] if stats else None)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, stats: bool = False,
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As `attend_e4m3`, from q [n_q, H, D] and k/v [n_k, KVH, D] in bfloat16, each rounded
        under its `tensor_scale` (a causal call's q and k of equal length, padded to `bucket`)."""
        parts = []
        for x in (q, k, v):
            s = tensor_scale(x)
            x8 = padded(x.shape[0], x.shape[1], x.shape[2], x.device, exact=not causal and x is not q)
            x8[:x.shape[0]] = to_e4m3(x, s)
            parts += [x8, s]
        return self.attend_e4m3(*parts, q.shape[0], causal, stats)


H, KVH, D = 32, 8, 128


def inputs(T: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, D, generator=g, device="cuda") * 2
    k, v = (torch.randn(T, KVH, D, generator=g, device="cuda") * (1 + 3 * torch.rand(T, KVH, 1, generator=g, device="cuda"))
            for _ in range(2))
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def bf16_row(q, k, v):
    """The engine's dense path (`dense._sdpa`, or `dense._tail` for a later chunk), token-major."""
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))
    o = dense._sdpa(qh, kh, vh) if q.shape[0] == k.shape[0] else dense._tail(qh, kh, vh)
    return o[0].transpose(0, 1)


def fp8_row(att, q, k, v):
    first = k.shape[0] - q.shape[0]
    if first == 0:
        return att.attend(q, k, v, True)[0]
    o_own, lse_own = att.attend(q, k[first:], v[first:], True, True)
    o_pre, lse_pre = att.attend(q, k[:first], v[:first], False, True)
    return dense.merge(o_own, lse_own.T.unsqueeze(-1), o_pre, lse_pre.T.unsqueeze(-1)).bfloat16()


def main(argv: list[str]) -> None:
    import triton.testing

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--check-tokens", type=int, default=4096)
    ap.add_argument("--out", default="cudnn_fp8_attention_gpu.json")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    if not available(dev):
        raise SystemExit("needs a Hopper GPU and the nvidia-cudnn-frontend package")
    att = Fp8Attention()
    info = {"cudnn_backend": cudnn.backend_version(), "cudnn_frontend": cudnn.__version__,
            "torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
    print(info)

    T = args.check_tokens
    q, k, v = inputs(T, 1)
    err = []
    for first in (0, T // 2):
        ref = reference(q[first:], k, v)
        err.append([f"{T - first} queries over {T} keys", _rel(bf16_row(q[first:], k, v).flatten(1), ref),
                    _rel(fp8_row(att, q[first:], k, v).flatten(1), ref)])
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
        s = tensor_scale(x)
        x8 = padded(T, x.shape[1], D, dev)
        x8[:T] = to_e4m3(x, s)
        parts += [x8, s]
    timed("cuDNN fp8, attention only", 0, lambda: att.attend_e4m3(*parts, T, True))
    timed("rounding q, k, v to e4m3", 0, lambda: [to_e4m3(x, tensor_scale(x)) for x in (q, k, v)])
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
