"""How far FP8 moves a real model from bfloat16: greedy agreement and log-probability error of
SmolLM2-135M-Instruct in three modes (bf16; FP8 KV cache; FP8 KV cache and weights), on chat
prompts and on span layouts of the quality benchmark's tasks.

    python benchmarks/fp8_agreement.py --model smollm2.gguf --device cuda     # the published figure
    python benchmarks/fp8_agreement.py --quick                                # CPU smoke run

Per mode against bf16 in the same run: the share of greedy tokens equal position by position
(over the longer reply, up to --max-tokens), the share of replies identical, and the error of
the log-probability each mode gives the prompt's own tokens (teacher-forced, so one early
difference does not carry on): mean and max absolute difference over every prompt token.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, write_json  # noqa: E402
from common.tasks import FAMILIES, LAYOUTS, make_case  # noqa: E402

from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.llm import LLM  # noqa: E402

MODES: dict[str, dict[str, Any]] = {
    "bf16": {},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "fp8": {"kv_cache_dtype": "fp8", "quantization": "fp8"},
}
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash table is.",
         "List three prime numbers.", "How do plants make food?", "Translate 'good morning' to Spanish.",
         "What is 17 times 3?", "Give one tip for writing clear code."]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cases", type=int, default=8, help="quality-task cases per family")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="fp8_agreement.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.cases, args.ctx, args.max_tokens, args.out = 1, 256, 8, "fp8_agreement_quick.json"
    return args


def prompts(llm: LLM, args: argparse.Namespace) -> list[Any]:
    tok = llm.tokenizer
    encode = lambda s: list(tok.encode(s, add_special_tokens=False))  # noqa: E731
    out: list[Any] = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                              add_generation_prompt=True) for c in CHATS]
    for fam in FAMILIES:
        for i in range(args.cases):
            case = make_case(fam, LAYOUTS[i % len(LAYOUTS)], i, 7, encode, args.ctx, 4)
            out.append(case.segments("none"))
    return out


def agreement(a: list[int], b: list[int]) -> float:
    m = max(len(a), len(b))
    return 1.0 if m == 0 else sum(x == y for x, y in zip(a, b)) / m


def run(args: argparse.Namespace) -> dict[str, Any]:
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    tokens: dict[str, list[list[int]]] = {}
    logprobs: dict[str, list[torch.Tensor]] = {}
    ps: list[Any] = []
    for mode, opts in MODES.items():
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **opts)
        ps = ps or prompts(llm, args)
        tokens[mode] = [o.token_ids for o in llm.generate(ps, greedy)]
        flat = [p for p in ps if isinstance(p, str)]  # teacher-forced scores of the plain prompts
        outs = llm.generate(flat, scored)
        logprobs[mode] = [torch.tensor([lp.logprob for lp in o.prompt_logprobs[1:]]) for o in outs]
        llm.shutdown()
    res: dict[str, Any] = {}
    for mode in MODES:
        agree = [agreement(a, b) for a, b in zip(tokens[mode], tokens["bf16"])]
        diff = torch.cat([(a - b).abs() for a, b in zip(logprobs[mode], logprobs["bf16"])])
        res[mode] = {"token_agreement": sum(agree) / len(agree),
                     "identical_replies": sum(a == 1.0 for a in agree) / len(agree),
                     "logprob_abs_err_mean": diff.mean().item(), "logprob_abs_err_max": diff.max().item(),
                     "prompts": len(ps), "scored_tokens": int(diff.numel())}
    return res


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    res = run(args)
    print(format_table(["mode", "greedy token agreement", "identical replies", "logprob err mean", "logprob err max"],
                       [[m, r["token_agreement"], r["identical_replies"], r["logprob_abs_err_mean"],
                         r["logprob_abs_err_max"]] for m, r in res.items()]))
    path = write_json(args.out, {"benchmark": "fp8_agreement", "args": {k: v for k, v in vars(args).items()
                                                                         if k != "model"},
                                 "model": Path(args.model).name, "results": res})
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
