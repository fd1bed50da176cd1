"""Causal self-attention of one fresh prefill row (Llama-3-8B heads: 32 query, 8 KV, dim 128, bf16):
spanserve's Triton kernel over the paged cache versus torch SDPA's backends on dense q/k/v; and the
row's second half over all its keys (a later chunk of the prompt), paged kernel against the dense path.

    python3 benchmarks/experiments/prefill_attention.py [--tokens 16384]   # on a CUDA machine

A row whose keys are all written by the same step (no cached prefix, no deltas) can be attended
straight from the step's dense K/V; this measures what each way costs. Prints a table; writes
benchmarks/results/prefill_attention.json (or $OUT/prefill_attention.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_pkg = types.ModuleType("spanserve")
_pkg.__path__ = [str(ROOT / "spanserve")]
sys.modules.setdefault("spanserve", _pkg)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from spanserve.attention.plan import AttentionPlan, Row  # noqa: E402
from spanserve.attention.triton import TritonBackend  # noqa: E402
from spanserve.rope import Rotary  # noqa: E402

H, KVH, D, BS = 32, 8, 128, 16


class Timer:
    """Median ms of each variant (triton.testing.do_bench), its TFLOP/s and its error against a reference."""

    def __init__(self, flops: float):
        self.flops, self.rows, self.out = flops, [], {}

    def __call__(self, name, fn, ref=None, flops=None):
        """`flops`: the variant's own count, when it does less work than the whole row."""
        flops = self.flops if flops is None else flops
        try:
            o = fn()
            torch.cuda.synchronize()
        except Exception as e:  # a backend that does not take this shape
            self.rows.append((name, "n/a", str(e).splitlines()[0][:60]))
            self.out[name] = {"error": str(e)[:300]}
            return None
        ms = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
        err = "" if ref is None else f"{((o.float() - ref.float()).norm() / ref.float().norm()).item():.2e}"
        self.rows.append((name, f"{ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s", err))
        self.out[name] = {"ms": ms, "tflops": flops / ms / 1e9, "rel_err_vs_triton": err}
        return o


def triton_paged(timer: Timer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Triton over the paged cache (slots in order), as the engine runs a fresh row."""
    T, dev = q.shape[0], q.device
    nb = -(-T // BS)
    kc = torch.zeros(nb, BS, KVH, D, device=dev, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    kc.view(-1, KVH, D)[:T] = k
    vc.view(-1, KVH, D)[:T] = v
    pos = torch.arange(T, device=dev)
    plan = AttentionPlan([Row(0, T, pos, pos.clone())], pos, pos.clone())
    be = TritonBackend(dense_prefill=0)  # this row would otherwise take the dense path
    lay = be.prepare(plan, Rotary(D, 500000.0, None, dev), BS)
    return timer("triton (paged)", lambda: be.attend(lay, q, kc, vc))


def later_chunk(timer: Timer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The row's second half over all its keys (a fresh prompt's later chunk): the paged kernel
    against the dense path (cuDNN on its own keys causally and on the earlier ones in full, merged
    by log-sum-exp)."""
    T, dev = q.shape[0], q.device
    kc, vc = (x.view(-1, BS, KVH, D) for x in (k, v))
    first = T // 2
    pos = torch.arange(first, T, device=dev)
    plan = AttentionPlan([Row(0, T - first, pos, torch.arange(T, device=dev))], pos, pos.clone())
    ref = None
    for name, be in [("second half: triton (paged)", TritonBackend(dense_prefill=0)),
                     ("second half: dense (cuDNN x2 + merge)", TritonBackend())]:
        lay = be.prepare(plan, Rotary(D, 500000.0, None, dev), BS)
        # the second half sees 3/4 of the whole row's causal scores
        o = timer(name, lambda be=be, lay=lay: be.attend(lay, q[first:], kc, vc), ref, timer.flops * 3 / 4)
        ref = o if ref is None else ref


def sdpa_variants(timer: Timer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ref: torch.Tensor) -> None:
    T = q.shape[0]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, T, D] views
    ke, ve = kh.repeat_interleave(H // KVH, dim=1), vh.repeat_interleave(H // KVH, dim=1)
    qc, kec, vec = qh.contiguous(), ke.contiguous(), ve.contiguous()
    for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def gqa(b=b):
            with sdpa_kernel(b):
                return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)[0].transpose(0, 1).reshape(T, H * D)

        def expanded(b=b):
            with sdpa_kernel(b):
                return F.scaled_dot_product_attention(qh, ke, ve, is_causal=True)[0].transpose(0, 1).reshape(T, H * D)

        def expanded_c(b=b):  # contiguous [1, heads, T, D] inputs, as a copy in the step would give
            with sdpa_kernel(b):
                return F.scaled_dot_product_attention(qc, kec, vec, is_causal=True)
        timer(f"sdpa {b.name} gqa", gqa, ref)
        timer(f"sdpa {b.name} expanded", expanded, ref)
        timer(f"sdpa {b.name} contiguous expanded", expanded_c)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    T, dev = args.tokens, torch.device("cuda")
    torch.manual_seed(0)
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
    timer = Timer(4 * T * T / 2 * H * D)
    later_chunk(timer, q, k, v)
    sdpa_variants(timer, q, k, v, triton_paged(timer, q, k, v))
    print(f"{'variant':40s} {'time':28s} rel err vs triton")
    for r in timer.rows:
        print(f"{r[0]:40s} {r[1]:28s} {r[2]}")
    dest = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results") / "prefill_attention.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"tokens": T, "torch": torch.__version__, "results": timer.out}, indent=1))


if __name__ == "__main__":
    main()
