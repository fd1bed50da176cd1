"""Run by test_gpu_tp_failure.py in a child process: an LLM with tensor_parallel_size=2 on two GPUs
(random Llama-3-8B bf16, NCCL, CUDA graphs) that prints its worker's pid and then generates until
the worker is killed.

    python tests/gpu/tp_failure_child.py raise|exit
"""
from __future__ import annotations

import logging
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (inherited by workers)

from gpu_helpers import LLAMA3_8B  # noqa: E402
from spanserve import LLM, SamplingParams  # noqa: E402
from spanserve.model.weights import RandomWeights  # noqa: E402
from spanserve.distributed.driver import WorkerDied  # noqa: E402


def main(on_failure: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llm = LLM(RandomWeights(LLAMA3_8B, seed=0), tensor_parallel_size=2, tp_on_failure=on_failure, device="cuda",
              dtype="bfloat16", backend="triton", num_blocks=4096, max_num_seqs=4, max_num_batched_tokens=2048)
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


if __name__ == "__main__":
    main(sys.argv[1])
