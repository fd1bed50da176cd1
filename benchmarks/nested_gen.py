"""Judge/generator TTFT (span-query paper §5.7): span query vs. one flattened stock prompt, on SmolLM2
(CPU) or on random Llama-3-8B-shaped bf16 weights (--gpu).

    .venv/bin/python benchmarks/nested_gen.py --quick       # F in {1, 4}, inner max_tokens 32
    .venv/bin/python benchmarks/nested_gen.py               # F in {1, 4, 8, 24}, inner max_tokens 128
    python benchmarks/nested_gen.py --gpu --fanouts 24 --max-tokens 512 --repeats 5   # one H100
    python benchmarks/nested_gen.py --gpu --dry             # the GPU path on a CPU, tiny shapes

Query, for fan-out F and inner temperature T:

    g(cross(system(judge), plus(repeat(F, g(user(task), temperature=T, max_tokens=M))), user(question)))

Only the judge call's time to first token is measured, two ways, on the same LLM (prefix caching is
always on in the engine):

* span: the query runs through the Executor. The F inner calls run first; the judge then reads
  their conversations as plus segments, whose KV the finished inner requests left in the cache.
* stock: the same inner answers (the texts produced by the span run) flattened into ONE plain chat
  prompt (system, then each inner conversation's user + assistant turns, then the question),
  rendered with the chat template and sent as a plain prompt. Prefix caching can reuse at most
  the leading system prompt: every conversation sits at a new position after other text, and the
  inner requests' own cache starts with the template's default system prompt, not the judge's.

Repeat 0 executes the whole query (inner calls + judge). Later repeats re-run only the judge over
the same evaluated inner conversations (the Executor accepts them as evaluated nodes), so the
inner decoding, which dominates the run time on CPU, happens once per (F, T). Every judge prompt
has a user message "Round <n>." right after the system prompt, with n unique over the whole run
and the same for span and stock, so neither variant finds its own earlier judge prompt cached;
the system prompt itself is cached for both (a warm-up leaves it there, as a server that ran this
judge before would). Span and stock alternate which goes first. Medians over repeats; speedup =
median stock TTFT / median span TTFT. Torch runs one thread by default: on the shared 2-core
machine two threads spin-wait whenever other processes hold a core, and were 2-3x slower.

--gpu: the 8B shape (outputs are meaningless; the work is real), inner temperature 0.5. Each
repeat generates F new inner conversations and runs the judge (repeat 0 is a discarded warm-up);
stock is the judge's own prompt tokens sent as one plain prompt in a namespace of its own, so
prefix caching reuses nothing of it.

With T = 0 all F inner generations are greedy and produce the same text (expected): the judge then
reads F identical conversations, which the cache stores once.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from spanserve import LLM  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.query import cross, g, plus, repeat, system, user  # noqa: E402
from spanserve.query.execute import EngineRunner, Executor  # noqa: E402
from spanserve.query.plan import Done  # noqa: E402

from common import (RESULTS_DIR, format_table, llama3_8b_config, median, random_model,  # noqa: E402
                    tiny_llama_config, write_json)

TASK = ("Write a short story of about 150 words about a hiker who finds a mysterious reusable water "
        "bottle on a mountain trail.")
# A task SmolLM2 answers in ~20-30 tokens, for comparison (pass it with --task).
SHORT_TASK = ("Write a catchy one-line slogan for a reusable water bottle, then explain in two or three "
              "sentences why it would appeal to hikers.")
JUDGE = ("You are a strict judge. You will read several candidate answers to the same task, written "
         "by different assistants. Compare them carefully on creativity, clarity and relevance.")
ROUND = "Round {r}. Here are the candidate answers."
QUESTION = "Which answer is best? Quote its first sentence and give one sentence explaining your choice."


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def span_query(r: int, fanout: int, temperature: float, max_tokens: int, judge_tokens: int, task: str = TASK):
    inner = g(user(task), temperature=temperature, max_tokens=max_tokens)
    return g(cross(system(JUDGE), user(ROUND.format(r=r)), plus(repeat(fanout, inner)), user(QUESTION)),
             max_tokens=judge_tokens, temperature=0.0)


def judge_only(r: int, dones: list[Done], judge_tokens: int):
    """The judge over already evaluated inner conversations: what the Executor's second wave runs."""
    return g(cross(system(JUDGE), user(ROUND.format(r=r)), plus(*dones), user(QUESTION)),
             max_tokens=judge_tokens, temperature=0.0)


