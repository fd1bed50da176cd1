"""A tensor-parallel worker killed mid-generation on GPUs (NCCL, CUDA graphs): how long until the
engine fails, and how.

On the CPU the gloo collective errors as soon as the peer's socket closes; on GPUs an NCCL
collective may wait on the device for ever, so the driver also watches the worker processes (a
monitor thread) and gives up on a stuck step after 10 s. (On two H200s NCCL reported the dead peer
itself within 0.2 s.) Two runs, random Llama-3-8B bf16 (--dry: tiny, CPU):

  raise    LLM(tensor_parallel_size=2) in a child process, its worker SIGKILLed during a long greedy
           generation: the call raises WorkerDied (and every later call), or, where the driver is
           stuck in a collective that cannot fail, the process exits non-zero with the log line;
  exit     the engine as `spanserve serve` builds it (tp_on_failure="exit"): the process exits
           non-zero with the log line naming the worker.

    NCCL_NVLS_ENABLE=0 python benchmarks/tp_failure_gpu.py
    python benchmarks/tp_failure_gpu.py --dry
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

from common import format_table, llama3_8b_config, write_json  # noqa: E402
from tp_gpu import tiny_config  # noqa: E402

LIMIT_S = 30.0


def engine(dry: bool, on_failure: str):  # noqa: ANN201 - LLM
    from spanserve import LLM
    from spanserve.model.weights import RandomWeights

    cfg = tiny_config() if dry else llama3_8b_config()
    kw = {} if dry else dict(device="cuda", dtype="bfloat16", backend="triton")
    return LLM(RandomWeights(cfg, seed=0), tensor_parallel_size=2, tp_on_failure=on_failure,
               num_blocks=4096, max_num_seqs=4, max_num_batched_tokens=2048, **kw)


def kill_after(pid: int, delay: float, at: list[float]) -> None:
    def go() -> None:
        time.sleep(delay)
        at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=go, daemon=True).start()


def child(dry: bool, on_failure: str) -> None:
    """Builds the engine, reports its worker's pid, generates until it fails."""
    import logging

    from spanserve import SamplingParams
    from spanserve.distributed.driver import WorkerDied

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llm = engine(dry, on_failure)
    llm.generate([101, 102, 103], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # graphs captured
    print(f"WORKER {llm.engine.tp.procs[0].pid}", flush=True)
    try:
        llm.generate([101, 102, 103], SamplingParams(max_tokens=100000, temperature=0, ignore_eos=True))
    except WorkerDied as e:
        print(f"RAISED {e}", flush=True)
    try:
        llm.generate([5], SamplingParams(max_tokens=2))
    except WorkerDied:
        print("LATER WorkerDied", flush=True)
    if on_failure == "exit":
        time.sleep(60)  # a server lives on: the engine must end the process itself
    llm.shutdown()


def run(dry: bool, on_failure: str) -> dict[str, object]:
    """The child's fate after its worker is killed: the first of a WorkerDied line or its exit."""
    cmd = [sys.executable, __file__, "--child", on_failure] + (["--dry"] if dry else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    at: list[float] = []
    ended = float("nan")
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("WORKER "):
            kill_after(int(line.split()[1]), 2.0, at)
        if line.startswith("RAISED ") and at:
            ended = time.monotonic()
    code = proc.wait(timeout=120)
    if at and ended != ended:  # no WorkerDied line: the process exit is the end
        ended = time.monotonic()
    text = "".join(lines)
    return {"on_failure": on_failure, "exit_code": code, "seconds_after_kill": ended - at[0] if at else None,
            "raised": next((x[7:].strip() for x in lines if x.startswith("RAISED ")), ""),
            "later_call_raised": "LATER WorkerDied" in text,
            "log_line": next((x.strip() for x in text.splitlines() if "tensor-parallel worker rank 1" in x
                              and not x.startswith("RAISED")), "")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="tiny model on the CPU (gloo)")
    ap.add_argument("--child", choices=["raise", "exit"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.dry, args.child)
        return
    res = [run(args.dry, mode) for mode in ("raise", "exit")]
    rows = [(f"tp_on_failure={r['on_failure']}", "WorkerDied" if r["raised"] else "-", r["later_call_raised"],
             r["exit_code"], f"{r['seconds_after_kill']:.1f}", r["log_line"][:100]) for r in res]
    print(format_table(["worker SIGKILLed mid-generation", "raised", "later call raised", "exit code",
                        "s after kill", "log line"], rows))
    ok = all((r["raised"] or r["exit_code"] != 0) and r["log_line"] and r["seconds_after_kill"] is not None
             and r["seconds_after_kill"] < LIMIT_S for r in res)
    print(f"every run failed clearly within {LIMIT_S:.0f} s: {ok}")
    write_json("tp_failure_gpu_dry.json" if args.dry else "tp_failure_gpu.json",
               {"benchmark": "tp_failure_gpu", "runs": res, "clear_within_limit": ok})


if __name__ == "__main__":
    main()
