"""Which slice of each Hugging Face-named tensor a rank holds (Megatron-style).

Column-parallel (split along outputs): q/k/v and gate/up projections, and the LM head (along the
vocabulary, padded to equal shards). Row-parallel (split along inputs): o and down, whose partial
outputs one all-reduce each sums. KV heads are split with the query heads that read them; when
there are fewer KV heads than ranks each rank holds the one its query heads read (replicated).
Norms and the embedding are whole on every rank: an embedding lookup reads T rows, so splitting it
would save memory but cost one more all-reduce per step."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch

from spanserve.model.config import ModelConfig

_LAYER = re.compile(r"model\.layers\.\d+\.(.+)")
# name suffix -> dimension the tensor is split along (both weights and biases)
_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")


def shard_dim(name: str) -> int | None:
    """The dimension `name` is split along, None when every rank holds it whole."""
    if name == "lm_head.weight":
        return 0
    m = _LAYER.fullmatch(name)
    if m is None:
        return None
    module = m.group(1).rsplit(".", 1)[0]
    if module in _COLUMN:
        return 0
    if module in _ROW and m.group(1).endswith(".weight"):
        return 1
    return None


def check_divisible(config: ModelConfig, world: int) -> None:
    """Clear errors for shapes that do not split over `world` ranks."""
    if world < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world}")
    H, KVH = config.num_heads, config.num_kv_heads
    if H % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide the model's {H} attention heads")
    if KVH % world and world % KVH:
        raise ValueError(f"tensor_parallel_size {world} and the model's {KVH} KV heads: one must divide the other")
    if config.intermediate_size % world:
        raise ValueError(f"tensor_parallel_size {world} does not divide the MLP width {config.intermediate_size}")


@dataclass(frozen=True)
class ShardPlan:
    config: ModelConfig  # the whole model's
    rank: int
    world: int

    def __post_init__(self) -> None:
        check_divisible(self.config, self.world)

    @property
    def kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.world)

    @property
    def kv_head0(self) -> int:
        """The first of the whole model's KV heads this rank holds (it holds `kv_heads` of them)."""
        c, w = self.config, self.world
        if c.num_kv_heads >= w:
            return self.rank * self.kv_heads
        return self.rank // (w // c.num_kv_heads)  # the KV head this rank's query heads read

    @property
    def vocab_shard(self) -> int:
        return -(-self.config.vocab_size // self.world)

    def local_config(self) -> ModelConfig:
        """The shapes this rank's model sees. The LM head is always its own tensor here (a tied
        one is a slice of the embedding, which stays whole)."""
        c = self.config
        return dataclasses.replace(c, num_heads=c.num_heads // self.world, num_kv_heads=self.kv_heads,
                                   intermediate_size=c.intermediate_size // self.world,
                                   tie_word_embeddings=False)

    def rows(self, name: str, size: int) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's slice of tensor `name` whose split dimension has
        `size` entries; None: the whole tensor. The LM head's last shard may stop short of a full
        shard: the caller pads it with zero rows."""
        dim = shard_dim(name)
        if dim is None:
            return None
        c, r, w = self.config, self.rank, self.world
        if name == "lm_head.weight":
            n = self.vocab_shard
            return dim, min(r * n, size), min((r + 1) * n, size)
        if ".k_proj" in name or ".v_proj" in name:
            per = size // c.num_kv_heads  # head_dim
            return dim, self.kv_head0 * per, (self.kv_head0 + self.kv_heads) * per
        n = size // w
        return dim, r * n, (r + 1) * n

    def slice(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's part of the whole tensor `name` (the tensor itself when not split)."""
        cut = self.rows(name, t.shape[shard_dim(name) or 0])
        if cut is None:
            return t
        dim, start, stop = cut
        return self.pad_head(name, t.narrow(dim, start, stop - start))

    def pad_head(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """The LM head's shards all have vocab_shard rows (all-gather needs equal sizes)."""
        if name != "lm_head.weight" or t.shape[0] == self.vocab_shard:
            return t
        return torch.cat([t, t.new_zeros(self.vocab_shard - t.shape[0], *t.shape[1:])])