def stock_prompt(llm: LLM, r: int, dones: list[Done], task: str = TASK) -> list[int]:
    msgs = [{"role": "system", "content": JUDGE}, {"role": "user", "content": ROUND.format(r=r)}]
    for d in dones:
        msgs += [{"role": "user", "content": task}, {"role": "assistant", "content": d.text}]
    msgs.append({"role": "user", "content": QUESTION})
    text = llm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return llm.engine.encode(text)


def measure(llm: LLM, fanout: int, temperature: float, args: argparse.Namespace, rounds: Any) -> dict[str, Any]:
    ex = Executor(EngineRunner(llm.engine), llm.tokenizer, max_tokens=args.max_tokens, temperature=0.0,
                  seed=args.seed)
    span, stock, rows = [], [], []
    dones: list[Done] = []
    for r in range(args.repeats):
        n = next(rounds)  # unique over the whole run: no judge prompt is ever cached beforehand
        order = ("span", "stock") if r % 2 == 0 else ("stock", "span")
        for which in order:
            if which == "span":
                t0 = time.monotonic()
                if r == 0:
                    out = ex.execute(span_query(n, fanout, temperature, args.max_tokens, args.judge_tokens, args.task))
                    inner = [o for p, o in out.outputs.items() if p != ()]
                    assert len(inner) == fanout, (len(inner), fanout)
                    dones = [Done(tuple(o.prompt_token_ids), tuple(o.token_ids), o.text, user(args.task))
                             for o in inner]
                    log(f"F={fanout} T={temperature}: inner calls + judge took {time.monotonic() - t0:.1f}s")
                else:
                    out = ex.execute(judge_only(n, dones, args.judge_tokens))
                j = out.outputs[()]
                span.append(j.metrics["ttft"])
                rows.append({"repeat": r, "variant": "span", "ttft": j.metrics["ttft"],
                             "prompt_tokens": j.metrics["prompt_tokens"], "reuse": j.metrics["reuse"],
                             "text": j.text})
            else:
                ids = stock_prompt(llm, n, dones, args.task)
                o = llm.generate(ids, SamplingParams(max_tokens=args.judge_tokens, temperature=0.0))[0]
                stock.append(o.metrics["ttft"])
                rows.append({"repeat": r, "variant": "stock", "ttft": o.metrics["ttft"],
                             "prompt_tokens": o.metrics["prompt_tokens"], "reuse": o.metrics["reuse"],
                             "text": o.text})
            log(f"F={fanout} T={temperature} r={r} {which}: ttft {rows[-1]['ttft']:.3f}s "
                f"({rows[-1]['prompt_tokens']} prompt tokens, reuse {rows[-1]['reuse']})")
    s_med, k_med = statistics.median(span), statistics.median(stock)
    return {
        "fanout": fanout, "temperature": temperature,
        "stock_ttft_median": k_med, "span_ttft_median": s_med, "speedup": k_med / s_med,
        "stock_ttft": stock, "span_ttft": span,
        "stock_prompt_tokens": next(x["prompt_tokens"] for x in rows if x["variant"] == "stock"),
        "span_prompt_tokens": next(x["prompt_tokens"] for x in rows if x["variant"] == "span"),
        "inner_output_tokens": [len(d.output_ids) for d in dones],
        "distinct_inner_texts": len({d.text for d in dones}),
        "runs": rows,
    }


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6, 4))
    for t in sorted({r["temperature"] for r in results}):
        pts = sorted((r["fanout"], r["speedup"]) for r in results if r["temperature"] == t)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"inner T={t:g}")
    ax.axhline(1.0, color="gray", lw=0.8, ls=":")
    ax.axhline(5.0, color="gray", lw=0.8, ls="--", label="5x")
    fanouts = sorted({r["fanout"] for r in results})
    ax.set_xscale("log", base=2)
    ax.set_xticks(fanouts, [str(f) for f in fanouts])
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}x"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("fan-out F (inner generations)")
    ax.set_ylabel("judge TTFT speedup (stock / span)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nJudge TTFT, {args.model} CPU float32, inner max_tokens={args.max_tokens}, "
          f"median of {args.repeats} repeats\n('inner tok': mean inner output tokens; 'distinct': distinct inner answers)")
    hdr = f"{'F':>4} {'T':>4} {'inner tok':>9} {'stock tok':>9} {'span tok':>8} {'stock TTFT s':>12} " \
          f"{'span TTFT s':>11} {'speedup':>8} {'distinct':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        inner = statistics.mean(r["inner_output_tokens"])
        print(f"{r['fanout']:>4} {r['temperature']:>4g} {inner:>9.0f} {r['stock_prompt_tokens']:>9} {r['span_prompt_tokens']:>8} "
              f"{r['stock_ttft_median']:>12.3f} {r['span_ttft_median']:>11.3f} {r['speedup']:>7.1f}x "
              f"{r['distinct_inner_texts']:>8}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpu", action="store_true", help="CUDA, random Llama-3-8B-shaped bf16 weights")
    ap.add_argument("--dry", action="store_true", help="with --gpu: tiny shapes on the CPU (checks the script)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--fanouts", default="1,4,8,24", help="comma-separated fan-outs F")
    ap.add_argument("--temperatures", "--temperature", default=None,
                    help="comma-separated inner temperatures T (default 0,0.5; 0.5 with --gpu)")
    ap.add_argument("--max-tokens", type=int, default=128, help="inner generations' max_tokens")
    ap.add_argument("--task", default=TASK, help="the inner generations' user message")
    ap.add_argument("--judge-tokens", type=int, default=4, help="judge max_tokens (only its TTFT is timed)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--num-blocks", type=int, default=None, help="KV pool blocks of 16 tokens (2048; 12000 with --gpu)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1 avoids spin-waiting when the shared cores are oversubscribed)")
    ap.add_argument("--quick", action="store_true", help="F in {1, 4}, inner max_tokens 32")
    ap.add_argument("--out", "--json", dest="out", default=None,
                    help="JSON: a name under benchmarks/results/ or a path (default nested_gen[_quick|_gpu].json)")
    ap.add_argument("--plot", default=None, help="default docs/nested_gen[_quick].png")
    ap.add_argument("--from-json", default=None, help="print the table and plot from a results file; run nothing")
    args = ap.parse_args(argv)
    if args.quick:
        args.fanouts, args.max_tokens = "1,4", 32
    args.temperatures = args.temperatures or ("0.5" if args.gpu else "0,0.5")
    args.num_blocks = args.num_blocks or (12000 if args.gpu and not args.dry else 4000 if args.gpu else 2048)
    return args


