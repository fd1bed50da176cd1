"""End-to-end serving benchmark: `spanserve serve` (a subprocess, default flags: on a GPU that
is CUDA, bfloat16, Triton attention, CUDA graphs, fused ops) with random Llama-3-8B weights,
driven over loopback HTTP by a load generator in this process.

1. chat: prompt/output lengths log-normal around 250/200 tokens (outputs run to their drawn
   length: ignore_eos), Poisson arrivals at fixed rates and a saturation burst;
2. RAG: 4-8 of 32 shared documents (1-3k tokens) in random order plus a question, sent as span
   layouts (documents as `plus` segments) and as plain prompts of the same tokens; Poisson
   rates rising until p99 TTFT passes the SLO;
3. sharegpt: `vllm bench serve`'s ShareGPT load (1000 requests at once, greedy, ignore_eos,
   ShareGPT-shaped lengths: benchmarks/common/sharegpt.py), with vLLM's summary lines, after
   fixed batches of 1, 64 and 256 requests whose decode-only steps give the decode roofline;
4. the offline engine (LLM.generate, same engine configuration, own process after the server
   exits) on the saturation burst's (or the ShareGPT load's) requests;
5. the decode roofline: per decode-only step, weights + KV bytes read over the measured
   device copy bandwidth, against the step wall times the engine records (/metrics); each fixed
   batch runs once unmeasured, then `--roofline-repeats` times, and the median is reported.

    python benchmarks/serving.py                    # GPU: chat and RAG, about 7 minutes with model creation
    python benchmarks/serving.py --loads sharegpt --out serving_gpu.json   # GPU: ShareGPT, default flags
    python benchmarks/serving.py --dry              # the whole pipeline on a CPU, tiny model and loads

Two modes run as child processes of that run, each with the device to itself (code in
benchmarks/common/): `serving.py write-model DIR [--dry]` writes the random checkpoint and prints
its sizes and the copy bandwidth; `serving.py offline DIR --requests R.json` runs the offline engine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's spanserve
from common import write_json  # noqa: E402
from common import serving_model, serving_offline  # noqa: E402
from common.serving_load import (RagShape, Request, chat_requests, rag_corpus, rag_requests, roofline,  # noqa: E402
                                 run_load, stats_diff, summarize, sustained)
from common.serving_model import FIRST_WORD, SPECIAL_BASE  # noqa: E402
from common.serving_report import report  # noqa: E402
from common.sharegpt import bound_fraction, fixed_batch, print_summary, sharegpt_requests, vllm_summary  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL = "random-llama3-8b"


def _pythonpath() -> str:
    """This checkout first, then whatever the caller had (e.g. a folder of extra packages)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def sh(cmd: list[str], timeout: float) -> dict[str, Any]:
    """Run this script in a child mode; its last stdout line is JSON."""
    env = dict(os.environ, PYTHONPATH=_pythonpath())
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *cmd], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class Server:
    """`spanserve serve --model DIR` with no device or backend flags, log to a file."""

    def __init__(self, model_dir: str, port: int, extra: list[str]):
        self.log = Path(tempfile.mkdtemp()) / "server.log"
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=_pythonpath())
        cmd = [sys.executable, "-m", "spanserve.cli", "serve", "--model", model_dir, "--port", str(port),
               "--served-model-name", MODEL, *extra]
        print("$ spanserve serve " + " ".join(cmd[4:]), flush=True)
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not up after {timeout} s:\n{self.log.read_text()[-3000:]}")

    def startup_log(self) -> list[str]:
        keep = ("runtime:", "loading model", "model loaded", "KV pool", "serving")
        return [ln for ln in self.log.read_text(errors="replace").splitlines() if any(k in ln for k in keep)]

    def decode_stats(self) -> dict[int, list[float]]:
        """batch -> [steps, seconds, kv_tokens] from /metrics (cumulative)."""
        out: dict[int, list[float]] = {}
        pat = re.compile(r'^spanserve_decode_(steps|step_seconds|kv_tokens)_total\{batch="(\d+)"\} (\S+)$')
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            m = pat.match(line)
            if m:
                out.setdefault(int(m.group(2)), [0.0, 0.0, 0.0])[
                    ("steps", "step_seconds", "kv_tokens").index(m.group(1))] = float(m.group(3))
        return out

    def gauge(self, name: str) -> float | None:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Driver:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.monotonic()
        self.words = 0  # token ids of random text are below this (set once the model exists)
        self.result: dict[str, Any] = {"dry": args.dry, "config": vars(args).copy()}
        self.result["config"]["model_dir"] = Path(args.model_dir).name  # no machine paths in results

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t0)

    def save(self) -> None:
        write_json(self.args.out, self.result)

    def load(self, server: Server, reqs: list[Request], rate: float, seed: int) -> dict[str, Any]:
        before = server.decode_stats()
        res = summarize(run_load(server.url, reqs, rate, seed), rate)
        res["decode"] = stats_diff(server.decode_stats(), before)
        return res

    def chat(self, server: Server) -> list[Request]:
        a = self.args
        mk = lambda seed, n: chat_requests(seed, n, MODEL, FIRST_WORD, self.words, a.chat_in, a.chat_out)  # noqa: E731
        self.load(server, mk(1, a.chat_warmup), math.inf, 1)  # JIT compiles, graph captures
        runs = []
        for i, rate in enumerate(a.chat_rates):
            n = max(4, int(rate * a.duration))
            runs.append(self.load(server, mk(10 + i, n), rate, 10 + i))
            self._print_run("chat", runs[-1])
        sat = mk(99, a.chat_saturation)
        runs.append(self.load(server, sat, math.inf, 99))
        self._print_run("chat", runs[-1])
        self.result["chat"] = runs
        self.save()
        return sat

    def sharegpt(self, server: Server) -> list[Request]:
        """Warm-up, the fixed batches of the decode roofline, then the ShareGPT load."""
        a = self.args
        mk = lambda seed, n: sharegpt_requests(seed, n, MODEL, FIRST_WORD, self.words)  # noqa: E731
        self.load(server, mk(7, a.sharegpt_warmup), math.inf, 7)  # JIT compiles, graph captures
        roof: dict[str, float | None] = {}
        samples: dict[str, list[float]] = {}
        for batch in a.roofline_batches:
            self._fixed_batch(server, batch, 40)  # unmeasured: its first step captures its graphs
            # consecutive runs differ by up to 2.5 points: the median of several
            got = samples[str(batch)] = [f for i in range(a.roofline_repeats)
                                         if (f := self._fixed_batch(server, batch, 50 + i)) is not None]
            roof[str(batch)] = statistics.median(got) if got else None
            print(f"  decode batch {batch}: {roof[str(batch)] or 0:.1%} of the bandwidth bound (median of "
                  f"{', '.join(f'{x:.1%}' for x in got)})", flush=True)
        reqs = mk(1, a.sharegpt_requests)
        summary = vllm_summary(run_load(server.url, reqs, math.inf, 1))
        print_summary(summary)
        self.result["sharegpt"] = {**summary, "max_num_seqs": server.gauge("spanserve_max_num_seqs")}
        self.result["decode_roofline"] = roof
        self.result["decode_roofline_samples"] = samples
        self.save()
        return reqs

    def _fixed_batch(self, server: Server, batch: int, seed: int) -> float | None:
        """Runs `batch` equal requests at once: the fraction of the bandwidth bound its decode-only
        steps of exactly `batch` rows reached (None: it had none)."""
        prep, before = self.result["model"], server.decode_stats()
        run_load(server.url, fixed_batch(seed + batch, batch, MODEL, FIRST_WORD, self.words), math.inf)
        steps = stats_diff(server.decode_stats(), before).get(str(batch))
        if steps is None:
            return None
        return bound_fraction(steps, prep["weight_bytes"], prep["kv_bytes_per_token"], prep["copy_gbps"])

    def rag(self, server: Server) -> None:
        a = self.args
        shape = RagShape(docs=a.rag_docs, doc_tokens=a.rag_doc_tokens, per_request=a.rag_per_request, output_tokens=a.rag_out)
        corpus = rag_corpus(2, shape, FIRST_WORD, self.words)
        out: dict[str, Any] = {"shape": asdict(shape), "slo_ttft_p99_s": a.slo}
        # plain first: its ladder is short; if the time budget cuts the span ladder, its rate is a floor
        for mode, rates in (("plain", a.plain_rates), ("span", a.span_rates)):
            def mk(seed: int, n: int, cover: bool = False) -> list[Request]:
                reqs = rag_requests(seed, n, MODEL, corpus, shape, FIRST_WORD, self.words, spans=mode == "span",
                                    cover=cover)
                for r in reqs:  # each mode its own cache namespace: neither reuses the other's KV
                    r.body["cache_salt"] = mode
                return reqs

            self.load(server, mk(3, 0, cover=True), math.inf, 3)  # every document seen once
            runs = []
            for i, rate in enumerate(rates):
                if self.left() < a.reserve:
                    print(f"rag {mode}: stopping before rate {rate}: time budget", flush=True)
                    break
                runs.append(self.load(server, mk(20 + i, max(6, int(rate * a.duration))), rate, 20 + i))
                self._print_run(f"rag-{mode}", runs[-1])
                if runs[-1]["ttft_p99_s"] > a.slo or runs[-1]["errors"]:
                    break
            out[mode] = runs
            self.result["rag"] = out
            self.save()
        out["sustained"] = {m: sustained(out.get(m, []), a.slo) for m in ("span", "plain")}
        self.save()

    @staticmethod
    def _print_run(kind: str, r: dict[str, Any]) -> None:
        print(f"  {kind:10s} rate {r['offered_rate'] or 'sat':>6} -> {r['requests_per_s']:.2f} req/s "
              f"{r['output_tokens_per_s']:.0f} tok/s, TTFT p50/p99 {r['ttft_p50_s']:.3f}/{r['ttft_p99_s']:.3f} s, "
              f"ITL p50/p99 {1e3 * r['itl_p50_s']:.1f}/{1e3 * r['itl_p99_s']:.1f} ms, ok {r['ok']}/{r['requests']}"
              + (f" errors {r['errors']}" if r["errors"] else ""), flush=True)


