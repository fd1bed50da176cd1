"""The interface every attention backend implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from spanserve.attention.plan import AttentionPlan
from spanserve.rope import Rotary


class AttentionBackend(ABC):
    def sized_for(self, dtype: torch.dtype, head_dim: int) -> "AttentionBackend":
        """This backend as the engine runs it for a model of `dtype` and `head_dim` (a backend
        with tiles in on-chip memory picks their sizes here); by default itself."""
        return self

    def for_kv_cache(self, dtype: torch.dtype) -> "AttentionBackend":
        """This backend as the engine runs it over a KV cache of `dtype` (an 8-bit cache may take
        other paths); by default itself."""
        return self

    def for_shards(self, n: int) -> "AttentionBackend":
        """This backend cutting its launches as each of `n` tensor-parallel ranks would (with 1/n of
        the KV heads), so that one device computes their numerics (`model/cuts.py`); by default
        itself (a backend whose results do not depend on the head count)."""
        return self

    @abstractmethod
    def prepare(self, plan: AttentionPlan, rotary: Rotary, block_size: int) -> Any:
        """Turn the step's plan into whatever the backend reuses across layers."""

    def forward(self, prepared: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend every row; returns [T, H*D]."""
        self.write(prepared, k, v, k_cache, v_cache)
        return self.attend(prepared, q, k_cache, v_cache)

    @abstractmethod
    def write(self, prepared: Any, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor) -> None:
        """Scatter this step's K ([T, KVH, D], rotated by local position) and V into the cache."""

    @abstractmethod
    def attend(
        self,
        prepared: Any,
        q: torch.Tensor,  # [T, H, D], rotated by its position
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] for this layer
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Attend every row over the cache (this step's K/V already written); [T, H*D]."""