def json_path(args: argparse.Namespace, default: str) -> Path:
    p = Path(args.out or default)
    return RESULTS_DIR / p if p.parent == Path(".") else p


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.gpu:
        run_gpu(args)
        return
    suffix = "_quick" if args.quick else ""
    out_path = json_path(args, f"nested_gen{suffix}.json")
    png_path = Path(args.plot or ROOT / "docs" / f"nested_gen{suffix}.png")
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        report(saved["results"], argparse.Namespace(**saved["args"]))
        plot(saved["results"], png_path, f"Judge TTFT speedup, {saved['model']} CPU, "
                                         f"inner max_tokens={saved['args']['max_tokens']}")
        return
    t0 = time.monotonic()
    results = run_cpu(args)
    report(results, args)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({
        "benchmark": "nested_gen", "model": args.model, "device": "cpu", "dtype": "float32",
        "args": vars(args), "task": args.task, "judge_system": JUDGE, "round_message": ROUND, "question": QUESTION,
        "results": results, "wall_s": time.monotonic() - t0,
    }, indent=1))
    plot(results, png_path, f"Judge TTFT speedup, {args.model} CPU, inner max_tokens={args.max_tokens}")
    print(f"\nwrote {out_path.relative_to(ROOT) if out_path.is_relative_to(ROOT) else out_path} "
          f"and {png_path.relative_to(ROOT) if png_path.is_relative_to(ROOT) else png_path}")


