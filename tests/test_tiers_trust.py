"""Who may put KV into a shared store: payloads carry a MAC under the store secret, so a forged
entry (another secret's, another key's payload, an altered byte) is a counted miss, deleted and
recomputed, with outputs equal to a cold engine's and the dense oracle; engines with different
secrets share nothing; a store without a secret is refused unless insecure use is asked for;
entries expire; Redis logins (password, ACL user) and TLS work, and a wrong login is a clear
start-up error that never shows the password."""
import random

import pytest
import torch

from spanserve import LLM, SamplingParams, Segment
from spanserve.cache.tiers import OffloadConfig
from spanserve.cache.tiers.config import SECRET_ENV
from spanserve.cache.tiers.payload import SEAL_BYTES, BlockKV, BlockShape, PayloadCodec, _HEADER
from spanserve.cache.tiers.redis import RedisTier
from spanserve.engine.layout import resolve
from spanserve.model.loader import load_model
from dense_reference import Dense
from redis_server import RedisServer
from span_helpers import capture_logits
from tiny_models import make_tiny_model

BS = 4
SECRET = "trust-test-secret-0123456789"
OTHER = "another-secret-9876543210"
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
SHAPE = BlockShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
FP = bytes(range(16))
PASSWORD = "p4ss-w0rd-not-shown"


def _block(key: int) -> BlockKV:
    g = torch.Generator().manual_seed(key)
    return BlockKV(key, (1, 2, 3, 4), torch.randn(SHAPE.dims, generator=g).to(SHAPE.dtype))


# ---- the store tier alone --------------------------------------------------------------------
def test_forged_entries_are_counted_deleted_and_rewritable(redis_server):
    redis_server.client().flushdb()
    store = RedisTier(redis_server.url, PayloadCodec(SHAPE, FP, SECRET.encode()), timeout_ms=1000)
    r = redis_server.client()
    store.store_many([_block(1)])
    good = r.get(store._key(1))
    r.set(store._key(2), good)  # the right payload under another key
    r.set(store._key(3), PayloadCodec(SHAPE, FP, OTHER.encode()).encode(_block(3)))  # another secret
    r.set(store._key(4), PayloadCodec(SHAPE, FP).encode(_block(4)))  # a checksum anyone can compute
    assert store.load_many([1, 2, 3, 4])[1:] == [None, None, None]
    assert store.stats.auth_failures == 3 and store.stats.bad_payloads == 0 and store.stats.misses == 3
    assert [r.exists(store._key(k)) for k in (1, 2, 3, 4)] == [1, 0, 0, 0]
    store.store_many([_block(k) for k in (2, 3, 4)])  # gone, so the real blocks are written again
    assert all(torch.equal(b.kv, _block(k).kv) for k, b in zip((2, 3, 4), store.load_many([2, 3, 4])))


def test_entries_expire(redis_server):
    r = redis_server.client()
    codec = PayloadCodec(SHAPE, FP, SECRET.encode())
    RedisTier(redis_server.url, codec, timeout_ms=1000, ttl_s=3600).store_many([_block(10)])
    RedisTier(redis_server.url, codec, timeout_ms=1000, ttl_s=0).store_many([_block(11)])
    store = RedisTier(redis_server.url, codec)
    assert 3590 <= r.ttl(store._key(10)) <= 3600
    assert r.ttl(store._key(11)) == -1  # 0: no expiry
    assert OffloadConfig().store_ttl_s == 7 * 24 * 3600


@pytest.mark.parametrize("user,tls", [(None, False), ("kvuser", False), ("kvuser", True)],
                         ids=["requirepass", "acl-user", "acl-user-tls"])
