"""Tensor parallelism when it cannot go on: a worker killed mid-run fails the engine with a clear
error within 30 s (in a library: WorkerDied; a server exits non-zero with a log line), never a
hang. Also the replicated-KV case (fewer KV heads than ranks) against TP=1."""
import dataclasses
import os
import signal
import threading
import time

import httpx
import pytest
import torch
from span_helpers import capture_logits, run_all
from test_server_harness import build_tiny_model, core_pid, run_server, spawned_children

from spanserve import LLM, SamplingParams
from spanserve.distributed.driver import WorkerDied
from spanserve.model.config import ModelConfig
from spanserve.model.weights import RandomWeights

# One KV head over two ranks: each rank holds a copy of it.
ONE_KV = ModelConfig(arch="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=1, head_dim=8, max_position_embeddings=4096)


def test_replicated_kv_heads_then_a_killed_worker():
    model = RandomWeights(ONE_KV, seed=5)
    one = LLM(model, block_size=4, num_blocks=256)
    two = LLM(model, block_size=4, num_blocks=256, tensor_parallel_size=2)
    # 700 tokens in one step: its message (ids, positions, slots: ~22 KB) takes two broadcasts
    prompt = torch.randint(0, 97, (700,), generator=torch.Generator().manual_seed(0)).tolist()
    s1, s2 = capture_logits(one.engine), capture_logits(two.engine)
    (a,), (b,) = run_all(one.engine, [prompt]), run_all(two.engine, [prompt])
    torch.testing.assert_close(s2[b], s1[a], rtol=0, atol=1e-4)

    worker = two.engine.tp.procs[0]
    killed_at: list[float] = []

    def kill_soon() -> None:
        time.sleep(0.3)
        killed_at.append(time.monotonic())
        os.kill(worker.pid, signal.SIGKILL)

    threading.Thread(target=kill_soon, daemon=True).start()
    with pytest.raises(WorkerDied, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
        two.generate(prompt, SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True))
    assert killed_at and time.monotonic() - killed_at[0] < 30
    with pytest.raises(WorkerDied):  # and every later call, at once
        two.generate(prompt, SamplingParams(max_tokens=2))
    two.shutdown()


def test_a_step_failing_on_the_driver_stops_the_workers():
    """The workers are left inside a step the driver abandoned: the engine is done, not hung."""
    two = LLM(RandomWeights(ONE_KV, seed=1), block_size=4, num_blocks=64, tensor_parallel_size=2)

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    two.engine.model.forward = broken
    with pytest.raises(RuntimeError, match="injected failure"):
        two.generate([5, 6, 7], SamplingParams(max_tokens=2))
    worker = two.engine.tp.procs[0]
    worker.join(timeout=10)
    assert worker.exitcode is not None
    with pytest.raises(WorkerDied, match="out of step"):
        two.generate([5, 6, 7], SamplingParams(max_tokens=2))
    two.shutdown()


def test_heads_that_do_not_split_fail_before_any_process_starts():
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"):
        LLM(RandomWeights(ONE_KV), tensor_parallel_size=3)


def test_server_exits_when_a_worker_dies(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    with run_server(str(model), tmp_path, "--tensor-parallel-size", "2", "--kv-cache-memory", "4MiB") as srv:
        workers = spawned_children(core_pid(srv))  # the engine core is the TP driver
        assert len(workers) == 1
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "The quick brown fox",
                                                          "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200

        def long_request() -> None:
            try:
                httpx.post(f"{srv.url}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "The quick", "max_tokens": 400, "ignore_eos": True})
            except httpx.HTTPError:
                pass

        threading.Thread(target=long_request, daemon=True).start()
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        code = srv.proc.wait(timeout=30)
        assert time.monotonic() - t0 < 30
        assert code != 0
        assert "tensor-parallel worker rank 1" in srv.log_text()
