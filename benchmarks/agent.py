"""Agents calling tools over the server: tool results as plain messages against plus segments.

`spanserve serve --tool-call-parser hermes` (a subprocess) serves a random-weight model that
speaks through SmolLM2's tokenizer (49152 tokens), so its calls are real text: Llama-3-8B's
shape in bf16 on a GPU, a 2-layer float32 model on a CPU. Agents run side by side, each for N
turns. A turn streams one request with `tool_choice: "required"` (the grammar makes every call
valid) and keeps the first 1 to 3 calls the model made; each call's result is a document of a
shared corpus (seeded, Zipf-like, so documents come back across turns and agents), sent back as
a `tool` message: plain in one run, `"kind": "plus"` in the other. Each run has a cache salt of
its own, so both start cold. Per turn it records the TTFT (the first chunk carrying a token's
logprobs), the prefill tokens (prompt tokens the engine computed) and the hit ratio (cached /
prompt tokens).

    python benchmarks/agent.py                               # CPU, tiny model (about 3 minutes)
    python benchmarks/agent.py save-tokenizer DIR            # SmolLM2's tokenizer files, to carry
    python benchmarks/agent.py --gpu --tokenizer DIR         # one GPU, Llama-3-8B shapes
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's spanserve
from common import format_table, llama3_8b_config, write_json
from common.server_process import free_port, start_server
from common.serving_model import tiny, write_model

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = ("You are a research agent. Look facts up with search_corpus before answering; cite the "
          "documents you read. Keep going until the question is settled.")
SEARCH = {"type": "function", "function": {
    "name": "search_corpus", "description": "Return the best matching document of the shared corpus",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "pattern": "^[a-z ]{1,24}$"}},
                   "required": ["query"], "additionalProperties": False}}}


@dataclasses.dataclass(frozen=True)
class Workload:
    agents: int
    turns: int
    documents: int
    doc_words: int
    max_tokens: int  # room for three calls (a query is at most 24 plain characters)

    def schedule(self, seed: int = 0) -> list[list[list[int]]]:
        """[agent][turn] -> the corpus documents its calls return (1 to 3; Zipf-like popularity)."""
        rng = random.Random(seed)
        weights = [1.0 / (i + 1) for i in range(self.documents)]
        return [[rng.choices(range(self.documents), weights, k=rng.randint(1, 3)) for _ in range(self.turns)]
                for _ in range(self.agents)]


CPU = Workload(agents=3, turns=10, documents=12, doc_words=120, max_tokens=120)
GPU = Workload(agents=8, turns=10, documents=32, doc_words=600, max_tokens=120)


def corpus(tokenizer: Any, n: int, words: int, seed: int = 0) -> list[str]:
    """Documents of real vocabulary words (each about one token), numbered."""
    vocab = [t for t in tokenizer.get_vocab() if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 4]
    rng = random.Random(seed)
    return [f"Document {i}: " + "".join(rng.choice(vocab) for _ in range(words)).replace("Ġ", " ").strip()
            for i in range(n)]


def write_agent_model(path: Path, tokenizer: Any, gpu: bool) -> None:
    import torch

    base = llama3_8b_config() if gpu else tiny()
    config = dataclasses.replace(base, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                 eos_token_ids=(tokenizer.eos_token_id,), max_position_embeddings=32768)
    write_model(path, config, torch.device("cuda" if gpu else "cpu"), torch.bfloat16 if gpu else torch.float32)
    tokenizer.save_pretrained(str(path))  # over the word-level tokenizer write_model leaves


def server_args(model: Path, gpu: bool) -> list[str]:
    args = ["--model", str(model), "--served-model-name", "agent", "--tool-call-parser", "hermes"]
    return args + ([] if gpu else ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "256MiB"])


@dataclasses.dataclass
class TurnStats:
    agent: int
    turn: int
    calls: int
    ttft_s: float
    prompt_tokens: int
    prefill_tokens: int
    cached_tokens: int


def streamed_turn(http: httpx.Client, body: dict[str, Any]) -> tuple[float, list[dict[str, Any]], dict[str, Any]]:
    """(TTFT, the calls as {id, name, arguments}, usage) of one streamed request."""
    t0 = time.perf_counter()
    ttft = None
    calls: dict[int, dict[str, Any]] = {}
    usage: dict[str, Any] = {}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                if ttft is None and (choice.get("logprobs") or {}).get("content"):
                    ttft = time.perf_counter() - t0
                for d in choice["delta"].get("tool_calls") or []:
                    c = calls.setdefault(d["index"], {"id": d.get("id"), "name": "", "arguments": ""})
                    c["name"] += d["function"].get("name") or ""
                    c["arguments"] += d["function"].get("arguments") or ""
    return (ttft if ttft is not None else time.perf_counter() - t0), [calls[i] for i in sorted(calls)], usage


def complete(call: dict[str, Any]) -> bool:
    try:
        return isinstance(json.loads(call["arguments"]), dict)
    except ValueError:
        return False


def run_agent(base: str, agent: int, plan: list[list[int]], docs: list[str], w: Workload, mode: str,
              salt: str) -> list[TurnStats]:
    out = []
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"Question {agent}: which documents agree?"}]
    with httpx.Client(base_url=base, timeout=600) as http:
        for t, wanted in enumerate(plan):
            body = {"model": "agent", "messages": messages, "tools": [SEARCH], "tool_choice": "required",
                    "max_tokens": w.max_tokens, "temperature": 1.0, "seed": agent * 1000 + t, "stream": True,
                    "logprobs": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
            ttft, calls, usage = streamed_turn(http, body)
            calls = [c for c in calls if complete(c)][:len(wanted)]
            if not calls:
                raise RuntimeError(f"agent {agent} turn {t}: no complete call in {w.max_tokens} tokens")
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            out.append(TurnStats(agent, t, len(calls), ttft, usage["prompt_tokens"],
                                 usage["prompt_tokens"] - cached, cached))
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls]})
            for c, doc in zip(calls, wanted):
                msg = {"role": "tool", "tool_call_id": c["id"], "content": docs[doc]}
                messages.append({**msg, "kind": "plus"} if mode == "plus" else msg)
    return out


def run_mode(base: str, w: Workload, docs: list[str], mode: str, salt: str) -> list[TurnStats]:
    schedule = w.schedule()
    results: list[list[TurnStats]] = [[] for _ in range(w.agents)]
    errors: list[BaseException] = []

    def go(a: int) -> None:
        try:
            results[a] = run_agent(base, a, schedule[a], docs, w, mode, salt)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(a,)) for a in range(w.agents)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return [s for r in results for s in r]


def summarize(stats: list[TurnStats], turns: int) -> dict[str, Any]:
    per_turn = []
    for t in range(turns):
        ts = [s for s in stats if s.turn == t]
        per_turn.append({"turn": t, "ttft_s": statistics.mean(s.ttft_s for s in ts),
                         "prefill_tokens": statistics.mean(s.prefill_tokens for s in ts),
                         "prompt_tokens": statistics.mean(s.prompt_tokens for s in ts),
                         "hit_ratio": sum(s.cached_tokens for s in ts) / sum(s.prompt_tokens for s in ts),
                         "calls": statistics.mean(s.calls for s in ts)})
    return {"per_turn": per_turn,
            "ttft_s": statistics.mean(s.ttft_s for s in stats),
            "ttft_p50_s": statistics.median(s.ttft_s for s in stats),
            "prefill_tokens_per_turn": statistics.mean(s.prefill_tokens for s in stats),
            "prompt_tokens_per_turn": statistics.mean(s.prompt_tokens for s in stats),
            "hit_ratio": sum(s.cached_tokens for s in stats) / sum(s.prompt_tokens for s in stats),
            "calls_per_turn": statistics.mean(s.calls for s in stats)}


def report(w: Workload, summary: dict[str, dict[str, Any]], device: str) -> dict[str, Any]:
    rows = []
    for t in range(w.turns):
        p, q = summary["plain"]["per_turn"][t], summary["plus"]["per_turn"][t]
        rows.append([t + 1, p["prompt_tokens"], p["prefill_tokens"], q["prefill_tokens"], p["hit_ratio"],
                     q["hit_ratio"], p["ttft_s"] * 1e3, q["ttft_s"] * 1e3])
    p, q = summary["plain"], summary["plus"]
    rows.append(["all", p["prompt_tokens_per_turn"], p["prefill_tokens_per_turn"], q["prefill_tokens_per_turn"],
                 p["hit_ratio"], q["hit_ratio"], p["ttft_s"] * 1e3, q["ttft_s"] * 1e3])
    print(format_table(["turn", "prompt tok", "prefill plain", "prefill plus", "hit plain", "hit plus",
                        "TTFT plain ms", "TTFT plus ms"], rows))
    ratios = {"prefill_tokens": p["prefill_tokens_per_turn"] / q["prefill_tokens_per_turn"],
              "ttft": p["ttft_s"] / q["ttft_s"], "ttft_p50": p["ttft_p50_s"] / q["ttft_p50_s"]}
    print(f"\n{device}: plain / plus over {w.turns} turns x {w.agents} agents: prefill tokens per turn "
          f"{ratios['prefill_tokens']:.2f}x, TTFT {ratios['ttft']:.2f}x (mean), {ratios['ttft_p50']:.2f}x (median); "
          f"calls per turn "
          f"{p['calls_per_turn']:.2f} (plain) and {q['calls_per_turn']:.2f} (plus)")
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", nargs="?", choices=["run", "save-tokenizer"], default="run")
    ap.add_argument("path", nargs="?", help="save-tokenizer: the directory to write")
    ap.add_argument("--gpu", action="store_true", help="Llama-3-8B shapes in bf16 on the GPU (default: tiny on CPU)")
    ap.add_argument("--tokenizer", default=None, help="a directory save-tokenizer wrote (default: SmolLM2's GGUF)")
    ap.add_argument("--model-dir", default=None, help="where to write the model (default: a temporary directory)")
    ap.add_argument("--turns", type=int, default=None, help="fewer turns, to check the script (writes agent*_quick.json)")
    args = ap.parse_args()
    import transformers

    from spanserve.model.loader import load_tokenizer

    if args.command == "save-tokenizer":
        load_tokenizer("smollm2").save_pretrained(args.path)
        return
    tok = transformers.AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else load_tokenizer("smollm2")
    w = GPU if args.gpu else CPU
    if args.turns:
        w = dataclasses.replace(w, turns=args.turns)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model_dir or tmp) / "model"
        if not (model / "config.json").is_file():
            write_agent_model(model, tok, args.gpu)
        docs = corpus(tok, w.documents, w.doc_words)
        port = free_port()
        proc = start_server(server_args(model, args.gpu), port, Path(tmp) / "server.log")
        base = f"http://127.0.0.1:{port}"
        try:
            # workers, CUDA graphs, the grammar, and the kernels of segment reuse (first hit in turn 3)
            run_mode(base, dataclasses.replace(w, turns=4), docs, "plus", "warm-up")
            summary = {}
            for mode in ("plain", "plus"):
                summary[mode] = summarize(run_mode(base, w, docs, mode, f"run-{mode}"), w.turns)
        except Exception:
            print((Path(tmp) / "server.log").read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            proc.terminate()
            proc.wait(60)
    device = "GPU" if args.gpu else "CPU"
    ratios = report(w, summary, device)
    name = ("agent_gpu" if args.gpu else "agent") + ("_quick.json" if args.turns else ".json")
    path = write_json(name, {"workload": dataclasses.asdict(w), "model": "random Llama-3-8B shapes, bf16" if args.gpu
                             else "random 2-layer Llama, float32", "tokenizer": "SmolLM2-135M-Instruct",
                             "plain_over_plus": ratios, "runs": summary})
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
