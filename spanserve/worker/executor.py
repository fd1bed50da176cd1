"""What the engine runs its steps on: one device (`worker.runner.ModelRunner`) or every rank of a
tensor-parallel group (`distributed.driver.TPExecutor`). The engine chooses one when it is built
and speaks to it through this interface only."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from spanserve.attention.paths import GraphLimits
from spanserve.model.llama import LlamaModel
from spanserve.worker.host_tokens import HostTokens
from spanserve.worker.step import StepInput, StepOutput
from spanserve.worker.storage import KVStorage


class Executor(ABC):
    model: LlamaModel  # this process's shard (the whole model on one device)
    storage: KVStorage
    backend: Any  # the attention backend

    @property
    @abstractmethod
    def graph_limits(self) -> GraphLimits | None:
        """The steps that replay CUDA graphs; None: every step is eager."""

    @abstractmethod
    def run(self, step: StepInput, ids: torch.Tensor | None = None, wait: bool = True) -> StepOutput:
        """Runs a prepared step. `ids`: a chained decode step's input ids, still on the device.
        wait=False: the caller waits on the device later, through `fetch`."""

    @abstractmethod
    def logits_at(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Float32 logits of the given rows of a step's hidden states (prompt logprobs)."""

    @abstractmethod
    def fetch(self, tokens: HostTokens) -> list[list]:
        """The host's copies of tokens picked on the device and what came with them (waits)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release what the executor holds on its devices (graphs, and under TP the workers)."""
