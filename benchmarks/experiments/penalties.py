"""Cost of logit bias and penalties in the sampler, per decode step: one batch of logits
[batch, vocab] sampled plainly and with every row asking for presence, frequency and repetition
penalties and a 10-token logit_bias, with histories of `--history` prompt + generated tokens.
Llama-3's vocabulary size by default; timed on the chosen device, side by side in one run.

    .venv/bin/python benchmarks/experiments/penalties.py                      # CPU, writes results/penalties.json
    .venv/bin/python benchmarks/experiments/penalties.py --device cuda --out penalties_gpu.json
    .venv/bin/python benchmarks/experiments/penalties.py --smoke              # tiny sizes, proves it runs
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, set_threads, write_json  # noqa: E402

from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.engine.sampling import Sampler  # noqa: E402


def step_ms(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], hist: list, reps: int) -> float:
    """Median milliseconds of one sampler call (synchronised on a GPU)."""
    gens = [None] * len(params)
    times = []
    for _ in range(reps):
        if logits.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        sampler(logits, params, gens, hist)
        if logits.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--history", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script end to end")
    ap.add_argument("--out", default="penalties.json")
    args = ap.parse_args()
    if args.smoke:
        args.vocab, args.batches, args.history, args.reps = 1000, [2], [16], 3
        args.out = "penalties_smoke.json"
    if args.threads:
        set_threads(args.threads)
    rng = random.Random(0)
    sampler = Sampler()
    rows, results = [], []
    for batch in args.batches:
        logits = torch.randn(batch, args.vocab, device=args.device)
        for hist_len in args.history:
            hist = [([rng.randrange(args.vocab) for _ in range(hist_len // 2)],
                     [rng.randrange(args.vocab) for _ in range(hist_len // 2)]) for _ in range(batch)]
            for temperature in (0.0, 1.0):
                plain = [SamplingParams(temperature=temperature)] * batch
                pen = [SamplingParams(temperature=temperature, presence_penalty=0.5, frequency_penalty=0.5,
                                      repetition_penalty=1.2,
                                      logit_bias={rng.randrange(args.vocab): 1.0 for _ in range(10)})
                       for _ in range(batch)]
                base = step_ms(sampler, logits, plain, hist, args.reps)
                with_pen = step_ms(sampler, logits, pen, hist, args.reps)
                mode = "greedy" if temperature == 0 else "sampled"
                rows.append((batch, hist_len, mode, base, with_pen, with_pen - base))
                results.append({"batch": batch, "history": hist_len, "mode": mode, "plain_ms": base,
                                "penalties_ms": with_pen})
    print(f"device {args.device}, vocab {args.vocab}, median of {args.reps} calls")
    print(format_table(["batch", "history tokens", "mode", "plain ms", "with penalties ms", "added ms"], rows))
    print(f"wrote {write_json(args.out, {'benchmark': 'penalties', 'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
