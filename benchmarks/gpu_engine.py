"""The whole engine on one GPU against the hardware (random Llama-3-8B-shaped bf16 weights, Triton,
CUDA graphs), in one run:

1. the bf16 matmul peak and the device copy bandwidth, measured first (they vary by machine);
2. prefill of --prefill plain tokens: achieved TFLOP/s against that peak;
3. decode at batch 1: step time (synced each step) and inter-token latency against the
   weight-bandwidth bound (weight bytes / copy bandwidth);
4. decode at batch 1 over a --long-context context: the decode launch split along keys (the
   default: 8 programs, one per KV head, would leave 124 SMs idle) against unsplit.

Each engine is shut down before the next is built. Correctness of the same paths (tokens and
logits against the CPU engine, the reference backend and eager steps) is tests/gpu/.

    python benchmarks/gpu_engine.py [--prefill 16384] [--decode-steps 32] [--long-context 16384]
    python benchmarks/gpu_engine.py --dry      # CPU, small model: checks the script, not the GPU
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from common import format_table, llama3_8b_config, median, random_model, tiny_llama_config, write_json
from spanserve import SamplingParams
from spanserve.engine.config import EngineConfig
from spanserve.engine.engine import LLMEngine
from spanserve.model.loader import LoadedModel


class Bench:
    def __init__(self, model: LoadedModel, dry: bool):
        self.model, self.dry = model, dry
        self.dev = "cpu" if dry else "cuda"
        self.vocab = model.config.vocab_size - 256
        self.gen = torch.Generator().manual_seed(2)
        self.rows: list[tuple[str, str, str]] = []

    def sync(self) -> None:
        if not self.dry:
            torch.cuda.synchronize()

    def engine(self, split: int | None = None, **kw) -> LLMEngine:
        backend = None
        if not self.dry:
            from spanserve.attention.triton import TritonBackend
            backend = TritonBackend(split_programs=split)
        return LLMEngine(EngineConfig.from_kwargs(model=self.model, device=self.dev, dtype="bfloat16", backend=backend,
                                                 **kw))

    def free(self, eng: LLMEngine) -> None:
        """Shut an engine down and give its memory back before the next one is built."""
        eng.shutdown()
        del eng
        gc.collect()
        if not self.dry:
            torch.cuda.empty_cache()

    def tokens(self, n: int) -> list[int]:
        return torch.randint(3, self.vocab, (n,), generator=self.gen).tolist()

    def synced_step(self, eng: LLMEngine) -> float:
        """Seconds of one engine step with the device idle before and after it."""
        self.sync()
        t0 = time.perf_counter()
        eng.step()
        self.sync()
        return time.perf_counter() - t0

    def itl(self, eng: LLMEngine, prompt: list[int], steps: int) -> float:
        """Seconds per decode step of an uninterrupted run at batch 1, after prefill and 4 steps."""
        eng.add_request(prompt, SamplingParams(max_tokens=steps + 6, ignore_eos=True, temperature=0))
        for _ in range(4):
            eng.step()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        self.sync()
        dt = (time.perf_counter() - t0) / steps
        while eng.has_unfinished():
            eng.step()
        return dt


def peaks() -> tuple[float, float]:
    """(bf16 matmul TFLOP/s at 8192^3, device copy GB/s counting bytes read and written)."""
    import triton.testing as tt
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = tt.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    tflops = 2 * 8192 ** 3 / ms / 1e9
    x = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)  # 512 MiB
    y = torch.empty_like(x)
    ms = tt.do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
    return tflops, 2 * x.numel() * 2 / ms / 1e6


def prefill_flops(model: LoadedModel, n: int) -> float:
    c = model.config
    matmul_params = sum(v.numel() for k, v in model.weights.items() if k.endswith("proj.weight")) \
        + c.vocab_size * c.hidden_size / n
    return 2 * matmul_params * n + 2 * 2 * c.num_layers * c.num_heads * c.head_dim * n * n / 2


def prefill_and_decode(b: Bench, n_prefill: int, steps: int, peak_tflops: float, gbps: float) -> dict:
    eng = b.engine(max_num_batched_tokens=n_prefill + 16, num_blocks=(n_prefill // 16) * 3 + 64)
    times = []
    for _ in range(3):
        eng.add_request(b.tokens(n_prefill), SamplingParams(max_tokens=1))
        times.append(b.synced_step(eng))
    t = median(times[1:])
    achieved = prefill_flops(b.model, n_prefill) / t / 1e12
    b.rows.append((f"prefill {n_prefill} plain tokens", f"{t * 1e3:.1f} ms",
                   f"{achieved:.0f} TFLOP/s = {achieved / peak_tflops:.0%} of peak"))
    # Decode at batch 1, two ways: each step between device syncs (host and device strictly in
    # series), and the inter-token latency of an uninterrupted run of steps (what a user sees).
    eng.add_request(b.tokens(512), SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    step_t = []
    while eng.has_unfinished():
        step_t.append(b.synced_step(eng))
    d = median(step_t[3:])
    itl = median([b.itl(eng, b.tokens(512), steps) for _ in range(3)])
    b.free(eng)
    weight_bytes = sum(v.numel() * v.element_size() for k, v in b.model.weights.items()
                       if k != "model.embed_tokens.weight")
    bound = weight_bytes / (gbps * 1e9)
    b.rows.append(("decode batch 1 step (synced each step)", f"{d * 1e3:.2f} ms",
                   f"bound {bound * 1e3:.2f} ms ({d / bound:.2f}x)"))
    b.rows.append(("decode batch 1 inter-token latency", f"{itl * 1e3:.2f} ms",
                   f"bound {bound * 1e3:.2f} ms ({itl / bound:.2f}x)"))
    return {"prefill_s": t, "prefill_tflops": achieved, "decode_step_s": d, "decode_itl_s": itl, "decode_bound_s": bound}


def long_decode(b: Bench, n_ctx: int, steps: int) -> dict:
    """Batch-1 decode over an n_ctx-token context: the backend's split decode launch against one
    never split, the two engines taking turns (median of 3 runs each)."""
    kw = dict(max_num_batched_tokens=n_ctx + 16, num_blocks=n_ctx // 16 + 64)
    engines = {"split": b.engine(None, **kw), "unsplit": b.engine(0, **kw)}
    prompt = b.tokens(n_ctx)
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(3):
        for name, eng in engines.items():
            times[name].append(b.itl(eng, prompt, steps))
    res = {k: median(v) for k, v in times.items()}
    ways = sorted(w for _, w in engines["split"].executor.graphs.buffers[1].static._layouts)
    for name in list(engines):
        b.free(engines.pop(name))
    b.rows.append((f"decode batch 1 over {n_ctx} keys, inter-token latency", f"split {res['split'] * 1e3:.2f} ms, "
                   f"unsplit {res['unsplit'] * 1e3:.2f} ms", f"{res['unsplit'] / res['split']:.2f}x; ways {ways}"))
    return {f"long_decode_{k}_s": v for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=16384)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--long-context", type=int, default=16384, help="0 skips the long-context decode")
    ap.add_argument("--out", default="gpu_engine.json")
    ap.add_argument("--dry", action="store_true", help="CPU, small model: checks the script, not the GPU")
    args = ap.parse_args()
    if args.dry:
        args.prefill, args.decode_steps, peak, gbps = 256, 4, 1.0, 1.0
    else:
        peak, gbps = peaks()
    cfg = tiny_llama_config() if args.dry else llama3_8b_config()
    b = Bench(random_model(cfg, "cpu" if args.dry else "cuda", torch.bfloat16), args.dry)
    b.rows += [("bf16 matmul peak (8192^3)", f"{peak:.0f} TFLOP/s", ""), ("device copy bandwidth", f"{gbps:.0f} GB/s", "")]
    res = prefill_and_decode(b, args.prefill, args.decode_steps, peak, gbps)
    if not args.dry and args.long_context:
        res.update(long_decode(b, args.long_context, args.decode_steps))
    print(format_table(["measurement", "value", "note"], b.rows))
    path = write_json("gpu_engine_dry.json" if args.dry else args.out,
                      {"rows": [list(r) for r in b.rows], "peak_tflops": peak, "copy_gbps": gbps, **res})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
