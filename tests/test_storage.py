"""KVStorage's batched block copy against one copy at a time from a snapshot."""
from __future__ import annotations

import random

import pytest
import torch

from spanserve.cache.storage import KVStorage
from spanserve.model.config import ModelConfig


@pytest.mark.parametrize("seed", range(4))
def test_copy_many_equals_copies_from_a_snapshot(seed: int) -> None:
    rng = random.Random(seed)
    cfg = ModelConfig(arch="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=2,
                      num_kv_heads=2, head_dim=4)
    st = KVStorage(cfg, num_blocks=20, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    st.k.normal_(generator=torch.Generator().manual_seed(seed))
    st.v.normal_(generator=torch.Generator().manual_seed(seed + 100))
    blocks = list(range(20))
    rng.shuffle(blocks)
    # distinct destinations; a destination may also be another job's source (read before written)
    dsts = blocks[:6]
    jobs = [(rng.choice(blocks), d, rng.randint(1, 4)) for d in dsts]
    jobs[0], jobs[1] = (dsts[1], dsts[0], 4), (dsts[0], dsts[1], 3)  # a swap: sequential copies would differ
    want_k, want_v = st.k.clone(), st.v.clone()
    for s, d, n in jobs:
        want_k[:, d, :n] = st.k[:, s, :n]
        want_v[:, d, :n] = st.v[:, s, :n]
    st.copy_many(jobs)
    assert torch.equal(st.k, want_k) and torch.equal(st.v, want_v)
