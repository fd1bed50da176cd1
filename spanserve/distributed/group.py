"""The process group of one tensor-parallel engine: the collectives the sharded model needs and
the control channel that carries each step's message from the driver to the workers."""
from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from spanserve.model.fp8 import Fp8Weight, Weight, fp8_linear
from spanserve.model.layers import has_mm_out_dtype, mm_float32

# Workers wait on the control channel for as long as the engine is idle (a server with no
# requests): its collectives must never time out. Peer death is seen as a closed connection.
_IDLE_FOREVER = datetime.timedelta(days=365)
_HEAD = 16 << 10  # bytes of a message's first broadcast


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
    # Partial products of row-parallel projections kept in float32 through the all-reduce and
    # rounded once, as one GPU's GEMM rounds its float32 accumulator once: bf16 TP=N then tracks
    # TP=1 closely (at twice the bytes on the wire).
    float32_reduce: bool = False

    # Short steps' sums through GPU peer memory, fused with the residual add and RMSNorm
    # (distributed/peer_sum.py); made by `enable_peer_sum` once the model's shape is known.
    peer_sum: bool = True

    def __post_init__(self) -> None:
        # Probed once, outside any CUDA graph capture (an exception there would spoil it).
        self._native_f32 = self.float32_reduce and has_mm_out_dtype(self.device)
        self.peer: Any = None

    def enable_peer_sum(self, hidden: int, dtype: torch.dtype) -> None:
        """Collective: every rank calls it once, after loading its shard."""
        if not self.peer_sum or self.float32_reduce or self.device.type != "cuda":
            return
        from spanserve.distributed.peer_sum import PeerSum

        peer = PeerSum.make(self.rank, self.world, hidden, dtype, self.device, dist.group.WORLD.group_name)
        # All ranks or none (one summing through NCCL while another waits on a flag would hang);
        # this also makes every rank's flags zero before any rank raises one.
        self.peer = peer if self.min_over_ranks(int(peer is not None)) else None

    @classmethod
    def join(cls, rank: int, world: int, port: int, device_type: str, float32_reduce: bool = False,
             peer_sum: bool = True) -> "TPGroup":
        device = rank_device(device_type, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs: dict[str, Any] = {}
        if device.type == "cuda":
            kwargs["device_id"] = device  # binds the communicator to this GPU up front
        if dist.is_initialized():  # an earlier engine's teardown failed (a peer died): start clean
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=_IDLE_FOREVER, **kwargs)
        control = dist.new_group(backend="gloo", timeout=_IDLE_FOREVER) if backend != "gloo" else dist.group.WORLD
        return cls(rank, world, device, control, float32_reduce, peer_sum)

    # ---- the model's collectives ---------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (row-parallel projections' partial outputs)."""
        dist.all_reduce(x)
        return x

    def row_linear(self, x: torch.Tensor, weight: Weight,
                   linear: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
        """Sum over ranks of linear(x, weight) = x @ weight.T (this rank's input columns)."""
        if not self.float32_reduce or x.dtype == torch.float32:
            return self.all_reduce(linear(x, weight))
        x2 = x.reshape(-1, x.shape[-1])
        if isinstance(weight, Fp8Weight):  # its float32 accumulator, scaled, unrounded
            part = self.all_reduce(fp8_linear(x2, weight, out_dtype=torch.float32))
        else:
            part = self.all_reduce(mm_float32(x2, weight.t(), self._native_f32))
        return part.to(x.dtype).view(*x.shape[:-1], weight.shape[0])

    def fuses(self, residual: torch.Tensor) -> bool:
        """Whether `reduce_add` onto this residual stream goes through peer memory."""
        return self.peer is not None and self.peer.fits(residual)

    def reduce_add(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                   eps: float) -> "tuple[torch.Tensor | None, torch.Tensor]":
        """(rms_norm(residual + sum) * weight or None, residual + sum), sum = x summed over ranks
        through peer memory; only where `fuses(residual)`."""
        return self.peer.add(x, residual, weight, eps)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[n, V/world] shards of the vocabulary-parallel LM head -> [n, V] on every rank."""
        if logits.shape[0] == 0:  # no sampled row this step (every rank knows): nothing to send
            return logits.new_zeros(0, vocab_size)
        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def broadcast_ids(self, ids: torch.Tensor) -> None:
        """The driver's picked token ids into every rank's input buffer, in place, on the device:
        a decode step chained on the last one's picks needs no word from the host."""
        dist.broadcast(ids, 0)

    # ---- the control channel ------------------------------------------------------------------
    def send(self, obj: Any) -> None:
        """Driver: one message to every worker. Messages up to _HEAD bytes (a step's host data
        usually) cost one broadcast; longer ones a second for the rest."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        head = torch.zeros(_HEAD, dtype=torch.uint8)
        head[:8] = torch.frombuffer(bytearray(len(data).to_bytes(8, "little")), dtype=torch.uint8)
        first = data[:_HEAD - 8]
        if first:
            head[8:8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        dist.broadcast(head, 0, group=self.control)
        if len(data) > len(first):
            dist.broadcast(torch.frombuffer(bytearray(data[len(first):]), dtype=torch.uint8), 0, group=self.control)

    def recv(self) -> Any:
        """Worker: the driver's next message."""
        head = torch.empty(_HEAD, dtype=torch.uint8)
        dist.broadcast(head, 0, group=self.control)
        raw = head.numpy().tobytes()
        n = int.from_bytes(raw[:8], "little")
        data = raw[8:8 + n]
        if n > len(data):
            rest = torch.empty(n - len(data), dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.control)
            data += rest.numpy().tobytes()
        return pickle.loads(data)

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