def offline(a: argparse.Namespace, sat: list[Request], warm: list[Request]) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp())
    for name, reqs in (("sat.json", sat), ("warm.json", warm)):
        (tmp / name).write_text(json.dumps([asdict(r) for r in reqs]))
    return sh(["offline", str(a.model_dir), "--requests", str(tmp / "sat.json"), "--warmup", str(tmp / "warm.json"),
               *(["--max-num-seqs", str(a.max_num_seqs)] if a.max_num_seqs else []),
               *(["--kv-cache-memory", a.kv_cache_memory] if a.kv_cache_memory else []), *fp8_flags(a)],
              timeout=a.reserve + 40)


def fp8_flags(a: argparse.Namespace) -> list[str]:
    """The FP8 options, as `spanserve serve` and the write-model and offline children take them."""
    return [*(["--kv-cache-dtype", "fp8"] if a.kv_cache_dtype == "fp8" else []),
            *(["--quantization", a.quantization] if a.quantization else [])]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def ints2(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU, tiny model, tiny loads (checks the pipeline)")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--loads", default="chat,rag", help="which loads: chat, rag, sharegpt (comma-separated)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="the server's and offline engine's "
                    "(default: theirs, 256 on a GPU)")
    ap.add_argument("--sharegpt-requests", type=int, default=None, help="ShareGPT requests (1000)")
    ap.add_argument("--sharegpt-warmup", type=int, default=None)
    ap.add_argument("--roofline-batches", type=lambda t: [int(x) for x in t.split(",")], default=None,
                    help="fixed decode batches for the roofline (1,64,256)")
    ap.add_argument("--roofline-repeats", type=int, default=3, help="measured runs of each fixed batch")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the chunked-prefill budget")
    ap.add_argument("--kv-cache-memory", default=None, help="KV pool size for server and offline engine "
                    "(default: the server's, 80%% of free GPU memory)")
    ap.add_argument("--chat-in", type=float, default=None, help="median prompt tokens (250)")
    ap.add_argument("--chat-out", type=float, default=None, help="median output tokens (200)")
    ap.add_argument("--chat-rates", type=floats, default=None, help="Poisson rates, e.g. 6,18")
    ap.add_argument("--chat-saturation", type=int, default=None, help="requests in the saturation burst")
    ap.add_argument("--chat-warmup", type=int, default=None)
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per fixed-rate run")
    ap.add_argument("--rag-docs", type=int, default=None)
    ap.add_argument("--rag-doc-tokens", type=ints2, default=None, help="lo,hi")
    ap.add_argument("--rag-per-request", type=ints2, default=None, help="lo,hi documents per request")
    ap.add_argument("--rag-out", type=int, default=None, help="output tokens per RAG request")
    ap.add_argument("--span-rates", type=floats, default=None)
    ap.add_argument("--plain-rates", type=floats, default=None)
    ap.add_argument("--slo", type=float, default=None, help="p99 TTFT bound (s) for the sustained RAG rate")
    ap.add_argument("--no-rag", action="store_true")
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--no-overlap", action="store_true", help="the server takes decode steps one at a time")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for everything (440); RAG rates that would start later are skipped")
    ap.add_argument("--reserve", type=float, default=None, help="seconds kept for the offline run")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="server and offline engine")
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="server and offline engine")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    gpu = dict(model_dir=Path("/tmp/spanserve-serving-8b"), chat_in=250.0, chat_out=200.0, chat_rates=[6.0, 18.0],
               chat_saturation=192, chat_warmup=96, duration=10.0, rag_docs=32, rag_doc_tokens=(1000, 3000),
               rag_per_request=(4, 8), rag_out=32, span_rates=[2.0, 4.0, 8.0, 16.0, 32.0, 64.0],
               plain_rates=[0.5, 1.0, 2.0, 4.0], slo=2.0, budget=440.0, reserve=110.0, out="serving.json",
               sharegpt_requests=1000, sharegpt_warmup=200, roofline_batches=[1, 64, 256])
    dry = dict(model_dir=Path(tempfile.gettempdir()) / "spanserve-serving-tiny", chat_in=24.0, chat_out=12.0,
               chat_rates=[2.0], chat_saturation=8, chat_warmup=4, duration=2.0, rag_docs=6, rag_doc_tokens=(30, 90),
               rag_per_request=(2, 4), rag_out=4, span_rates=[1.0, 2.0], plain_rates=[1.0], slo=30.0, budget=150.0,
               reserve=45.0, kv_cache_memory="32MiB", out="serving_dry.json", sharegpt_requests=24,
               sharegpt_warmup=4, roofline_batches=[1, 4])
    for k, v in (dry if a.dry else gpu).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


