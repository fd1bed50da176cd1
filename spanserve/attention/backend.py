"""The interface every attention backend implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from spanserve.attention.plan import AttentionPlan
from spanserve.model.layers import Rotary


class AttentionBackend(ABC):
    @abstractmethod
    def prepare(self, plan: AttentionPlan, rotary: Rotary, block_size: int) -> Any:
        """Turn the step's plan into whatever the backend reuses across layers."""

    @abstractmethod
    def forward(
        self,
        prepared: Any,
        q: torch.Tensor,  # [T, H, D], rotated by its position
        k: torch.Tensor,  # [T, KVH, D], rotated by its local position
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] for this layer
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend every row; returns [T, H*D]."""
