"""Tiers one at a time: the payload's checks, host and disk LRU, a disk tier found again after a
restart, the Redis tier's faults, configuration errors, and write-back through a small pool."""
import os
import random

import pytest
import torch

from spanserve import LLM, SamplingParams
from spanserve.cache.tiers import BlockKV, BlockShape, OffloadConfig
from spanserve.cache.tiers import payload
from spanserve.cache.tiers.payload import PayloadCodec
from spanserve.cache.tiers.disk import DiskTier
from spanserve.cache.tiers.host import HostTier
from spanserve.cache.tiers.redis import RedisTier
from spanserve.model.loader import load_model
from redis_server import free_port
from tiny_models import make_tiny_model

SHAPE = BlockShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
FP = bytes(range(16))
SECRET = b"unit-test-secret-0123456789"
CODEC = PayloadCodec(SHAPE, FP)  # checksum
KEYED = PayloadCodec(SHAPE, FP, SECRET)  # MAC
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _block(key: int, seed: int = 0) -> BlockKV:
    g = torch.Generator().manual_seed(seed)
    return BlockKV(key, tuple(range(key % 7, key % 7 + 4)), torch.randn(SHAPE.dims, generator=g).to(SHAPE.dtype))


def _same(a: BlockKV, b: BlockKV) -> bool:
    return a.key == b.key and a.tokens == b.tokens and torch.equal(a.kv, b.kv)


@pytest.mark.parametrize("codec", [CODEC, KEYED], ids=["checksum", "mac"])
def test_payload_round_trip_and_every_defect_is_refused(codec):
    b = _block(12345)
    data = codec.encode(b)
    assert len(data) == SHAPE.payload_bytes
    assert _same(codec.decode(bytes(data), 12345), b) and _same(codec.decode(bytearray(data), 12345), b)
    refusal = payload.AuthFailure if codec.authenticated else payload.BadPayload
    rng = random.Random(0)
    for at in [0, 5, 6, 40, 80, len(data) // 2, len(data) - 1] + [rng.randrange(len(data)) for _ in range(20)]:
        bad = bytearray(data)
        bad[at] ^= 1 << rng.randrange(8)
        with pytest.raises(refusal):
            codec.decode(bytes(bad), 12345)
    for cut in (0, 10, len(data) - 1):
        with pytest.raises(payload.BadPayload, match="bytes"):
            codec.decode(data[:cut], 12345)
    with pytest.raises(refusal, match="another key"):  # the seal covers the key it is stored under
        codec.decode(data, 999)
    with pytest.raises(payload.BadPayload, match="another model"):
        PayloadCodec(SHAPE, bytes(16), codec._mac and SECRET).decode(data, 12345)
    tail = BlockKV(77, (5, 6), b.kv, parent=12345)  # a partial block keeps its parent
    assert _same(codec.decode(codec.encode(tail), 77), tail)
    assert codec.decode(codec.encode(tail), 77).parent == 12345
    other = PayloadCodec(BlockShape(2, 4, 2, 8, torch.float16), FP, codec._mac and SECRET)
    with pytest.raises(payload.BadPayload, match="shape"):
        codec.decode(other.encode(BlockKV(1, b.tokens, b.kv.to(torch.float16))), 1)


def test_a_mac_accepts_its_secret_alone():
    """What a writer without the secret can produce, a keyed reader refuses: a MAC under another
    secret, or a checksum (which anyone can compute); a checksum reader refuses MACs it cannot check."""
    b = _block(5, 1)
    assert _same(KEYED.decode(PayloadCodec(SHAPE, FP, SECRET).encode(b), 5), b)
    for forger in (PayloadCodec(SHAPE, FP, b"another-secret-0123456789"), CODEC):
        with pytest.raises(payload.AuthFailure, match="MAC mismatch"):
            KEYED.decode(forger.encode(b), 5)
    with pytest.raises(payload.BadPayload, match="no secret"):
        CODEC.decode(KEYED.encode(b), 5)
    with pytest.raises(ValueError, match="empty"):
        PayloadCodec(SHAPE, FP, b"")


def test_host_tier_is_lru_within_its_bytes():
    host = HostTier(3 * SHAPE.kv_bytes, SHAPE)
    assert host.store_many([_block(k) for k in (1, 2, 3)]) == []
    host.load_many([1])  # 1 is now the most recent
    spilled = host.store_many([_block(4)])
    assert [b.key for b in spilled] == [2]
    assert host.contains_many([1, 2, 3, 4]).tolist() == [True, False, True, True]
    got = host.load_many([4, 2])
    assert _same(got[0], _block(4)) and got[1] is None
    assert host.stats.hits == 2 and host.stats.misses == 1


def test_disk_tier_survives_restart_and_drops_bad_files(tmp_path):
    disk = DiskTier(tmp_path, 3 * SHAPE.payload_bytes, CODEC)
    disk.store_many([_block(k, k) for k in (1, 2, 3, 4)])  # over budget: 1 goes
    assert disk.contains_many([1, 2, 3, 4]).tolist() == [False, True, True, True]
    again = DiskTier(tmp_path, 3 * SHAPE.payload_bytes, CODEC)  # a restart
    assert _same(again.load_many([3])[0], _block(3, 3))
    path = again._path(2)
    path.write_bytes(path.read_bytes()[:-10])  # truncated
    assert again.load_many([2]) == [None]
    assert again.stats.bad_payloads == 1 and not path.exists()
    other = DiskTier(tmp_path, 3 * SHAPE.payload_bytes, PayloadCodec(SHAPE, bytes(16)))  # another model: nothing
    assert other.contains_many([3, 4]).tolist() == [False, False]


def test_disk_tier_refuses_an_unwritable_directory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="not writable"):
        DiskTier(blocker / "kv", 1 << 20, CODEC)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            DiskTier(ro, 1 << 20, CODEC)


