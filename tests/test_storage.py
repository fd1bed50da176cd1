"""KVStorage's batched block copy against one copy at a time from a snapshot."""
from __future__ import annotations

import random

import pytest
import torch

from spanserve.model.config import ModelConfig
from spanserve.worker import kv_upload
from spanserve.worker.storage import KVStorage


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


# the upload path differs on CUDA (side stream, pinned sources): compared there too where one exists
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _storage(dtype: torch.dtype, seed: int, device: str = "cpu") -> KVStorage:
    cfg = ModelConfig(arch="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=2,
                      num_kv_heads=2, head_dim=4)
    st = KVStorage(cfg, num_blocks=24, block_size=4, dtype=dtype, device=torch.device(device))
    g = torch.Generator().manual_seed(seed)
    st.k.copy_(torch.randn(st.k.shape, generator=g))
    st.v.copy_(torch.randn(st.v.shape, generator=g))
    return st


def _sources(rng: random.Random, n: int, dims: tuple[int, ...], dtype: torch.dtype, pin: bool = False
             ) -> list[torch.Tensor]:
    """n block KVs the ways tiers hand them over: consecutive views of one captured batch (in
    order, so they merge into runs, and out of order), separate tensors, non-contiguous views,
    and another dtype than the pool's; `pin`: the batch in pinned memory, the rest pageable."""
    batch = torch.randn((n, *dims)).to(dtype)
    batch = batch.pin_memory() if pin else batch
    out = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.5:
            out.append(batch[i])
        elif kind < 0.7:
            out.append(batch[rng.randrange(n)])
        elif kind < 0.85:
            out.append(torch.randn((dims[1], dims[0], *dims[2:])).to(dtype).transpose(0, 1))
        else:
            out.append(torch.randn(dims, dtype=torch.float32))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_batched_block_upload_equals_plain_per_block_copies(device: str, dtype: torch.dtype, seed: int,
                                                            chunk: int) -> None:
    rng = random.Random(seed)
    st = _storage(dtype, seed, device)
    dims = (2, *st.k[:, 0].shape)
    n = rng.randint(1, 30)
    ids = [rng.randrange(st.num_blocks) for _ in range(n)]  # unsorted, repeated ids: the last write wins
    kvs = _sources(rng, n, dims, dtype, pin=device == "cuda")
    want_k, want_v = st.k.clone(), st.v.clone()
    for b, kv in zip(ids, kvs):  # the reference: one block at a time, in order
        want_k[:, b] = kv[0].to(device)
        want_v[:, b] = kv[1].to(device)
    up = kv_upload.plan(ids, kvs)
    assert sorted(up.slots.tolist()) == sorted(set(ids))  # unique: a CUDA scatter of repeats is unordered
    stream = torch.cuda.Stream() if device == "cuda" else None
    kv_upload.upload(st.k, st.v, up, chunk, stream)
    assert torch.equal(st.k, want_k) and torch.equal(st.v, want_v)


def test_write_blocks_merges_consecutive_views_and_matches_copies() -> None:
    st = _storage(torch.bfloat16, 7)
    dims = (2, *st.k[:, 0].shape)
    batch = torch.randn((12, *dims)).to(torch.bfloat16)
    ids = [5, 3, 20, 1, 0, 9, 8, 7, 2, 4, 11, 23]
    kvs = [batch[i] for i in range(12)]
    up = kv_upload.plan(ids, kvs)
    assert len(up.runs) == 1 and up.runs[0].data_ptr() == batch.data_ptr() and torch.equal(up.runs[0], batch)
    assert len(kv_upload.plan(ids, kvs[:6] + kvs[7:] + kvs[6:7]).runs) == 3  # a gap breaks the run
    want_k, want_v = st.k.clone(), st.v.clone()
    want_k[:, ids] = batch[:, 0].transpose(0, 1)
    want_v[:, ids] = batch[:, 1].transpose(0, 1)
    st.write_blocks(ids, kvs)
    assert torch.equal(st.k, want_k) and torch.equal(st.v, want_v)
    st.write_blocks([], [])  # nothing to do
    assert torch.equal(st.k, want_k)
    with pytest.raises(ValueError, match="block ids"):
        st.write_blocks([1, 2], kvs[:1])
