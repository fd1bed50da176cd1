"""The process group of one tensor-parallel engine: the collectives the sharded model needs and
the control channel that carries each step's message from the driver to the workers."""
from __future__ import annotations

import datetime
import os
import pickle
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# Workers wait on the control channel for as long as the engine is idle (a server with no
# requests): its collectives must never time out. Peer death is seen as a closed connection.
_IDLE_FOREVER = datetime.timedelta(days=365)


def free_port() -> int:
    """A free TCP port on the loopback interface for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


@dataclass
class TPGroup:
    """This process's membership. `control` is a gloo group (host tensors): step messages travel
    there without touching the GPU stream; the default group carries the model's collectives."""

    rank: int
    world: int
    device: torch.device
    control: Any

    @classmethod
    def join(cls, rank: int, world: int, port: int, device_type: str) -> "TPGroup":
        device = rank_device(device_type, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {}
        if device.type == "cuda":
            kwargs["device_id"] = device  # binds the communicator to this GPU up front
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=_IDLE_FOREVER, **kwargs)
        control = dist.new_group(backend="gloo", timeout=_IDLE_FOREVER) if backend != "gloo" else dist.group.WORLD
        return cls(rank, world, device, control)

    # ---- the model's collectives ---------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (row-parallel projections' partial outputs)."""
        dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[n, V/world] shards of the vocabulary-parallel LM head -> [n, V] on every rank."""
        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    # ---- the control channel ------------------------------------------------------------------
    def send(self, obj: Any) -> None:
        """Driver: one message to every worker (a size, then the pickled bytes)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.control)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.control)

    def recv(self) -> Any:
        """Worker: the driver's next message."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.control)
        buf = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.control)
        return pickle.loads(buf.numpy().tobytes())

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def quiet_threads() -> None:
    """Workers on the CPU share the machine with the driver: one torch thread each unless told."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