CHILD_MODES = {"write-model": serving_model.main, "offline": serving_offline.main}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in CHILD_MODES:
        CHILD_MODES[argv[0]](argv[1:])
        return
    a = parse(argv)
    if a.dry:  # one thread per process: steadier on a shared CPU, and server and offline alike
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    d = Driver(a)
    print(f"preparing {a.model_dir} ...", flush=True)
    prep = sh(["write-model", str(a.model_dir), *(["--dry"] if a.dry else []), *fp8_flags(a)], timeout=300)
    print(f"  model ready in {prep['seconds']:.0f} s: {prep['weight_bytes'] / 1e9:.2f} GB of weights per decode step, "
          f"{prep['kv_bytes_per_token'] / 1024:.0f} KiB KV per token; copy bandwidth {prep['copy_gbps']:.0f} GB/s",
          flush=True)
    d.result["model"] = {k: v for k, v in prep.items() if k != "path"}
    d.words = prep["vocab_size"] - SPECIAL_BASE  # random text stays below the special ids
    flags = [*(["--kv-cache-memory", a.kv_cache_memory] if a.kv_cache_memory else []),
             *(["--max-num-seqs", str(a.max_num_seqs)] if a.max_num_seqs else []),
             *(["--engine-arg", f"max_num_batched_tokens={a.max_num_batched_tokens}"] if a.max_num_batched_tokens else []),
             *(["--no-overlap"] if a.no_overlap else []), *fp8_flags(a)]
    server = Server(str(a.model_dir), a.port, flags)
    warm = chat_requests(1, a.chat_warmup, MODEL, FIRST_WORD, d.words, a.chat_in, a.chat_out)
    try:
        server.wait_ready(timeout=300)
        d.result["server_log"] = [ln.replace(str(a.model_dir), a.model_dir.name) for ln in server.startup_log()]
        print("server start-up log:\n  " + "\n  ".join(d.result["server_log"]), flush=True)
        loads = a.loads.split(",")
        sat = d.chat(server) if "chat" in loads else []
        if "rag" in loads and not a.no_rag:
            d.rag(server)
        if "sharegpt" in loads:
            sat = d.sharegpt(server)
    finally:
        server.stop()
    roof = {"server": roofline(d.result["chat"][-1]["decode"], prep["weight_bytes"], prep["kv_bytes_per_token"],
                               prep["copy_gbps"])} if "chat" in d.result else {}
    if not a.no_offline and sat:
        print("offline engine on the same requests ...", flush=True)
        d.result["offline"] = offline(a, sat, warm)
        if "sharegpt" in d.result:
            d.result["sharegpt"]["offline_output_tok_s"] = d.result["offline"]["output_tokens_per_s"]
        roof["offline"] = roofline(d.result["offline"]["decode"], prep["weight_bytes"], prep["kv_bytes_per_token"],
                                   prep["copy_gbps"])
    d.result["roofline"] = roof
    d.result["elapsed_s"] = time.monotonic() - d.t0
    path = write_json(a.out, d.result)
    report(d.result)
    print(f"\n{d.result['elapsed_s']:.0f} s in all; wrote {path}")


if __name__ == "__main__":
    main()
