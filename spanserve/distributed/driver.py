"""The driver side of a tensor-parallel engine (rank 0). It keeps everything that decides (the
scheduler, cache manager, keys, span logic, sampling) and runs rank 0's shard of the model, as the
other ranks do theirs: N GPUs serve TP=N, none sits idle holding only the driver.

Worker death is watched by a thread that polls the worker processes: a step in progress fails
with WorkerDied (on gloo the collective itself errors once the peer's connection closes); if the
driver is stuck in a collective that cannot fail (NCCL waits on the GPU), or the engine was built
to exit on failure (a server), the process exits non-zero after a clear log line."""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from typing import Any, Iterator

import torch
import torch.multiprocessing as mp

from spanserve.attention.paths import GraphLimits
from spanserve.distributed.block_transfer import TPStorage
from spanserve.distributed.group import TPGroup, free_port
from spanserve.distributed.step import ScoreRows, StepMessage, pack
from spanserve.distributed.storage_log import RecordingStorage
from spanserve.distributed.worker import EngineInit, WorkerArgs, free_memory, load_shard, worker_main
from spanserve.model.fingerprint import whole_model_fingerprint
from spanserve.model.shard import check_divisible
from spanserve.model.weights import source_of
from spanserve.worker.executor import Executor
from spanserve.worker.host_tokens import HostTokens
from spanserve.worker.runner import ModelRunner
from spanserve.worker.step import StepInput, StepOutput

log = logging.getLogger("spanserve.tp")
POLL_S = 0.2
STUCK_S = 10.0  # a collective still running this long after a worker died will never finish


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot run another step."""


def check_devices(world: int, device: torch.device) -> None:
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    if device.type == "cuda":
        n = torch.cuda.device_count()
        if world > n:
            raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs but {n} are visible")
        if device.index not in (None, 0):
            raise ValueError("tensor parallelism uses GPUs 0..N-1 (rank r on cuda:r); pass device='cuda' "
                             "and choose GPUs with CUDA_VISIBLE_DEVICES")
    elif device.type != "cpu":
        raise ValueError(f"tensor parallelism runs on cuda (NCCL) or cpu (gloo), not {device.type}")


class TPDriver:
    # Symmetric memory is set up once per process group name: a second engine in this process
    # (its group is named as the first one was) would wait for ever in the rendezvous.
    _peer_used = False

    def __init__(self, model: Any, world: int, device: torch.device, dtype: torch.dtype, on_failure: str = "raise",
                 float32_reduce: bool = False, peer_sum: bool = True, quantization: str | None = None):
        if on_failure not in ("raise", "exit"):
            raise ValueError(f"on_failure must be 'raise' or 'exit', got {on_failure!r}")
        check_devices(world, device)
        source = self.source = source_of(model)
        self.config, self.tokenizer = source.describe()
        check_divisible(self.config, world)
        if peer_sum and device.type == "cuda":
            if TPDriver._peer_used:
                log.info("tensor parallel: peer-memory sums off (an earlier engine in this process set them up; "
                         "symmetric memory cannot be set up again here); NCCL does every sum")
                peer_sum = False
            TPDriver._peer_used = TPDriver._peer_used or peer_sum
        self.on_failure = on_failure
        self.dead: str | None = None
        self._closing = False  # exits from here on are expected: the monitor stops
        self._closed = False
        self._busy = 0.0  # monotonic start of the collective in progress, 0 when none
        port = free_port()
        ctx = mp.get_context("spawn")
        wsource = source.for_workers()
        self.procs = [ctx.Process(target=worker_main, name=f"spanserve-tp{r}", daemon=True,
                                  args=(WorkerArgs(r, world, port, device.type, dtype, self.config, wsource, float32_reduce,
                                                    peer_sum, quantization),))
                      for r in range(1, world)]
        for p in self.procs:
            p.start()
        self._monitor = threading.Thread(target=self._watch, name="spanserve-tp-monitor", daemon=True)
        self._monitor.start()
        atexit.register(self.close)
        with self.collective():
            self.group = TPGroup.join(0, world, port, device.type, float32_reduce, peer_sum)
            self.model = load_shard(self.group, self.config, source, dtype, quantization)
            self.min_free = self.group.min_over_ranks(free_memory(self.group.device))
        log.info("tensor parallel: %d ranks on %s, %d of %d heads and %d of %d KV heads per rank", world,
                 device.type, self.model.config.num_heads, self.config.num_heads, self.model.config.num_kv_heads,
                 self.config.num_kv_heads)

    # ---- engine parts ----------------------------------------------------------------------
    def storage(self, num_blocks: int, block_size: int, backend: Any, cuda_graphs: Any,
                max_batch: int = 256, kv_dtype: torch.dtype | None = None) -> TPStorage:
        """This rank's KV storage (elements of `kv_dtype`, default the model's); the workers make
        theirs (same blocks, their heads) and their runners (graphs up to `max_batch` decode rows)."""
        with self.collective():
            self.group.send(EngineInit(num_blocks, block_size, backend, cuda_graphs, max_batch, kv_dtype))
        return TPStorage(self.model.config, num_blocks, block_size, kv_dtype or self.model.dtype, self.model.device,
                         driver=self, whole=self.config)

    def fingerprint(self, block_size: int, kv_dtype: torch.dtype | None = None) -> bytes:
        """The tiers' model identity, equal to what the same model gives at TP=1."""
        return whole_model_fingerprint(self.source, self.config, self.model.dtype, block_size, self.group.device,
                                       self.model.quantization, kv_dtype)

    def executor(self, storage: RecordingStorage, backend: Any, cuda_graphs: Any, max_batch: int = 256) -> "TPExecutor":
        return TPExecutor(self, ModelRunner(self.model, storage, backend, cuda_graphs, max_batch))

    # ---- failure ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def collective(self) -> Iterator[None]:
        """Marks work that waits on the workers: a death during it is a failure of this call."""
        self._raise_if_dead()
        self._busy = time.monotonic()
        try:
            yield
        except Exception as e:
            if self._wait_for_death(1.0):
                raise WorkerDied(self.dead) from e
            self._break(f"a step failed on the driver ({type(e).__name__}: {e}), leaving the workers out of step")
            raise
        finally:
            self._busy = 0.0
        self._raise_if_dead()

    def _raise_if_dead(self) -> None:
        if self.dead is not None:
            raise WorkerDied(self.dead)

    def _wait_for_death(self, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while self.dead is None and time.monotonic() < end:
            time.sleep(POLL_S / 2)
        return self.dead is not None

    def _watch(self) -> None:
        while not self._closing:
            for p in self.procs:
                if p.exitcode is not None and not self._closing:
                    self._died(p)
                    return
            time.sleep(POLL_S)

    def _died(self, p: Any) -> None:
        rank = self.procs.index(p) + 1
        self.dead = (f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}; "
                     "the engine cannot continue")
        log.error("%s", self.dead)
        for q in self.procs:  # the rest cannot finish a collective without it
            if q.exitcode is None:
                q.terminate()
        deadline = time.monotonic() + STUCK_S
        while self._busy and time.monotonic() < deadline:
            time.sleep(POLL_S)  # the step in progress fails over to its callers
        if self.on_failure == "raise" and not self._busy:
            return  # idle, or the step raised: every later call raises WorkerDied
        log.error("tensor parallel: %s; exiting", "the driver is stuck in a collective" if self._busy
                  else "serving cannot continue")
        logging.shutdown()
        os._exit(1)

    def _break(self, reason: str) -> None:
        """The ranks no longer agree on where they are: stop the workers, fail every later call."""
        self.dead = reason + "; the engine cannot continue"
        self._closing = True  # the monitor stops: these exits are ours
        log.error("tensor parallel: %s", self.dead)
        for q in self.procs:
            if q.exitcode is None:
                q.terminate()
        if self.on_failure == "exit":
            logging.shutdown()
            os._exit(1)

    def close(self) -> None:
        """Stop the workers (idempotent; also runs at interpreter exit)."""
        if self._closed:
            return
        self._closed = self._closing = True
        if self.dead is None and hasattr(self, "group"):
            with contextlib.suppress(Exception):
                self.group.send(StepMessage([], None))
        for p in self.procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.terminate()
                p.join(timeout=5)
        # NCCL's teardown can wait on a collective a dead peer never joins: leave that to exit
        if hasattr(self, "group") and (self.dead is None or self.group.device.type != "cuda"):
            with contextlib.suppress(Exception):
                self.group.leave()
        atexit.unregister(self.close)