def run_cpu(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    llm = LLM(args.model, num_blocks=args.num_blocks)
    # Warm up, and leave the judge's system prompt cached at the start of a prompt, as it would be
    # on a server that has run this judge before: both variants reuse it.
    llm.generate(llm.engine.encode(llm.tokenizer.apply_chat_template(
        [{"role": "system", "content": JUDGE}, {"role": "user", "content": "Warm up."}], tokenize=False,
        add_generation_prompt=True)), SamplingParams(max_tokens=2))
    log(f"loaded {args.model} in {time.monotonic() - t0:.1f}s")
    rounds = itertools.count()
    return [measure(llm, int(f), float(t), args, rounds)
            for t in args.temperatures.split(",") for f in args.fanouts.split(",")]


# ---- --gpu: random Llama-3-8B-shaped weights ----------------------------------------------------
GPU_TASK = "the cat sat on the mat and the dog ran on the mat " * 3


def gpu_llm(args: argparse.Namespace) -> LLM:
    from tiny_models import make_tiny_tokenizer

    dev, dtype = ("cpu", torch.float32) if args.dry else ("cuda", torch.bfloat16)
    cfg = tiny_llama_config() if args.dry else llama3_8b_config()
    model = dataclasses.replace(random_model(cfg, dev, dtype), tokenizer=make_tiny_tokenizer())
    backend = None
    if not args.dry:
        from spanserve.attention.triton import TritonBackend
        backend = TritonBackend()
    return LLM(model, device=dev, dtype=str(dtype).removeprefix("torch."), num_blocks=args.num_blocks,
               max_num_batched_tokens=16384, backend=backend)


def stock_run(llm: LLM, prompt: list[int]) -> Any:
    """The judge's prompt tokens as one plain prompt, in a namespace no span request uses."""
    flat = llm.engine.add_request(list(prompt), SamplingParams(max_tokens=2, ignore_eos=True), namespace="stock")
    stock = None
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            if o.finished and o.request_id == flat.request_id:
                stock = o
    return stock


def measure_gpu(llm: LLM, fanout: int, temperature: float, args: argparse.Namespace) -> dict[str, Any]:
    span_t, stock_t = [], []
    for r in range(args.repeats + 1):
        inner = g(user(f"{r} {GPU_TASK}"), temperature=temperature, max_tokens=args.max_tokens)
        q = g(cross(system("the judge"), plus(repeat(fanout, inner)), user("the best is ?")), max_tokens=2)
        judge = Executor(EngineRunner(llm.engine), llm.tokenizer, seed=r).execute(q).outputs[()]
        stock = stock_run(llm, judge.prompt_token_ids)
        if r:  # repeat 0 warms up
            span_t.append(judge.metrics["ttft"])
            stock_t.append(stock.metrics["ttft"])
    s, k = median(span_t), median(stock_t)
    return {"fanout": fanout, "temperature": temperature, "prompt_tokens": len(judge.prompt_token_ids),
            "stock_s": k, "span_s": s, "speedup": k / s, "judge_reuse": judge.metrics["reuse"],
            "stock_reuse": stock.metrics["reuse"]}


def run_gpu(args: argparse.Namespace) -> None:
    llm = gpu_llm(args)
    rows, results = [], []
    for t in (float(x) for x in args.temperatures.split(",")):
        for f in (int(x) for x in args.fanouts.split(",")):
            res = measure_gpu(llm, f, t, args)
            results.append(res)
            rows.append((f, t, res["prompt_tokens"], res["judge_reuse"]["segment"], f"{res['stock_s'] * 1e3:.1f}",
                         f"{res['span_s'] * 1e3:.1f}", f"{res['speedup']:.1f}x"))
            print(rows[-1], flush=True)
    print(format_table(["fan-out", "T", "judge prompt", "segment hits", "stock ms", "span ms", "speedup"], rows))
    path = write_json(str(json_path(args, "nested_gen_gpu_dry.json" if args.dry else "nested_gen_gpu.json")),
                      {"args": vars(args), "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
