"""Host time of turning a request's output tokens into text, per generated token: decoding the
whole output every step (what the engine did before) against `IncrementalText` (a short window of
the newest tokens). SmolLM2's tokenizer (from its GGUF), random ids of its vocabulary, one
request; time per step at the end of an output of n tokens.

    .venv/bin/python benchmarks/experiments/detokenize.py                 # writes results/detokenize.json
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, write_json  # noqa: E402

from spanserve.engine.detokenize import IncrementalText  # noqa: E402
from spanserve.model.loader import load_model  # noqa: E402


def per_step_us(update, ids: list[int], last: int) -> float:
    """Microseconds per step over the last `last` steps of a run that grows ids one by one."""
    t0 = 0.0
    grown: list[int] = []
    for n, t in enumerate(ids):
        if n == len(ids) - last:
            t0 = time.perf_counter()
        grown.append(t)
        update(grown)
    return (time.perf_counter() - t0) / last * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--out", default="detokenize.json")
    args = ap.parse_args()
    tok = load_model("smollm2").tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    rng = random.Random(0)
    vocab = len(tok)
    rows, results = [], []
    for n in args.lengths:
        ids = [rng.randrange(vocab) for _ in range(n)]
        last = min(64, n // 2)
        whole = per_step_us(decode, ids, last)
        inc = IncrementalText(decode)
        incremental = per_step_us(inc.update, ids, last)
        assert inc.update(ids, final=True) == decode(ids)
        rows.append((n, whole, incremental, whole / incremental))
        results.append({"tokens": n, "whole_us": whole, "incremental_us": incremental})
    print(format_table(["output tokens", "whole decode us/step", "incremental us/step", "ratio"], rows))
    print(f"wrote {write_json(args.out, {'benchmark': 'detokenize', 'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
