"""Helpers shared by the benchmark scripts and the experiments: output paths, tables, JSON, plots,
timing, seeded prompts, and random-weight Llama-3-8B-shaped models for GPU runs.

Workloads of one figure live beside this module: tasks.py and quality_stats.py (quality.py),
serving_load.py, serving_model.py and serving_offline.py (serving.py), traces.py (the Zipf
simulations)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from spanserve.model.config import ModelConfig
from spanserve.model.shapes import llama3_8b
from spanserve.model.loader import LoadedModel, expected_shapes

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "benchmarks" / "results"
DOCS_DIR = ROOT / "docs"

T = TypeVar("T")


# ---- output -------------------------------------------------------------------------------
def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table; floats keep 3 significant decimals."""

    def cell(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1e-3 or abs(x) >= 1e4 else f"{x:.3f}".rstrip("0").rstrip(".")
        return str(x)

    cells = [[cell(x) for x in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    return path


def save_figure(fig: Any, name: str) -> Path:
    DOCS_DIR.mkdir(parents=True, exist_ok=True)
    path = DOCS_DIR / name
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:  # which engine code ran: the commit, and whether spanserve/ had uncommitted edits
        git = ["git", "-C", str(ROOT)]
        info["git_head"] = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                                          text=True, timeout=10).stdout.strip() or None
        info["spanserve_dirty"] = bool(subprocess.run(git + ["status", "--porcelain", "--", "spanserve"],
                                                      capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def set_threads(n: int) -> None:
    """0 keeps torch's default. On a shared CPU, 1 thread is often faster and much steadier."""
    if n > 0:
        torch.set_num_threads(n)


# ---- timing -------------------------------------------------------------------------------
def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def timed(fn: Callable[[], T], device: torch.device | str = "cpu") -> tuple[T, float]:
    """(result, wall seconds); synchronizes CUDA around the call."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def rotated(items: Sequence[T], k: int) -> list[T]:
    """items rotated left by k: interleaved variants take turns going first."""
    k %= max(1, len(items))
    return list(items[k:]) + list(items[:k])


def random_tokens(gen: torch.Generator, n: int, vocab_size: int, low: int = 100) -> list[int]:
    """n token ids in [low, vocab_size): skips the low ids where tokenizers keep special tokens."""
    return torch.randint(low, vocab_size, (n,), generator=gen).tolist()


# ---- random-weight model ------------------------------------------------------------------
def llama3_8b_config() -> ModelConfig:
    """Llama-3.1-8B's shape (128k context, llama3 RoPE scaling)."""
    return llama3_8b()


def tiny_llama_config() -> ModelConfig:
    """Llama-3-8B's layout at toy size: what the scripts' --dry runs build on a CPU."""
    return dataclasses.replace(llama3_8b_config(), vocab_size=1024, hidden_size=128, intermediate_size=256,
                               num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, name="tiny")


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and [out, in] shapes of every tensor a Llama-family model reads."""
    return expected_shapes(c)


def random_model(config: ModelConfig, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                 seed: int = 0) -> LoadedModel:
    """Random weights created directly on `device`: matrices ~ N(0, 1/fan_in), norms 1, embeddings
    N(0, 1). Fine for timing; the outputs are meaningless. No tokenizer: pass token ids."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape, device=dev, dtype=dtype)
            continue
        t = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
        if name != "model.embed_tokens.weight":
            t.mul_(1.0 / math.sqrt(shape[1]))
        weights[name] = t
    return LoadedModel(config=config, weights=weights, tokenizer=None, source=config.name or "random")


def graph_us(fn: Callable[[int], Any], n: int, reps: int = 20) -> float:
    """Median microseconds per call of fn(i), i in range(n), captured once as a CUDA graph of the
    n calls and replayed `reps` times (warmed up on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(n):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    return median(times)
