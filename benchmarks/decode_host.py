"""Host work of a decode step (batch 1 and 8, 4k-token contexts), the old graph route vs the lean
decode path, measured on a CPU.

On a GPU a decode step replays one CUDA graph; everything around it (scheduling, the step's layout,
filling the graph's fixed buffers, logits, sampling, bookkeeping) is host work the GPU waits for.
Here a tiny random model runs on the CPU with the Triton backend's fixed-buffer path
(cuda_graphs="eager") and its forward replaced by a stub, so no kernel runs and what is timed is
the engine's own host work. "old" replays the route the lean path replaced (build_plan ->
build_layout -> _describe -> device-to-device copies into the fixed buffers; greedy sampling
through a list index), "new" is the engine as it is.

A CPU cannot show what costs most on a GPU: every host-to-device copy from pageable memory
(~10-25 us of host time) and every op dispatched to the device (~5-10 us). So each mode also runs
on PyTorch's meta device and every dispatched op is classified: host-to-device copies,
device-to-device copies, device kernels, metadata-only ops (views, allocation), device-to-host
reads (the sampled tokens), and ops on host tensors.

    .venv/bin/python benchmarks/decode_host.py            # writes results/decode_host.json
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import format_table, median, random_model, random_tokens, set_threads, write_json  # noqa: E402
from host_profile import tiny_config  # noqa: E402

from spanserve.attention.plan import AttentionPlan  # noqa: E402
from spanserve.attention.triton import TritonBackend  # noqa: E402
from spanserve.attention.triton.launch import NUM_FIELDS, Launch, StepLayout, empty_launch  # noqa: E402
from spanserve.attention.triton.graph_decode import StaticDecode  # noqa: E402
from spanserve.engine.config import EngineConfig  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.engine.layout import Segment  # noqa: E402
from spanserve.cache.claim import Task  # noqa: E402
from spanserve.engine.runner import build_plan  # noqa: E402
from spanserve.engine.sampling import Sampler, SamplingParams  # noqa: E402

PIECES = ("schedule", "tables", "inputs", "logits", "sample", "rest")


class Clock:
    """Per-step time of each piece; the stubbed forward splits the runner into inputs | logits.
    `tables`: the runner reading each task's slot and delta arrays, which the cache manager
    rebuilds every decode step (they are the same in both modes)."""

    current: "Clock | None" = None

    def __init__(self) -> None:
        self.t: Counter[str] = Counter()
        self.mark = 0.0

    @staticmethod
    def patch_tables() -> None:
        for name in ("slots", "deltas"):
            get = getattr(Task, name).fget

            def timed(task: Task, get: Callable[[Task], Any] = get) -> Any:
                t0 = time.perf_counter()
                out = get(task)
                if Clock.current is not None:
                    Clock.current.t["tables"] += time.perf_counter() - t0
                return out
            setattr(Task, name, property(timed))

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.t[name] += time.perf_counter() - t0
            return out
        return timed


class OldRoute:
    """The decode route before the lean path: a general plan (per-row device tensors), the
    backend's layout and launch description, then device-to-device copies of it into fixed-address
    buffers; logits rows picked by an index tensor; greedy tokens through a list index."""

    def __init__(self, eng: LLMEngine, forward: Callable[[int], torch.Tensor]):
        self.eng, self.forward = eng, forward
        self.bufs: dict[int, dict[str, torch.Tensor]] = {}

    def run(self, chunks: list, *_: Any) -> tuple[torch.Tensor, list[int]]:
        r = self.eng.runner
        ids, plan, sample_at = build_plan(chunks, r.storage.block_size, r.model.device)
        c = r.model.config
        lay = r.backend.prepare(plan, r.model.rotary, r.storage.block_size)
        small, big = r.backend.launches(lay, c.num_heads // c.num_kv_heads)
        assert StaticDecode.eligible(lay, small, big)
        static = self._load(ids, plan, lay, small)
        AttentionPlan(rows=[], positions=static.q_pos, write_slots=static.write_slots)  # built per step, as it was
        hidden = self.forward(ids.numel())
        picks = [i for i in sample_at if i >= 0]
        logits = r.model.logits(hidden[torch.tensor(picks, dtype=torch.long, device=hidden.device)])
        rows, k = [], 0
        for i in sample_at:
            rows.append(k if i >= 0 else -1)
            k += i >= 0
        return logits, rows

    def _load(self, ids: torch.Tensor, plan: AttentionPlan, lay: StepLayout, small: Launch) -> StepLayout:
        B, dev = ids.numel(), ids.device
        n_keys, n_tiles = lay.key_slots.numel(), small.tile_start.numel()
        b = self.bufs.get(B)
        if b is None or b["key_slots"].numel() < max(n_keys, n_tiles):
            i32 = dict(dtype=torch.int32, device=dev)
            cap = 1 << max(14, max(n_keys, n_tiles).bit_length())
            b = self.bufs[B] = dict(
                write_slots=torch.zeros(B, dtype=torch.long, device=dev), q_pos=torch.zeros(B, **i32),
                zeros=torch.zeros(B, **i32), desc=torch.zeros(B, NUM_FIELDS, **i32),
                key_slots=torch.zeros(cap, **i32), tiles=torch.zeros(3, cap, **i32),
                ids=torch.zeros(B, dtype=torch.long, device=dev), positions=torch.zeros(B, dtype=torch.long, device=dev))
        b["write_slots"].copy_(lay.write_slots, non_blocking=True)
        b["q_pos"].copy_(lay.q_pos, non_blocking=True)
        b["desc"].copy_(small.desc, non_blocking=True)
        b["key_slots"][:n_keys].copy_(lay.key_slots, non_blocking=True)
        for i, t in enumerate((small.tile_start, small.tile_end, small.tile_delta)):
            b["tiles"][i, :n_tiles].copy_(t, non_blocking=True)
        b["ids"].copy_(ids, non_blocking=True)
        b["positions"].copy_(plan.positions, non_blocking=True)
        t = b["tiles"]
        fixed = Launch(b["desc"], t[0], t[1], t[2], small.fused_delta, None)
        return StepLayout(write_slots=b["write_slots"], key_slots=b["key_slots"], q_pos=b["q_pos"], anchor=b["zeros"],
                          seg=b["zeros"], inv_freq=lay.inv_freq, has_delta=small.fused_delta, has_plus=False, rows=[],
                          fixed=(fixed, empty_launch(dev)))


class OldSampler(Sampler):
    def __call__(self, logits: torch.Tensor, params: Any, generators: Any) -> Any:
        if not all(p.greedy for p in params):
            return super().__call__(logits, params, generators)
        logits = logits.to(torch.float32)
        rows = list(range(len(params)))
        picked = logits[rows].argmax(dim=-1)
        tokens = picked.tolist() if rows else []
        return tokens, self.logprobs(logits, params, picked, tokens)


def build(device: str, batch: int, ctx: int, spans: int, mode: str, clock: Clock) -> LLMEngine:
    cfg = tiny_config()
    model = random_model(cfg, "cpu", torch.float32)
    bs = 16
    blocks = batch * (ctx + 2048) // bs + 512
    eng = LLMEngine(EngineConfig.from_kwargs(
        model=model, device=device, dtype="float32", block_size=bs, num_blocks=blocks, backend=TritonBackend(),
        cuda_graphs="eager", max_num_batched_tokens=batch * ctx + 64, max_num_seqs=batch))
    hidden = cfg.hidden_size
    states = [torch.zeros(b, hidden, device=device) for b in range(batch + 1)]

    def forward(B: int) -> torch.Tensor:  # the kernels are not timed: a stub hands back hidden states
        clock.mark = time.perf_counter()
        return states[B]

    eng.model.forward = lambda ids, *a, **k: torch.zeros(ids.numel(), hidden, device=device)
    eng.runner.graphs._forward = lambda buf, plan, static: forward(buf.static.ids.numel())
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    vocab = cfg.vocab_size
    if spans:  # the context as pinned segments read back in another order: decode rows with deltas
        docs = [random_tokens(gen, ctx // spans, vocab) for _ in range(spans)]
        eng.pin([Segment(token_ids=d, kind="plus") for d in docs])
        while eng.has_unfinished():
            eng.step()
    for _ in range(batch):
        if spans:
            eng.add_request([Segment(token_ids=d, kind="plus") for d in docs[::-1]] + [Segment(token_ids=[7, 8])], params)
        else:
            eng.add_request(random_tokens(gen, ctx, vocab), params)
    eng.step()  # prefill

    # time the pieces: schedule | tables + inputs (the runner until the stub forward) | logits | sample | rest
    eng.scheduler.schedule = clock.wrap("schedule", eng.scheduler.schedule)
    if mode == "old":
        run = OldRoute(eng, forward).run
        eng.sampler = OldSampler()
    else:
        run = eng.runner.run
    timed_run = clock.wrap("run", run)

    def runner(chunks: list, *prepared: Any) -> Any:
        out = timed_run(chunks, *prepared)
        clock.t["logits"] += time.perf_counter() - clock.mark
        return out

    eng.runner.run = runner
    eng.sampler = clock.wrap("sample", eng.sampler)
    for _ in range(3):
        eng.step()
    return eng


def time_steps(eng: LLMEngine, clock: Clock, steps: int) -> dict[str, float]:
    """Median over steps of each piece, in microseconds."""
    per: dict[str, list[float]] = {k: [] for k in ("step", *PIECES)}
    Clock.current = clock
    for _ in range(steps):
        clock.t.clear()
        t0 = time.perf_counter()
        eng.step()
        wall = time.perf_counter() - t0
        t = clock.t
        piece = {"schedule": t["schedule"], "tables": t["tables"], "inputs": t["run"] - t["logits"] - t["tables"],
                 "logits": t["logits"], "sample": t["sample"]}
        piece["rest"] = wall - t["schedule"] - t["run"] - t["sample"]
        per["step"].append(wall)
        for k, v in piece.items():
            per[k].append(v)
    Clock.current = None
    return {k: 1e6 * median(v) for k, v in per.items()}


class OpCounter(TorchDispatchMode):
    """Classifies every op dispatched while active (tensors of the engine live on `meta`)."""

    def __init__(self) -> None:
        super().__init__()
        self.n: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        ins = [t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name in ("copy_", "_to_copy") and ins:
            src, dst = ins[1 if name == "copy_" else 0], (ins[0] if name == "copy_" else outs[0])
            kind = {("cpu", "meta"): "h2d", ("meta", "meta"): "d2d", ("meta", "cpu"): "d2h"}.get((src, dst), "host")
        elif "meta" not in ins + outs:
            kind = "host"
        elif name in ("empty", "empty_strided", "lift_fresh") or any(
                r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            kind = "metadata"
        else:
            kind = "kernel"
        self.n[kind] += 1
        return out


def count_ops(batch: int, ctx: int, spans: int, mode: str, steps: int) -> dict[str, float]:
    counter = OpCounter()
    tolist = torch.Tensor.tolist

    def fake_tolist(t: torch.Tensor) -> Any:  # the sampled tokens: the one read back per step
        if t.device.type != "meta":
            return tolist(t)
        counter.n["d2h"] += 1
        return [0] * t.shape[0]

    torch.Tensor.tolist = fake_tolist  # type: ignore[method-assign]
    try:
        eng = build("meta", batch, ctx, spans, mode, Clock())
        counter.n.clear()
        with counter:
            for _ in range(steps):
                eng.step()
    finally:
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    return {k: counter.n[k] / steps for k in ("h2d", "d2d", "kernel", "metadata", "d2h", "host")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="old and new take turns this many times")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="decode_host.json")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    Clock.patch_tables()
    cases = [("b1", 1, 0), ("b8", 8, 0), ("b1 spans", 1, 8)]
    results: list[dict[str, Any]] = []
    for label, batch, spans in cases:
        clocks = {m: Clock() for m in ("old", "new")}
        engines = {m: build("cpu", batch, args.ctx, spans, m, clocks[m]) for m in ("old", "new")}
        runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
        for _ in range(args.rounds):
            for m in ("old", "new"):
                runs[m].append(time_steps(engines[m], clocks[m], args.steps))
        for m in ("old", "new"):
            us = {k: median([r[k] for r in runs[m]]) for k in runs[m][0]}
            results.append({"case": label, "batch": batch, "spans": spans, "mode": m, "us": us,
                            "ops": count_ops(batch, args.ctx, spans, m, 20)})
    headers = ["case", "mode", "step us", *[f"{p} us" for p in PIECES], "H2D", "D2D", "kernels", "meta ops", "D2H"]
    rows = [[r["case"], r["mode"], r["us"]["step"], *[r["us"][p] for p in PIECES],
             *[r["ops"][k] for k in ("h2d", "d2d", "kernel", "metadata", "d2h")]] for r in results]
    print(f"decode step host work on this CPU (medians, us), ctx {args.ctx}, forward stubbed; then ops per step as "
          "a GPU would see them (meta run): H2D / D2D copies, kernels, metadata-only ops, D2H reads")
    print(format_table(headers, rows))
    path = write_json(args.out, {"benchmark": "decode_host", "args": vars(args), "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