def test_store_logins(tmp_path, user, tls):
    server = RedisServer(tmp_path, password=PASSWORD, user=user, tls=tls).start()
    try:
        codec = PayloadCodec(SHAPE, FP, SECRET.encode())
        store = RedisTier(server.url, codec, timeout_ms=2000)
        assert store.url.startswith("rediss://" if tls else "redis://") and PASSWORD not in store.url
        store.store_many([_block(5)])
        assert torch.equal(store.load_many([5])[0].kv, _block(5).kv) and store.stats.errors == 0
        for url in (server.url_with(user, "wrong-password"), server.url_with(None, None)):
            with pytest.raises(ValueError, match="refused the login|unreachable") as err:
                RedisTier(url, codec, timeout_ms=2000)
            assert "wrong-password" not in str(err.value) and PASSWORD not in str(err.value)
        with pytest.raises(ValueError, match="refused the login.*check the user and password") as err:
            RedisTier(server.url_with(user, "wrong-password"), codec, timeout_ms=2000)
        assert "redis" in str(err.value) and ":***@" in str(err.value)
    finally:
        server.stop()


def test_cli_reports_a_wrong_password_without_showing_it(tmp_path, capsys, monkeypatch):
    from spanserve.cli import main

    server = RedisServer(tmp_path, password=PASSWORD).start()
    try:
        path, _ = make_tiny_model("llama", tmp_path / "m")
        monkeypatch.setenv(SECRET_ENV, SECRET)
        base = ["generate", "hello", "--model", str(path), "--max-tokens", "2", "--kv-store"]
        assert main(base + [server.url_with(None, "wrong-" + PASSWORD)]) == 2
        err = capsys.readouterr().err
        assert "refused the login" in err and PASSWORD not in err
        assert main(base + [server.url]) == 0
    finally:
        server.stop()


# ---- engines -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("tiers-trust"))
    return load_model(str(path))


@pytest.fixture(scope="module")
def layout():
    rng = random.Random(5)
    t = lambda n: [rng.randrange(3, 384) for _ in range(n)]  # noqa: E731
    return [Segment(token_ids=t(6)), Segment(token_ids=t(13), kind="plus"), Segment(token_ids=t(9), kind="plus"),
            Segment(token_ids=t(5))]


@pytest.fixture(scope="module")
def expected(loaded, layout):
    """Tokens without tiers, and the dense oracle's logits."""
    plain = LLM(loaded, block_size=BS, num_blocks=128).generate(layout, GREEDY)[0]
    return plain.token_ids, Dense(loaded.config, loaded.weights).span_logits(resolve(layout, None, "none"))


def _llm(loaded, url: str, **store) -> LLM:
    return LLM(loaded, block_size=BS, num_blocks=128, kv_offload={"store_url": url, "store_timeout_ms": 2000, **store})


def _check(llm: LLM, layout, expected) -> dict[str, int]:
    """Generate with an empty pool (every block from the store or computed); the output must be
    the cold engine's and the oracle's. Returns the reuse counts."""
    e = llm.engine
    for b in list(e.pool.blocks):
        if b.key is not None and b.ref_cnt == 0:
            e.pool.evict(b)
    seen = capture_logits(e)
    out = llm.generate(layout, GREEDY)[0]
    assert out.token_ids == expected[0]
    torch.testing.assert_close(seen[out.request_id].double(), expected[1], rtol=0, atol=1e-4)
    assert e.tiers.flush()
    return out.metrics["reuse"]


def _tamper(kind: str, values: dict[bytes, bytes], codec: PayloadCodec) -> dict[bytes, bytes]:
    keys = sorted(values)
    if kind == "other-secret":  # the real block, sealed by someone with another secret
        forger = PayloadCodec(codec.shape, codec.fingerprint, OTHER.encode())
        return {k: bytes(forger.encode(codec.decode(values[k], int(k[-32:], 16)))) for k in keys}
    if kind == "other-key":  # every key holds another real entry of the store
        return {k: values[keys[(i + 1) % len(keys)]] for i, k in enumerate(keys)}
    at = _HEADER.size + 4 * codec.shape.block_size + 7  # a byte of K
    assert at < len(values[keys[0]]) - SEAL_BYTES
    return {k: v[:at] + bytes([v[at] ^ 0x10]) + v[at + 1:] for k, v in values.items()}


