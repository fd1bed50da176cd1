"""KV tiers end to end on `spanserve serve` subprocesses (tiny model): a restart finds its disk
tier, two servers share one Redis (a third with another secret uses none of it), and Redis dying
under streaming clients costs nothing but recomputation. The servers take the store secret from
SPANSERVE_KV_SECRET, so the store's and the disk's payloads carry a MAC."""
from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from redis_server import RedisServer
from test_server_harness import build_tiny_model, run_server

MODEL = "tiny"
BS = 8
SECRET = "server-test-secret-0123456789"


@pytest.fixture(autouse=True)
def _store_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPANSERVE_KV_SECRET", SECRET)  # the servers started here inherit it


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiers-model") / MODEL)


def _args(*extra: str) -> tuple[str, ...]:
    return ("--block-size", str(BS), "--served-model-name", MODEL, *extra)


def _docs(seed: int, n: int, blocks: int = 3) -> list[list[int]]:
    """Documents of a few blocks each, most ending inside a block (partial tails are kept too)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 390) for _ in range(blocks * BS + i % 5)] for i in range(n)]


def _layout(docs: list[list[int]], question: list[int], max_tokens: int = 6) -> dict[str, Any]:
    segs = [{"token_ids": [11, 12, 13]}] + [{"token_ids": d, "kind": "plus"} for d in docs]
    return {"model": MODEL, "segments": segs + [{"token_ids": question}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _reuse(body: dict[str, Any]) -> dict[str, int]:
    return body["usage"]["prompt_tokens_details"]["reuse"]


def _tokens(body: dict[str, Any]) -> str:
    return body["choices"][0]["text"]


def _sample(url: str, name: str, labels: str = "") -> float:
    want = f"{name}{{{labels}}} " if labels else f"{name} "
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    raise KeyError(want)


def _drained(url: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _sample(url, "spanserve_kv_writebacks_queued") > 0:
        assert time.monotonic() < deadline, "write-back queue did not drain"
        time.sleep(0.05)


def test_restarted_server_finds_its_disk_tier(model: Path, tmp_path: Path) -> None:
    disk = ("--kv-offload-disk", str(tmp_path / "kv"), "--kv-offload-disk-size", "64MiB")
    prompt = " ".join(["The capital of France is Paris."] * 10) + " And Italy?"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    with run_server(str(model), tmp_path, *_args(*disk)) as srv:
        before = _complete(srv.url, body)
        assert before["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert any((tmp_path / "kv").rglob("*.kv"))  # the stopped server left its blocks there
    with run_server(str(model), tmp_path, *_args(*disk)) as srv:
        after = _complete(srv.url, body)
        details = after["usage"]["prompt_tokens_details"]
        assert details["cached_tokens"] >= after["usage"]["prompt_tokens"] // 2
        assert details["reuse"]["disk"] == details["cached_tokens"]  # every hit came from the disk
        assert _tokens(after) == _tokens(before)
        assert _sample(srv.url, "spanserve_kv_tier_hits_total", 'tier="disk"') > 0


def test_two_servers_share_segments_through_redis(model: Path, tmp_path: Path) -> None:
    redis = RedisServer(tmp_path).start()
    try:
        store = ("--kv-store", redis.url)
        docs = _docs(1, 4)
        question = [20, 21, 22, 23, 24]
        shuffled = [docs[i] for i in (2, 0, 3, 1)]
        with run_server(str(model), tmp_path, *_args(*store)) as a, run_server(str(model), tmp_path, *_args(*store)) as b:
            first = _complete(a.url, _layout(docs, question))
            assert _reuse(first)["segment"] == 0
            _drained(a.url)
            second = _complete(b.url, _layout(shuffled, question))
            r = _reuse(second)
            n_doc = sum(map(len, docs))
            assert r["segment"] == n_doc and r["store"] == n_doc  # every document, from the store
            assert _tokens(second) == _tokens(_complete(a.url, _layout(shuffled, question)))
            again = _complete(b.url, _layout(docs, question))
            assert _tokens(again) == _tokens(first)
            n_blocks = sum(-(-len(d) // BS) for d in docs)
            assert _sample(b.url, "spanserve_kv_tier_hits_total", 'tier="store"') == n_blocks
            assert _sample(b.url, "spanserve_kv_tier_auth_failures_total", 'tier="store"') == 0
        # another secret: none of the entries is used, each one is counted, the answer is the same
        other = ("--kv-store-secret", "another-secret-0123456789")
        with run_server(str(model), tmp_path, *_args(*store, *other)) as c:
            third = _complete(c.url, _layout(shuffled, question))
            assert _reuse(third)["store"] == 0 and _tokens(third) == _tokens(second)
            assert _sample(c.url, "spanserve_kv_tier_hits_total", 'tier="store"') == 0
            assert _sample(c.url, "spanserve_kv_tier_auth_failures_total", 'tier="store"') == n_blocks
    finally:
        redis.stop()


def _stream(url: str, body: dict[str, Any], out: dict[int, Any], i: int) -> None:
    try:
        text, finish = "", None
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            if r.status_code != 200:
                out[i] = f"HTTP {r.status_code}: {r.read()!r}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out[i] = f"stream error {chunk['error']}"
                    return
                text += chunk["choices"][0]["text"]
                finish = chunk["choices"][0].get("finish_reason") or finish
        out[i] = (text, finish)
    except Exception as e:  # any client-visible failure is what the test counts
        out[i] = f"{type(e).__name__}: {e}"


def test_redis_killed_under_streaming_clients(model: Path, tmp_path: Path) -> None:
    docs = _docs(2, 8)
    rng = random.Random(3)
    bodies = [_layout(rng.sample(docs, 3), [30 + i, 31, 32], max_tokens=12) for i in range(16)]
    with run_server(str(model), tmp_path, *_args()) as plain:  # the outputs without a store
        want = [_tokens(_complete(plain.url, b)) for b in bodies]
    redis = RedisServer(tmp_path).start()
    try:
        extra = ("--kv-store", redis.url, "--kv-store-timeout-ms", "50", "--kv-cache-memory", "256KiB")
        with run_server(str(model), tmp_path, *_args(*extra)) as srv:
            got: dict[int, Any] = {}
            threads = [threading.Thread(target=_stream, args=(srv.url, b, got, i)) for i, b in enumerate(bodies)]
            for t in threads[:8]:
                t.start()
            time.sleep(0.3)
            redis.kill()  # mid-run: half the clients streaming, half about to start
            for t in threads[8:]:
                t.start()
            for t in threads:
                t.join(120)
            assert [got.get(i) for i in range(16)] == [(w, "length") for w in want]
            assert _sample(srv.url, "spanserve_kv_tier_errors_total", 'tier="store"') > 0
            redis.start()  # same port, empty: the server reconnects by itself
            time.sleep(1.2)  # past the tier's quiet period after a failure
            fresh = _docs(4, 2)
            _complete(srv.url, _layout(fresh, [40, 41]))
            _drained(srv.url)
            for i in range(6):  # push the fresh documents out of the small pool
                _complete(srv.url, _layout(_docs(50 + i, 3), [42, 43]))
            hits = _sample(srv.url, "spanserve_kv_tier_hits_total", 'tier="store"')
            back = _complete(srv.url, _layout(fresh[::-1], [40, 41]))
            assert _reuse(back)["store"] > 0
            assert _sample(srv.url, "spanserve_kv_tier_hits_total", 'tier="store"') > hits
            # corrupted and truncated payloads planted in the store: refused, counted, recomputed
            client = redis.client()
            keys = sorted(client.keys(b"spanserve:kv:*"))
            assert keys
            for j, k in enumerate(keys):
                v = client.get(k)
                client.set(k, v[: len(v) // 2] if j % 2 else v[:100] + bytes([v[100] ^ 1]) + v[101:])
            for i in range(6):
                _complete(srv.url, _layout(_docs(60 + i, 3), [44]))
            refused = ("spanserve_kv_tier_checksum_failures_total", "spanserve_kv_tier_auth_failures_total")
            bad = sum(_sample(srv.url, name, 'tier="store"') for name in refused)
            again = _complete(srv.url, _layout(fresh, [40, 41]))
            # a truncated payload fails the length check, an altered one the MAC
            assert sum(_sample(srv.url, name, 'tier="store"') for name in refused) > bad
            assert _reuse(again)["store"] == 0
            assert _tokens(again) == _tokens(_complete(srv.url, _layout(fresh, [40, 41])))
    finally:
        redis.stop()