class TPExecutor(Executor):
    """Rank 0's runner behind the driver: each step's host data goes to the workers once, then
    every rank runs the same step on its shard."""

    def __init__(self, driver: TPDriver, runner: ModelRunner):
        self.driver, self.runner = driver, runner
        self.model, self.storage, self.backend = runner.model, runner.storage, runner.backend

    @property
    def graph_limits(self) -> GraphLimits | None:
        return self.runner.graph_limits

    def run(self, step: StepInput, ids: torch.Tensor | None = None, wait: bool = True) -> StepOutput:
        assert isinstance(self.storage, RecordingStorage)
        with self.driver.collective():
            self.driver.group.send(StepMessage(self.storage.drain(), pack(step)))
            out = self.runner.run(step, ids)
            if wait and out.logits.is_cuda:  # NCCL fails by never finishing: wait here, where a death is noticed
                torch.cuda.current_stream().synchronize()
        return out

    def fetch(self, tokens: HostTokens) -> list[list]:
        with self.driver.collective():  # the wait a chained step left for later
            return self.runner.fetch(tokens)

    def logits_at(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        assert isinstance(self.storage, RecordingStorage)
        with self.driver.collective():
            self.driver.group.send(ScoreRows(self.storage.drain(), rows))
            logits = self.runner.logits_at(hidden, rows)
            if logits.is_cuda:
                torch.cuda.current_stream().synchronize()
        return logits

    def shutdown(self) -> None:
        if self.driver.dead is None:  # a dead peer's collective never finishes: no waiting on it
            self.runner.release_graphs()
        self.driver.close()
