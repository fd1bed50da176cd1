"""A tensor-parallel worker SIGKILLed mid-generation on two GPUs (NCCL, CUDA graphs). An NCCL
collective may wait on the device for ever, so the driver also watches its workers and gives up
on a stuck step; either way the engine fails clearly within 30 s:

- tp_on_failure="raise" (the library): the call raises WorkerDied, and so does every later call
  (or, where the driver is stuck in a collective that cannot fail, the process exits non-zero
  with the log line);
- tp_on_failure="exit" (what `spanserve serve` builds): the process exits non-zero with a log
  line naming the worker."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

CHILD = Path(__file__).resolve().parent / "tp_failure_child.py"
LIMIT_S = 30.0
pytestmark = pytest.mark.gpus(2)


def kill_after(pid: int, delay: float, at: list[float]) -> None:
    def go() -> None:
        time.sleep(delay)
        at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=go, daemon=True).start()


def run_child(on_failure: str) -> dict[str, object]:
    """The child's fate after its worker is killed: the first of a WorkerDied line or its exit."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0",
               PYTHONPATH=os.pathsep.join([str(CHILD.parent), *sys.path]))
    proc = subprocess.Popen([sys.executable, str(CHILD), on_failure], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    lines: list[str] = []
    at: list[float] = []
    ended = math.nan
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("WORKER "):
            kill_after(int(line.split()[1]), 2.0, at)
        if line.startswith("RAISED ") and at:
            ended = time.monotonic()
    code = proc.wait(timeout=180)
    assert at, "the child never reported its worker:\n" + "".join(lines)[-3000:]
    if math.isnan(ended):  # no WorkerDied line: the process exit is the end
        ended = time.monotonic()
    text = "".join(lines)
    return {"exit_code": code, "seconds": ended - at[0], "raised": "RAISED " in text,
            "later_raised": "LATER WorkerDied" in text, "text": text,
            "log_line": any("tensor-parallel worker rank 1" in x and not x.startswith("RAISED")
                            for x in text.splitlines())}


def test_a_killed_worker_raises_worker_died():
    r = run_child("raise")
    assert r["seconds"] < LIMIT_S and r["log_line"], r["text"][-3000:]
    if r["raised"]:
        assert r["later_raised"], r["text"][-3000:]
    else:  # the driver was stuck in a collective: the process ended instead, saying why
        assert r["exit_code"] != 0, r["text"][-3000:]


def test_a_killed_worker_ends_a_server_engine():
    r = run_child("exit")
    assert r["exit_code"] != 0 and r["log_line"], r["text"][-3000:]
    assert r["seconds"] < LIMIT_S, r["text"][-3000:]
