"""Hostile requests against a CPU server: does one client's unfriendly request stall another's?

`spanserve serve` (a subprocess, default flags: the engine core in a process of its own, the
default request limits) serves SmolLM2-135M on the CPU. A probe sends a 1-token completion
every 200 ms, first alone (the idle baseline), then while each unfriendly request class of
docs/security.md is sent once: a 10 MB prompt, /tokenize of it, a response_format pattern
`[a-z]{1,20000}`, 64 prompts x n=16, 1M stop strings, a 300 MiB chunked body, and a span query
whose repeats expand to 10^10 nodes. For each class it records the status code and the time to
reject, and the probe's p50 and max latency against idle; the acceptance is a probe max within
2x the idle max for every class.

    python benchmarks/hostile.py              # about 2 minutes on a 2-core CPU
    python benchmarks/hostile.py --quick      # shorter windows
"""
from __future__ import annotations

import argparse
import json
import select
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # this checkout's spanserve
from common import format_table, write_json
from common.server_process import free_port, start_server

ROOT = Path(__file__).resolve().parents[1]
PROBE = {"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0.0}
PROBE_EVERY_S = 0.2
TEN_MB = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 175_439  # 10.0 MB
PATTERN = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"s": {"type": "string", "pattern": "[a-z]{1,20000}"}}, "required": ["s"]}}}


class Probe:
    """A 1-token completion every PROBE_EVERY_S on its own connection, latencies kept per window."""

    def __init__(self, base: str):
        self.client = httpx.Client(base_url=base, timeout=300)
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.latencies, self.failures = [], 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            t0 = time.monotonic()
            r = self.client.post("/v1/completions", json=PROBE)
            if r.status_code == 200:
                self.latencies.append(time.monotonic() - t0)
            else:
                self.failures += 1
            due += PROBE_EVERY_S
            self._stop.wait(max(0.0, due - time.monotonic()))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return {**summary(self.latencies), "failed": self.failures, "latencies": list(self.latencies)}


# ---- the unfriendly requests: each returns its status code ------------------------------------
def _post(base: str, path: str, body: bytes) -> tuple[int, float]:
    """(status, seconds to the answer). Bodies are encoded before the probes' window opens: this
    process's own JSON encoding would hold the GIL its probe thread needs."""
    t0 = time.monotonic()
    r = httpx.post(f"{base}{path}", content=body, headers={"content-type": "application/json"}, timeout=600)
    return r.status_code, time.monotonic() - t0


def chunked_upload(port: int, mib: int) -> tuple[int, float]:
    """`mib` MiB as a chunked body (no Content-Length) over a raw socket, sent whole whatever the
    server answers meanwhile, as a hostile client would: (status, seconds to the answer)."""
    t0 = time.monotonic()
    answered = None
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n" % (1 << 20) + b"x" * (1 << 20) + b"\r\n"
        try:
            for _ in range(mib):
                if answered is None and select.select([sock], [], [], 0)[0]:
                    answered = time.monotonic() - t0
                sock.sendall(chunk)
            sock.sendall(b"0\r\n\r\n")
        except OSError:  # the server closed the connection on the rest
            pass
        status = int(sock.recv(4096).split(b" ", 2)[1])
    return status, answered if answered is not None else time.monotonic() - t0


def exploding_query() -> dict[str, Any]:
    """Repeats nested five deep, 100 each: 10^10 user messages in one generation's input."""
    q: dict[str, Any] = {"user": "x"}
    for _ in range(5):
        q = {"repeat": {"n": 100, "query": q}}
    return {"g": {"model": "m", "input": q, "max_tokens": 1}}


def classes(base: str, port: int) -> list[tuple[str, Callable[[], tuple[int, float]]]]:
    def post(path: str, body: dict[str, Any]) -> Callable[[], tuple[int, float]]:
        data = json.dumps(body).encode()
        return lambda: _post(base, path, data)

    chat = {"messages": [{"role": "user", "content": "Give me JSON."}], "max_tokens": 8}
    return [
        ("10 MB text prompt", post("/v1/completions", {"prompt": TEN_MB, "max_tokens": 1})),
        ("/tokenize of the 10 MB prompt", post("/tokenize", {"prompt": TEN_MB})),
        ("response_format pattern [a-z]{1,20000}", post("/v1/chat/completions", {**chat, "response_format": PATTERN})),
        ("64 prompts x n=16", post("/v1/completions", {"prompt": ["Tell me a story."] * 64, "n": 16,
                                                       "max_tokens": 64})),
        ("1M stop strings", post("/v1/completions", {"prompt": "Hello", "max_tokens": 8,
                                                     "stop": [f"s{i}" for i in range(1_000_000)]})),
        ("300 MiB chunked body", lambda: chunked_upload(port, 300)),
        ("span query repeating to 10^10 nodes", post("/v1/query/execute", exploding_query())),
    ]


