"""Host time of admitting a judge over cached inner conversations (the judge/generator pattern of
nested_gen.py / nested_gen_gpu.py) on a tiny random-weight model, so the model work is negligible
and what is timed is the engine's own Python/numpy work.

    .venv/bin/python benchmarks/judge_admission.py                 # F=24 inner x 512 tokens
    .venv/bin/python benchmarks/judge_admission.py --fanout 8 --inner-tokens 128 --rounds 2

Each round generates F inner conversations (a new user prompt per round; temperature 0.5,
ignore_eos, so each reaches --inner-tokens and its last block is partial, cached on release),
then sends judges cross(system, plus(F conversations), user(question with a new number))
straight to the engine: the first of a round is "cold" (what the Executor's second wave sends
right after the inner calls), the others "warm" (the same conversations judged again). Timed:
(a) CacheManager.admit of the judge, (b) add_request -> the start of its first model step
(runner.run entered). One more cold judge runs under cProfile, stopped when runner.run is entered.
Also timed: the CacheManager.release calls of each inner wave (a finished generation publishes
its blocks there, and seeds the memos a judge reads; work done before the judge arrives).
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import format_table, llama3_8b_config, median, random_model, write_json  # noqa: E402
from tiny_models import TINY_VOCAB, make_tiny_tokenizer  # noqa: E402

from spanserve import LLM, SamplingParams  # noqa: E402
from spanserve.query import cross, plus, system, user  # noqa: E402
from spanserve.query.plan import Done, Planner  # noqa: E402

TASK = "the cat sat on the mat , the dog ran . " * 2  # with the chat template: ~37 tokens
JUDGE = "the judge : a cat , a dog , a mat . "  # with the question: ~49 tokens, ~26 not cached


def tiny_config():
    return dataclasses.replace(llama3_8b_config(), vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=64,
                               num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, name="tiny-judge")


def inner_generations(llm: LLM, planner: Planner, r: int, fanout: int, tokens: int, temperature: float) -> list[Done]:
    """What the Executor's first wave leaves: F finished conversations cached, as Done nodes."""
    eng = llm.engine
    msg = user(f"{r} {TASK}")
    reqs = [eng.add_request(planner.layout(msg), SamplingParams(max_tokens=tokens, temperature=temperature,
                                                                ignore_eos=True, seed=1000 * r + i))
            for i in range(fanout)]
    outs = llm._drain([q.request_id for q in reqs])
    return [Done(tuple(o.prompt_token_ids), tuple(o.token_ids), o.text, msg) for o in outs]


def profile_top(prof: cProfile.Profile, key: str, n: int) -> list[tuple]:
    """pstats in microseconds (its own report rounds to ms, too coarse here)."""
    st = pstats.Stats(prof).stats  # (file, line, name) -> (prim calls, calls, tottime, cumtime, callers)
    rows = sorted(st.items(), key=lambda kv: kv[1][2 if key == "tottime" else 3], reverse=True)[:n]
    short = lambda f: f"{Path(f[0]).name}:{f[1]}({f[2]})" if f[0] != "~" else f[2]  # noqa: E731
    return [(v[1], round(v[2] * 1e6), round(v[3] * 1e6), short(k)) for k, v in rows]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fanout", type=int, default=24)
    ap.add_argument("--inner-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=4, help="inner generation rounds (each timed cold judge needs one)")
    ap.add_argument("--warm", type=int, default=5, help="judges per round after the first (memos warm)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="judge_admission.json")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)  # steadier on a shared CPU; the model work is not what is timed
    model = dataclasses.replace(random_model(tiny_config(), "cpu", torch.float32), tokenizer=make_tiny_tokenizer())
    llm = LLM(model, device="cpu", num_blocks=4000, max_num_batched_tokens=16384)
    eng = llm.engine
    planner = Planner(llm.tokenizer)

    marks: dict[str, float] = {}
    admit, run, release = eng.manager.admit, eng.runner.run, eng.manager.release
    released: list[float] = []

    def release_(req):
        a = time.perf_counter()
        release(req)
        released.append(time.perf_counter() - a)
    prof: list[cProfile.Profile] = []

    def admit_(req):
        a = time.perf_counter()
        ok = admit(req)
        marks.setdefault("admit", time.perf_counter() - a)
        return ok

    def run_(chunks):
        if prof:
            prof[0].disable()
        marks.setdefault("run", time.perf_counter())
        return run(chunks)

    eng.manager.admit, eng.runner.run, eng.manager.release = admit_, run_, release_
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    judge_no = iter(range(1 << 30))

    def judge(dones: list[Done]) -> dict:
        layout = planner.layout(cross(system(JUDGE), plus(*dones), user(f"round {next(judge_no)} : the best is ?")))
        marks.clear()
        if prof:
            prof[0].enable()
        t = time.perf_counter()
        req = eng.add_request(layout, params)
        while not req.finished:
            eng.step()
        return {"admit_s": marks["admit"], "host_s": marks["run"] - t, "reuse": dict(req.reuse),
                "prompt_tokens": len(req.prompt_token_ids)}

    # round 0 warms up (the judge's system prompt is cached from then on, as on a server); each
    # round's first judge is "cold" (its inner conversations were just generated, as in the
    # Executor's second wave), the next ones are "warm" (asked again over the same conversations);
    # the last round's first judge runs under cProfile
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    waves: list[float] = []  # per round: total release time of its inner requests
    t0 = time.perf_counter()
    for r in range(args.rounds + 2):
        released.clear()
        dones = inner_generations(llm, planner, r, args.fanout, args.inner_tokens, args.temperature)
        waves.append(sum(released))
        assert all(len(d.output_ids) == args.inner_tokens for d in dones)
        if r == args.rounds + 1:
            prof.append(cProfile.Profile())
        cold = judge(dones)
        if prof:
            break
        warm = [judge(dones) for _ in range(args.warm)]
        if r:
            runs["cold"].append(cold)
            runs["warm"] += warm
    wall = time.perf_counter() - t0
    top = {key: profile_top(prof[0], key, args.top) for key in ("tottime", "cumtime")}
    for key, lines in top.items():
        print(f"cProfile of one cold judge, add_request -> runner.run, top {args.top} by {key} (us):")
        print(format_table(["calls", "tottime", "cumtime", "function"], lines))
    rows, summary = [], {}
    for kind, xs in runs.items():
        adm, host = [x["admit_s"] for x in xs], [x["host_s"] for x in xs]
        summary[kind] = {"admit_ms_median": median(adm) * 1e3, "host_ms_median": median(host) * 1e3, "n": len(xs)}
        rows.append((kind, len(xs), xs[-1]["prompt_tokens"], xs[-1]["reuse"]["segment"], xs[-1]["reuse"]["computed"],
                     f"{median(adm) * 1e3:.3f}", f"{min(adm) * 1e3:.3f}", f"{median(host) * 1e3:.3f}",
                     f"{min(host) * 1e3:.3f}"))
    print(format_table(["judge", "n", "prompt", "segment hits", "computed", "admit ms (med)", "admit ms (min)",
                        "add->step ms (med)", "add->step ms (min)"], rows))
    summary["inner_release_ms_median"] = median(waves[1:-1]) * 1e3
    print(f"F={args.fanout} inner conversations of {args.inner_tokens} generated tokens; their releases took "
          f"{summary['inner_release_ms_median']:.3f} ms per wave (median); wall {wall:.1f}s")
    path = write_json(args.out, {"benchmark": "judge_admission", "args": vars(args), "summary": summary,
                                 "runs": runs, "inner_release_s": waves, "profile": top})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
