"""Offline generation throughput: spanserve versus Hugging Face transformers on SmolLM2.

    .venv/bin/python benchmarks/throughput.py            # 32 prompts x 64 new tokens, 3 rounds
    .venv/bin/python benchmarks/throughput.py --quick    # 8 prompts x 16 new tokens, 1 round

Seeded random-token prompts of 64-256 tokens, greedy, exactly --new-tokens generated per prompt
(spanserve: ignore_eos; transformers: min_new_tokens). Three variants, interleaved round by
round (the order rotates each round) so that load on a shared machine hits them alike:

  spanserve   all prompts through one LLM.generate (continuous batching); each round uses a
              fresh cache namespace, so no round reuses an earlier round's KV
  hf-one      transformers generate, one prompt at a time
  hf-batched  transformers generate, all prompts in one left-padded batch

Both engines run the same float32 weights, dequantized from the same GGUF. Reports generated
tokens/s (median over rounds) and the per-round ratios' medians. With --profile, or when
spanserve is slower than hf-batched, one extra spanserve run is profiled with cProfile.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import ROOT, format_table, median, random_tokens, rotated, save_figure, set_threads, timed, write_json

from spanserve.engine.params import SamplingParams
from spanserve.llm import LLM
from spanserve.model.loader import resolve_model

VARIANTS = ("spanserve", "hf-one", "hf-batched")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of all variants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="spanserve's per-step token budget")
    ap.add_argument("--profile", action="store_true", help="always profile one spanserve run")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 prompts x 16 tokens, 1 round")
    ap.add_argument("--out", default="throughput.json", help="file name under benchmarks/results/")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.rounds = 8, 16, 1
        if args.out == "throughput.json":
            args.out = "throughput_quick.json"
    return args


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [random_tokens(gen, length, vocab) for length in lengths]


def load_hf(dtype: torch.dtype = torch.float32) -> Any:
    import transformers

    path = resolve_model("smollm2")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.eval()


class Runner:
    """One callable per variant; each returns the generated token ids per prompt."""

    def __init__(self, llm: LLM, hf: Any, new_tokens: int, pad_id: int):
        self.llm, self.hf, self.new_tokens, self.pad_id = llm, hf, new_tokens, pad_id
        self.namespace = "warmup"  # spanserve's cache namespace: one per round, so rounds start cold

    def spanserve(self, prompts: list[list[int]]) -> list[list[int]]:
        sp = SamplingParams(max_tokens=self.new_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate(prompts, sp, namespace=self.namespace)
        if any(o.metrics["cached_tokens"] for o in outs):
            raise RuntimeError("a spanserve round hit the prefix cache; rounds must start cold")
        return [o.token_ids for o in outs]

    def _hf_generate(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            out = self.hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.new_tokens,
                                   min_new_tokens=self.new_tokens, do_sample=False, temperature=None,
                                   top_p=None, top_k=None, pad_token_id=self.pad_id)
        return out[:, ids.shape[1]:]

    def hf_one(self, prompts: list[list[int]]) -> list[list[int]]:
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            outs.append(self._hf_generate(ids, torch.ones_like(ids))[0].tolist())
        return outs

    def hf_batched(self, prompts: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token lines up
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        return self._hf_generate(ids, mask).tolist()

    def by_name(self, name: str) -> Callable[[list[list[int]]], list[list[int]]]:
        return {"spanserve": self.spanserve, "hf-one": self.hf_one, "hf-batched": self.hf_batched}[name]


def profile_spanserve(runner: Runner, prompts: list[list[int]], top: int = 30) -> str:
    prof = cProfile.Profile()
    runner.namespace = "profile"  # a namespace of its own: a cold run like the timed ones
    prof.enable()
    runner.spanserve(prompts)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def plot(medians: dict[str, float], title: str, name: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    bars = ax.bar(list(medians), list(medians.values()), color=["tab:blue", "tab:gray", "tab:orange"])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylim(0, 1.15 * max(medians.values()))
    ax.set_ylabel("generated tokens/s (median)")
    ax.set_title(title, fontsize=9)
    path = save_figure(fig, name)
    plt.close(fig)
    return str(path.relative_to(ROOT))  # no machine paths in results


def run_rounds(runner: Runner, prompts: list[list[int]], args: argparse.Namespace
               ) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """Seconds per round of every variant (the order rotates each round) and the last outputs."""
    n_gen = args.prompts * args.new_tokens
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        runner.namespace = f"round-{r}"
        for name in rotated(VARIANTS, r):
            out, secs = timed(lambda: runner.by_name(name)(prompts))
            if any(len(o) != args.new_tokens for o in out):
                raise RuntimeError(f"{name} generated {sorted({len(o) for o in out})} tokens, not {args.new_tokens}")
            times[name].append(secs)
            outputs[name] = out
            print(f"round {r} {name:>10}: {secs:7.2f} s  {n_gen / secs:7.1f} tok/s", flush=True)
    return times, outputs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    set_threads(args.threads)
    print(f"loading SmolLM2 twice (spanserve, transformers); torch threads {torch.get_num_threads()}", flush=True)
    llm = LLM("smollm2", max_num_batched_tokens=args.max_num_batched_tokens)
    hf = load_hf()
    tok = llm.tokenizer
    pad_id = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else llm.engine.config.eos_token_ids[0]
    prompts = make_prompts(args.prompts, args.min_len, args.max_len, llm.engine.config.vocab_size, args.seed)
    n_gen = args.prompts * args.new_tokens

    runner = Runner(llm, hf, new_tokens=2, pad_id=pad_id)
    for name in VARIANTS:  # warm-up: first-call costs (allocator, thread pools) stay out of the timings
        runner.by_name(name)(prompts[:2])
    runner.new_tokens = args.new_tokens

    times, outputs = run_rounds(runner, prompts, args)
    tps = {v: [n_gen / s for s in times[v]] for v in VARIANTS}
    med = {v: median(tps[v]) for v in VARIANTS}
    # Ratios per round (the variants of one round ran back to back), then the median.
    vs_one = median([a / b for a, b in zip(tps["spanserve"], tps["hf-one"])])
    vs_batched = median([a / b for a, b in zip(tps["spanserve"], tps["hf-batched"])])
    same = {v: sum(a == b for a, b in zip(outputs[v], outputs["hf-one"])) for v in ("spanserve", "hf-batched")}

    rows = [[v, f"{median(times[v]):.2f}", f"{med[v]:.1f}", f"{med['spanserve'] / med[v]:.2f}x",
             f"{same[v]}/{args.prompts}" if v in same else "-"] for v in VARIANTS]
    print()
    print(f"{args.prompts} prompts of {args.min_len}-{args.max_len} tokens, {args.new_tokens} new tokens each, "
          f"greedy, SmolLM2-135M float32 CPU, {args.rounds} interleaved round(s), medians")
    print(format_table(["variant", "seconds", "gen tok/s", "spanserve / this", "same tokens as hf-one"], rows))
    print(f"\nper-round ratio medians: spanserve / hf-one = {vs_one:.2f}x, "
          f"spanserve / hf-batched = {vs_batched:.2f}x")

    profile = None
    if args.profile or vs_batched < 1.0:
        print("\nspanserve is slower than hf-batched: profiling one spanserve run" if vs_batched < 1.0
              else "\nprofiling one spanserve run")
        profile = profile_spanserve(runner, prompts)
        print(profile)

    title = (f"{args.prompts} prompts x {args.new_tokens} new tokens, SmolLM2 f32 CPU "
             f"(spanserve/hf-one {vs_one:.2f}x, /hf-batched {vs_batched:.2f}x)")
    png = plot(med, title, Path(args.out).stem + ".png")
    path = write_json(args.out, {
        "benchmark": "throughput", "args": vars(args), "generated_tokens_per_run": n_gen,
        "seconds": times, "tokens_per_s": tps, "median_tokens_per_s": med,
        "ratio_spanserve_over_hf_one": vs_one, "ratio_spanserve_over_hf_batched": vs_batched,
        "same_tokens_as_hf_one": same, "engine_counters": dict(llm.engine.counters),
        "profile": profile, "plot": png,
    })
    print(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main(sys.argv[1:])