def residual(base: str) -> list[tuple[str, Callable[[], tuple[int, float]]]]:
    """Beyond the classes above: a body just under the 64 MiB limit of small JSON items, which the
    event loop parses before any bound applies (the remaining cost; docs/security.md)."""
    ids = b'{"prompt": [' + b",".join([b"1"] * 30_000_000) + b'], "max_tokens": 1}'
    return [("57 MiB of token ids (residual)", lambda: _post(base, "/v1/completions", ids))]


def run_class(probe: Probe, send: Callable[[], tuple[int, float]], window_s: float) -> tuple[dict[str, Any], list[float]]:
    """Probe alone for window_s (the idle baseline of this moment: the machine is shared), then
    send the request and keep probing until it is answered and window_s has passed since."""
    probe.start()
    time.sleep(window_s)
    idle = probe.stop()["latencies"]
    probe.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    status, reject_s = send()
    time.sleep(max(0.0, window_s - (time.monotonic() - t0)))
    return {"status": status, "reject_s": reject_s, **probe.stop()}, idle


def measure(model: str, window_s: float, threads: int) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    rows: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    idle: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(["--model", model, "--device", "cpu"], port, Path(tmp) / "server.log",
                            env={"OMP_NUM_THREADS": str(threads)}, timeout_s=600)  # torch threads in the core
        try:
            probe = Probe(base)
            for _ in range(5):  # warm: the first requests compile paths and fill the prefix cache
                probe.client.post("/v1/completions", json=PROBE)
            for name, send in classes(base, port):
                rows[name], before = run_class(probe, send, window_s)
                idle += before
            for name, send in residual(base):
                extra[name], _ = run_class(probe, send, window_s)
        finally:
            proc.terminate()
            proc.wait(30)
    return {"idle": summary(idle), "classes": rows, "residual": extra}


def summary(xs: list[float]) -> dict[str, Any]:
    return {"probes": len(xs), "p50_s": statistics.median(xs) if xs else None, "max_s": max(xs) if xs else None}


def _row(name: str, r: dict[str, Any], idle: dict[str, Any]) -> list[Any]:
    return [name, r["status"], r["reject_s"], r["probes"], r["p50_s"] * 1e3, r["p50_s"] / idle["p50_s"],
            r["max_s"] * 1e3, r["max_s"] / idle["max_s"]]


def report(result: dict[str, Any]) -> tuple[str, bool]:
    idle = result["idle"]
    ok = all(r["max_s"] <= 2.0 * idle["max_s"] and r["failed"] == 0 for r in result["classes"].values())
    rows = [_row(n, r, idle) for n, r in result["classes"].items()]
    rows += [_row(n, r, idle) for n, r in result["residual"].items()]
    table = format_table(["unfriendly request", "status", "rejected after s", "probes", "probe p50 ms",
                          "p50 / idle", "probe max ms", "max / idle max"], rows)
    head = (f"idle (probed before each class): {idle['probes']} probes, p50 {idle['p50_s'] * 1e3:.1f} ms, "
            f"max {idle['max_s'] * 1e3:.1f} ms")
    verdict = f"probe max within 2x idle max for every class (residual aside): {'yes' if ok else 'NO'}"
    return f"{head}\n{table}\n{verdict}", ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="served model (default: SmolLM2-135M)")
    ap.add_argument("--window", type=float, default=5.0,
                    help="seconds of idle probing before each class, and of probing after it is sent")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the engine core (one keeps the probe steady on a shared 2-core machine)")
    ap.add_argument("--quick", action="store_true", help="2 s windows")
    ap.add_argument("--out", default=None, help="JSON name under benchmarks/results/ (default hostile.json)")
    args = ap.parse_args(argv)
    window_s = 2.0 if args.quick else args.window
    result = measure(args.model, window_s, args.threads)
    text, ok = report(result)
    print(text)
    for r in [*result["classes"].values(), *result["residual"].values()]:
        del r["latencies"]
    name = args.out or ("hostile_quick.json" if args.quick else "hostile.json")
    path = write_json(name, {"model": args.model, "engine_threads": args.threads, "probe": PROBE,
                             "probe_every_s": PROBE_EVERY_S, "window_s": window_s, "within_2x_idle": ok, **result})
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