@pytest.mark.parametrize("kind", ["other-secret", "other-key", "flipped-kv-byte"])
def test_forged_store_entries_are_recomputed(loaded, layout, expected, redis_server, kind):
    r = redis_server.client()
    r.flushdb()
    llm = _llm(loaded, redis_server.url, store_secret=SECRET)
    store = llm.engine.tiers.store
    assert _check(llm, layout, expected)["store"] == 0  # cold: the documents are written through
    keys = sorted(r.keys(b"spanserve:kv:*"))
    assert len(keys) == 7  # documents of 13 and 9 tokens: 3 + 2 full blocks and 2 partial tails
    values = {k: r.get(k) for k in keys}
    assert _check(llm, layout, expected)["store"] == 22  # untouched, every document token comes back
    forged = _tamper(kind, values, store.codec)
    r.mset(forged)
    before = store.stats.snapshot()
    assert _check(llm, layout, expected)["store"] == 0
    after = store.stats.snapshot()
    assert after["auth_failures"] - before["auth_failures"] == len(keys)
    assert after["hits"] == before["hits"] and after["bad_payloads"] == before["bad_payloads"]
    # none of the forgeries survived: each key holds the recomputed block again, under the secret
    assert sorted(r.keys(b"spanserve:kv:*")) == keys
    for k in keys:
        key = int(k[-32:], 16)
        now, was = store.codec.decode(r.get(k), key), store.codec.decode(values[k], key)
        n = len(now.tokens)  # slots past a partial block's tokens hold whatever was there
        assert now.tokens == was.tokens and r.get(k) != forged[k]
        torch.testing.assert_close(now.kv[:, :, :n], was.kv[:, :, :n], rtol=0, atol=1e-5)
    assert _check(llm, layout, expected)["store"] == 22
    llm.close()


def test_engines_with_different_secrets_share_nothing(loaded, layout, expected, redis_server):
    redis_server.client().flushdb()
    first = _llm(loaded, redis_server.url, store_secret=SECRET)
    assert _check(first, layout, expected)["store"] == 0
    first.close()
    same = _llm(loaded, redis_server.url, store_secret=SECRET)
    assert _check(same, layout, expected)["store"] == 22  # the same secret reuses the entries
    same.close()
    other = _llm(loaded, redis_server.url, store_secret=OTHER)
    assert _check(other, layout, expected)["store"] == 0
    s = other.engine.tiers.store.stats
    assert s.hits == 0 and s.auth_failures == 7
    other.close()


def test_a_store_without_a_secret(loaded, layout, expected, redis_server, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    redis_server.client().flushdb()
    with pytest.raises(ValueError, match=f"needs a secret.*{SECRET_ENV}.*--kv-store-secret.*--kv-store-insecure"):
        _llm(loaded, redis_server.url)
    insecure = _llm(loaded, redis_server.url, store_insecure=True)
    assert not insecure.engine.tiers.store.codec.authenticated
    assert _check(insecure, layout, expected)["store"] == 0
    assert _check(insecure, layout, expected)["store"] == 22  # works, with checksums
    insecure.close()
    monkeypatch.setenv(SECRET_ENV, SECRET)  # the secret from the environment: checksummed entries refused
    config = OffloadConfig(store_url=redis_server.url)
    assert config.store_secret == SECRET and SECRET not in repr(config)
    keyed = _llm(loaded, redis_server.url)
    assert _check(keyed, layout, expected)["store"] == 0 and keyed.engine.tiers.store.stats.auth_failures == 7
    keyed.close()
    with pytest.raises(ValueError, match="at least 16"):
        OffloadConfig(store_url=redis_server.url, store_secret="short")
    assert PASSWORD not in repr(OffloadConfig(store_url=f"redis://u:{PASSWORD}@h:1/0", store_secret=SECRET))
