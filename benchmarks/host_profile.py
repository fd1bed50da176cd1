"""Where the host time of a warm span request goes: the RAG layout of `rag_ttft.py --gpu`
(N documents x L tokens, pinned, then a new order + a 64-token question), on a model small enough
that the device work is negligible, so what remains is the engine's own Python/numpy work.

    .venv/bin/python benchmarks/host_profile.py                    # CPU, N=32, L=2857, tiny model
    python benchmarks/host_profile.py --device cuda --backend triton   # the same on a GPU

Prints the median TTFT of --runs warm requests and the top functions of a cProfile of one.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import llama3_8b_config, median, random_model, random_tokens, write_json  # noqa: E402

from spanserve.engine.layout import Segment  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.llm import LLM  # noqa: E402
from spanserve.worker.storage import bytes_per_block  # noqa: E402


def tiny_config():
    return dataclasses.replace(llama3_8b_config(), vocab_size=4096, hidden_size=64, intermediate_size=128,
                               num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, name="tiny-host")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--doc-len", type=int, default=2857)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="reference", choices=["reference", "triton"])
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--decode", action="store_true", help="profile decode steps at batch 1 instead")
    ap.add_argument("--out", default="host_profile.json")
    args = ap.parse_args(argv)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = random_model(tiny_config(), args.device, dtype)
    bs = 16
    doc_blocks = args.n * -(-args.doc_len // bs)
    blocks = 2 * doc_blocks + 256
    extra = {}
    if args.backend == "triton":
        from spanserve.attention.triton import TritonBackend
        extra["backend"] = TritonBackend()
    llm = LLM(model, device=args.device, dtype=str(dtype).removeprefix("torch."), block_size=bs,
              kv_cache_memory=blocks * bytes_per_block(model.config, bs, dtype),
              max_num_batched_tokens=args.n * args.doc_len + args.question_len, pin_fraction=0.6, **extra)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    if args.decode:
        return decode_profile(llm, random_tokens(gen, 512, vocab), args)
    docs = [random_tokens(gen, args.doc_len, vocab) for _ in range(args.n)]
    llm.pin([Segment(token_ids=d, kind="plus", key=f"d{i}") for i, d in enumerate(docs)])
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def warm() -> dict:
        perm = torch.randperm(args.n, generator=gen).tolist()
        layout = [Segment(token_ids=docs[i], kind="plus") for i in perm]
        layout.append(Segment(token_ids=random_tokens(gen, args.question_len, vocab)))
        return llm.generate(layout, params)[0].metrics

    warm()
    ttfts = []
    for _ in range(args.runs):
        m = warm()
        assert m["cached_tokens"] == args.n * args.doc_len, m["reuse"]
        ttfts.append(m["ttft"])
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    warm()
    prof.disable()
    wall = time.perf_counter() - t0
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
    s2 = io.StringIO()
    pstats.Stats(prof, stream=s2).sort_stats("tottime").print_stats(args.top)
    print(s.getvalue()[-12000:])
    print(s2.getvalue()[-8000:])
    print(f"warm TTFT median {1e3 * median(ttfts):.1f} ms over {args.runs} runs "
          f"(N={args.n} x {args.doc_len} + {args.question_len}); profiled run {1e3 * wall:.1f} ms wall")
    write_json(args.out, {"benchmark": "host_profile", "args": vars(args), "ttft_s": ttfts,
                          "profile_cumulative": s.getvalue(), "profile_tottime": s2.getvalue()})


def decode_profile(llm: LLM, prompt: list[int], args: argparse.Namespace) -> None:
    eng = llm.engine
    eng.add_request(prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(20):  # prefill, graph capture, warm-up
        eng.step()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times = []
    for _ in range(50):
        sync()
        t0 = time.perf_counter()
        eng.step()
        sync()
        times.append(time.perf_counter() - t0)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        eng.step()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    print(s.getvalue()[-8000:])
    print(f"decode step at batch 1: median {1e3 * median(times):.2f} ms")
    write_json(args.out, {"benchmark": "host_profile_decode", "args": vars(args), "step_s": times,
                          "profile_tottime": s.getvalue()})


if __name__ == "__main__":
    main()