def test_redis_tier_faults_are_misses(redis_server):
    store = RedisTier(redis_server.url, KEYED, timeout_ms=200, retry_s=0.2)
    store.store_many([_block(k, k) for k in (10, 11)])
    assert store.contains_many([10, 11, 12]).tolist() == [True, True, False]
    got = store.load_many([11, 12, 10])
    assert _same(got[0], _block(11, 11)) and got[1] is None and _same(got[2], _block(10, 10))
    r = redis_server.client()
    key = store._key(10)
    r.set(key, r.get(key)[:-3])  # truncated
    r.set(store._key(11), b"x" * SHAPE.payload_bytes)  # garbage of the right size
    assert store.load_many([10, 11]) == [None, None]
    assert store.stats.bad_payloads == 1 and store.stats.auth_failures == 1  # the garbage fails the MAC
    assert r.exists(key) == 0 and r.exists(store._key(11)) == 0  # removed, so a rewrite replaces them
    with pytest.raises(ValueError, match="unreachable"):
        RedisTier(f"redis://127.0.0.1:{free_port()}/0", KEYED, timeout_ms=50)
    with pytest.raises(ValueError, match="URL"):
        RedisTier("http://nowhere", KEYED)


def test_offload_config_errors():
    assert OffloadConfig.of(None) is None
    cfg = OffloadConfig.of({"cpu_bytes": "2MiB", "disk_path": "/x", "disk_bytes": "1GB"})
    assert cfg.cpu_bytes == 2 * 2**20 and cfg.disk_bytes == 10**9 and cfg.enabled
    with pytest.raises(ValueError, match="not a size"):
        OffloadConfig.of({"cpu_bytes": "lots"})
    with pytest.raises(ValueError, match="unknown kv_offload"):
        OffloadConfig.of({"cpu": "1GiB"})
    with pytest.raises(ValueError, match=">= 0"):
        OffloadConfig(cpu_bytes=-1)
    with pytest.raises(ValueError, match="timeout"):
        OffloadConfig(store_timeout_ms=0)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("tiers-units"))
    return load_model(str(path))


def test_evicted_blocks_are_written_back_and_spill_to_disk(loaded, tmp_path):
    """A pool too small for the prompts: evicted blocks go to a host tier too small as well,
    which spills to disk; the first prompt comes back from both, exactly."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 384) for _ in range(40)] for _ in range(4)]
    plain = LLM(loaded, block_size=4, num_blocks=64).generate(prompts[0], GREEDY)[0]
    per_block = 2 * 2 * 4 * loaded.config.num_kv_heads * loaded.config.head_dim * 4
    offload = {"cpu_bytes": 12 * per_block, "disk_path": str(tmp_path / "kv"), "disk_bytes": "4MiB"}
    with LLM(loaded, block_size=4, num_blocks=24, kv_offload=offload) as llm:
        for p in prompts:
            llm.generate(p, GREEDY)
        assert llm.engine.tiers.flush()
        assert len(llm.engine.tiers.disk) > 0 and len(llm.engine.tiers.host) == 12
        again = llm.generate(prompts[0], GREEDY)[0]
        assert again.token_ids == plain.token_ids
        r = again.metrics["reuse"]
        assert r["disk"] > 0 and r["prefix"] == 39 and r["computed"] == 1  # every block came back
        assert llm.engine.tiers.dropped == 0


def test_cli_refuses_bad_tier_settings(tmp_path, capsys, monkeypatch):
    path, _ = make_tiny_model("llama", tmp_path / "m")
    from spanserve.cli import main

    base = ["generate", "hello", "--model", str(path), "--max-tokens", "2"]
    with pytest.raises(SystemExit):  # argparse's own usage error
        main(base + ["--kv-offload-cpu", "lots"])
    assert "not a size" in capsys.readouterr().err
    monkeypatch.delenv("SPANSERVE_KV_SECRET", raising=False)
    nowhere = ["--kv-store", f"redis://127.0.0.1:{free_port()}/0"]
    assert main(base + nowhere) == 2  # a store without a secret
    err = capsys.readouterr().err
    assert all(w in err for w in ("needs a secret", "SPANSERVE_KV_SECRET", "--kv-store-secret", "--kv-store-insecure"))
    assert main(base + nowhere + ["--kv-store-secret", "short"]) == 2
    assert "at least 16" in capsys.readouterr().err
    for extra in (["--kv-store-insecure"], ["--kv-store-secret", "s" * 16], ["--kv-store-ttl", "60"]):
        if extra[0] == "--kv-store-ttl":  # the secret from the environment
            monkeypatch.setenv("SPANSERVE_KV_SECRET", "e" * 16)
        assert main(base + nowhere + extra) == 2  # past the secret check, to the connection
        assert "unreachable" in capsys.readouterr().err
    assert main(base + nowhere + ["--kv-store-ttl", "-1"]) == 2
    assert "store_ttl_s" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(base + ["--kv-offload-disk", str(blocker / "kv")]) == 2
    assert "not writable" in capsys.readouterr().err
    assert main(base + ["--kv-offload-cpu", "1MiB", "--kv-offload-disk", str(tmp_path / "kv")]) == 0
