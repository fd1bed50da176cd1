"""Dense attention on Hopper's FP8 tensor cores through cuDNN (the `nvidia-cudnn-frontend` package).

torch's fused attention does not reach cuDNN's FP8 attention, the cudnn frontend's graphs do. On
Hopper that attention takes Q, K and V in e4m3 with one scale each (a tensor's, not a row's) and
writes O in e4m3 too, so a call here:
- rounds Q, K and V to e4m3 under a power-of-two scale per tensor (the least 2^k with the
  tensor's largest magnitude at most 448 * 2^k: dividing by it is exact, only the rounding loses);
- has cuDNN round the softmax's probabilities (at most 1) to e4m3 under 448, as FP8 attention
  kernels do;
- writes O under V's scale (O is a convex combination of V's rows, so it cannot overflow it) and
  returns it in bfloat16, with each query's log-sum-exp of scores when asked (to merge calls).
Graphs are built once per shape and kept. Everything here needs a CUDA device of compute
capability 9.0 or more and the package; `available()` says whether both are there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:
    import cudnn
except ImportError:  # optional: only FP8 prefill attention on Hopper uses it
    cudnn = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class Unsupported(RuntimeError):
    """cuDNN builds no FP8 attention for these shapes on this GPU."""


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
        self.usable = True  # False once cuDNN refuses even expanded heads: callers go back to bfloat16

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
        except Exception as e:  # the frontend raises its own error types; grouped heads are the usual refusal
            if k8.shape[1] == H:
                self.usable = False
                raise Unsupported(f"cuDNN has no FP8 attention for {key}: {e}") from e
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
