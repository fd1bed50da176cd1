"""`spanserve serve` in a subprocess for the benchmarks that measure over HTTP: this checkout's
package on its path, ready once /health answers."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: Sequence[str], port: int, log: Path, env: Mapping[str, str] | None = None,
                 timeout_s: float = 900.0) -> subprocess.Popen[bytes]:
    """`spanserve serve --port PORT *args`, its output in `log`; raises with the log's tail if it
    exits or does not answer /health within timeout_s."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
    cmd = [sys.executable, "-m", "spanserve.cli", "serve", "--port", str(port), *args]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=full_env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not come up in {timeout_s:g} s")
