"""Tensor-parallel parts that need no second process: shard slices, the step message's run-length
coding, the storage log, random shards, and the errors for shapes and devices that cannot split."""
import dataclasses

import numpy as np
import pytest
import torch

from spanserve.distributed.driver import check_devices
from spanserve.distributed.step import Runs
from spanserve.distributed.storage_log import RecordingStorage, replay
from spanserve.model.config import ModelConfig
from spanserve.model.loader import LoadedModel
from spanserve.model.shard import ShardPlan, check_divisible
from spanserve.model.weights import MemoryWeights, RandomWeights
from spanserve.rope import Rotary
from spanserve.worker.storage import KVStorage

CFG = ModelConfig(arch="llama", vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=8, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("world,kvh", [(2, 2), (4, 2), (8, 2), (2, 1), (4, 4)])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(world, kvh):
    c = dataclasses.replace(CFG, num_kv_heads=kvh)
    whole = RandomWeights(c, seed=3).whole(torch.float32, "cpu")
    q_name, k_name = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    D, H = c.head_dim, c.num_heads
    for r in range(world):
        plan = ShardPlan(c, r, world)
        local = plan.local_config()
        shard = RandomWeights(c, seed=3).shard(plan, torch.float32, torch.device("cpu"))
        q, k = shard[q_name].view(-1, D, c.hidden_size), shard[k_name].view(-1, D, c.hidden_size)
        assert q.shape[0] == local.num_heads == H // world and k.shape[0] == local.num_kv_heads
        for j in range(local.num_heads):
            g = r * local.num_heads + j  # the whole model's head
            kv_global = g // (H // kvh)
            kv_local = j // (local.num_heads // local.num_kv_heads)
            torch.testing.assert_close(q[j], whole.weights[q_name].view(H, D, -1)[g], rtol=0, atol=0)
            torch.testing.assert_close(k[kv_local], whole.weights[k_name].view(kvh, D, -1)[kv_global], rtol=0, atol=0)


def test_shards_put_together_are_the_whole_model():
    """Column shards stack along outputs, row shards along inputs; the padded LM head (101 rows
    over 2 ranks) loses its padding; norms and the embedding are whole everywhere."""
    whole = RandomWeights(CFG, seed=1).whole(torch.float32, "cpu")
    mem = MemoryWeights(whole)
    shards = [mem.shard(ShardPlan(CFG, r, 2), torch.float32, torch.device("cpu")) for r in range(2)]
    rand = [RandomWeights(CFG, seed=1).shard(ShardPlan(CFG, r, 2), torch.float32, torch.device("cpu"))
            for r in range(2)]
    for name, t in whole.weights.items():
        for parts in (shards, rand):
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                got = torch.cat([p[name] for p in parts], dim=1)
            elif name.endswith("norm.weight") or name == "model.embed_tokens.weight":
                got = parts[1][name]
            else:
                got = torch.cat([p[name] for p in parts])[:t.shape[0]]
            torch.testing.assert_close(got, t, rtol=0, atol=0, msg=name)
    head = shards[1]["lm_head.weight"]
    assert head.shape[0] == 51 and not head[-1].any()  # the pad row of the last shard


def test_tied_head_is_a_slice_of_the_embedding():
    c = dataclasses.replace(CFG, tie_word_embeddings=True)
    w = RandomWeights(CFG, seed=2).whole(torch.float32, "cpu").weights
    w = {k: v for k, v in w.items() if k != "lm_head.weight"}
    s = MemoryWeights(LoadedModel(c, w, None, "t")).shard(ShardPlan(c, 1, 2), torch.float32, torch.device("cpu"))
    torch.testing.assert_close(s["lm_head.weight"][:50], w["model.embed_tokens.weight"][51:], rtol=0, atol=0)
    assert ShardPlan(c, 1, 2).local_config().tie_word_embeddings is False


@pytest.mark.parametrize("seed", range(5))
def test_runs_round_trip(seed):
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, 10_000, 30) * 16
    lengths = rng.integers(1, 17, 30)
    slots = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    deltas = np.repeat(rng.integers(-500, 500, 30), lengths)
    for a, step in ((slots, 1), (deltas, 0), (slots[:1], 1), (slots[:0], 1)):
        r = Runs.of(a, step)
        np.testing.assert_array_equal(r.array(), a)
    assert Runs.of(np.arange(4096), 1).starts.size == 1  # one block run: one entry


def test_storage_log_replays_on_another_rank():
    c = CFG
    rot = Rotary(c.head_dim, c.rope_theta, None, torch.device("cpu"))
    a = RecordingStorage(c, 12, 4, torch.float32, torch.device("cpu"))
    b = KVStorage(c, 12, 4, torch.float32, torch.device("cpu"))
    for s in (a, b):  # the same content on both ranks before the operations
        g = torch.Generator().manual_seed(0)
        s.k.copy_(torch.randn(s.k.shape, generator=g))
        s.v.copy_(torch.randn(s.v.shape, generator=g))
    a.copy(1, 2, 3)
    a.copy_many([(3, 4, 4), (4, 5, 2)])  # 4 is read before it is written
    a.copy_many([(6, 7, 1)])
    a.copy_rotated([8, 9], [10, 11], 37, rot)
    replay(b, a.drain(), rot)
    torch.testing.assert_close(b.k, a.k, rtol=0, atol=0)
    torch.testing.assert_close(b.v, a.v, rtol=0, atol=0)
    assert a.drain() == []


def test_shapes_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="does not divide the model's 8 attention heads"):
        check_divisible(CFG, 3)
    with pytest.raises(ValueError, match="KV heads"):
        check_divisible(dataclasses.replace(CFG, num_heads=12, num_kv_heads=3), 4)
    with pytest.raises(ValueError, match="MLP width"):
        check_divisible(dataclasses.replace(CFG, intermediate_size=50), 4)


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 GPUs but 1 are visible"):
        check_devices(2, torch.device("cuda"))
    with pytest.raises(ValueError, match="GPUs 0..N-1"):
        check_devices(1, torch.device("cuda", 1))


def test_row_parallel_sums_in_either_precision():
    """One rank of a gloo group: the float32 path returns the model dtype and the row shape of x
    (leading dims kept), within bf16 rounding of the float32 product; the plain path is F.linear."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from spanserve.distributed.group import TPGroup, free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, 5, 64, generator=g).to(torch.bfloat16)
        w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
        ref = x.float() @ w.float().t()
        f32 = TPGroup(0, 1, torch.device("cpu"), dist.group.WORLD, float32_reduce=True).row_linear(x, w)
        assert f32.dtype == torch.bfloat16 and f32.shape == (3, 5, 32)
        torch.testing.assert_close(f32.float(), ref, rtol=2 ** -7, atol=1e-2)
        plain = TPGroup(0, 1, torch.device("cpu"), dist.group.WORLD).row_linear(x, w)
        torch.testing.assert_close(plain, F.linear(x, w), rtol=0, atol=0)
    finally:
        dist.destroy_process_group()
