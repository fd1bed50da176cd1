"""What a long agent turn costs before its first token: a 14k-token tool-calling history (20
documents as plain or plus tool messages) plus one new message, sent alone and eight at once,
with and without the tools' grammar. Client-side TTFT (the first chunk carrying a token's
logprobs), median of 5 after a warm-up. Same server and model as `benchmarks/agent.py`.

    python benchmarks/experiments/agent_ttft.py                      # CPU, tiny model
    python benchmarks/experiments/agent_ttft.py --gpu --tokenizer DIR # one GPU, Llama-3-8B shapes
"""
import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import agent as A  # noqa: E402
import httpx  # noqa: E402
import transformers  # noqa: E402
from common import format_table, write_json  # noqa: E402
from spanserve.model.loader import load_tokenizer  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--gpu", action="store_true")
ap.add_argument("--tokenizer", default=None, help="a directory `agent.py save-tokenizer` wrote (default: SmolLM2's)")
ap.add_argument("--model-dir", default=None)
args = ap.parse_args()
tok = transformers.AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else load_tokenizer("smollm2")
tmp = tempfile.mkdtemp()
model = Path(args.model_dir or tmp) / "model"
if not (model / "config.json").is_file():
    A.write_agent_model(model, tok, args.gpu)
docs = A.corpus(tok, 32, 600)
port = A.free_port()
proc = A.start_server(A.server_args(model, args.gpu), port, Path(tmp) / "server.log")
base = f"http://127.0.0.1:{port}"


def body(i, tools, max_tokens, extra_doc=None, salt="p"):
    msgs = [{"role": "system", "content": A.SYSTEM}, {"role": "user", "content": f"Question {i}: which agree?"}]
    if extra_doc is not None:
        msgs.append({"role": "user", "content": extra_doc})
    b = {"model": "agent", "messages": msgs, "max_tokens": max_tokens, "temperature": 1.0, "seed": i, "stream": True,
         "logprobs": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
    if tools:
        b.update(tools=[A.SEARCH], tool_choice="required")
    return b

def one(b):
    with httpx.Client(base_url=base, timeout=600) as h:
        return A.streamed_turn(h, b)[0]

def concurrent(bodies):
    out = [None] * len(bodies)
    def go(k): out[k] = one(bodies[k])
    ts = [threading.Thread(target=go, args=(k,)) for k in range(len(bodies))]
    [t.start() for t in ts]; [t.join() for t in ts]
    return out

def probe_under_load(tools, bg_tools, n_bg=7):
    """n_bg streams decoding 120 tokens; once they run, one probe request's TTFT."""
    res = {}
    def bg(k): one(body(100 + k, bg_tools, 120))
    ts = [threading.Thread(target=bg, args=(k,)) for k in range(n_bg)]
    [t.start() for t in ts]
    time.sleep(0.5)
    res["ttft"] = one(body(7, tools, 1))
    [t.join() for t in ts]
    return res["ttft"]

rows = []
try:
    for t in (False, True):  # warm-up
        one(body(0, t, 4)); concurrent([body(k, t, 4) for k in range(8)]); probe_under_load(t, t)
    def rep(name, fn, n=5):
        xs = [fn() for _ in range(n)]
        rows.append({"case": name, "ttft_ms_median": statistics.median(xs) * 1e3, "ttft_ms": [x * 1e3 for x in xs]})
    def history(kind, n_turns=10):
        msgs = [{"role": "system", "content": A.SYSTEM}, {"role": "user", "content": "Question: which agree?"}]
        for t in range(n_turns):
            calls = [{"id": f"c{t}{j}", "type": "function", "function": {"name": "search_corpus",
                      "arguments": json.dumps({"query": "abc"})}} for j in range(2)]
            msgs.append({"role": "assistant", "content": None, "tool_calls": calls})
            for j in range(2):
                m = {"role": "tool", "tool_call_id": f"c{t}{j}", "content": docs[(2 * t + j) % 32]}
                msgs.append({**m, "kind": "plus"} if kind == "plus" else m)
        return msgs
    cnt = [0]
    def long_turn(kind, tools, n=1):
        msgs = history(kind)
        def b(k):
            cnt[0] += 1
            x = {"model": "agent", "messages": msgs + [{"role": "user", "content": f"next {cnt[0]}"}], "max_tokens": 1,
                 "stream": True, "logprobs": True, "stream_options": {"include_usage": True}, "cache_salt": kind}
            if tools:
                x.update(tools=[A.SEARCH], tool_choice="required")
            return x
        return max(concurrent([b(k) for k in range(n)]))
    for kind in ("plain", "plus"):
        long_turn(kind, True)
        rep(f"14k-token history, {kind}, tools, 1 req", lambda: long_turn(kind, True))
        rep(f"14k-token history, {kind}, no tools, 1 req", lambda: long_turn(kind, False))
        rep(f"14k-token history, {kind}, tools, 8 concurrent (max)", lambda: long_turn(kind, True, 8))
finally:
    proc.terminate()
print(format_table(["case", "TTFT median ms", "runs ms"],
                   [[r["case"], r["ttft_ms_median"], " ".join(f"{x:.0f}" for x in r["ttft_ms"])] for r in rows]))
path = write_json("agent_ttft_gpu.json" if args.gpu else "agent_ttft.json",
                  {"model": "random Llama-3-8B shapes, bf16" if args.gpu else "random 2-layer Llama, float32",
                   "tokenizer": "SmolLM2-135M-Instruct", "cases": rows})
print(f"wrote {path.name}")
