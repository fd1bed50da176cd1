"""Tenants on the HTTP API, in process (Starlette's TestClient runs the lifespan): each API key's
tenant has a cache of its own, whatever cache_salt its client sends; pins have owners and
quotas; /metrics needs a key unless --metrics-open; chat messages need content."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from spanserve.server.app import create_app
from spanserve.server.auth import namespace_for
from spanserve.server.context import ServerConfig
from engine_helpers import make_engine
from test_server_harness import build_tiny_model

KEYS = {"alice": "sk-alice-1", "bob": "sk-bob-1", "carol": "sk-carol-1"}
DOC = "Once upon a time there was a small engine that served many requests."
PROMPT = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step."


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tenants") / "tiny")


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("# tenant key\n" + "".join(f"{t} {k}\n" for t, k in KEYS.items()))
    return str(path)


def serve(model_dir: Path, keys_file: str | None, **config: Any) -> TestClient:
    engine_options = {k: config.pop(k) for k in ("pin_quota", "pin_fraction") if k in config}
    engine = make_engine(str(model_dir), num_blocks=128, block_size=8, **engine_options)
    cfg = ServerConfig(served_model_name="tiny", model_source="tiny", api_keys_file=keys_file, **config)
    return TestClient(create_app(engine, cfg), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(model_dir: Path, keys_file: str) -> Iterator[TestClient]:
    # 128 blocks: the pin budget is 64 of them (pin_fraction 0.5), each tenant's quota 32
    with serve(model_dir, keys_file, pin_quota=0.25) as c:
        yield c


def counts(body: dict[str, Any]) -> tuple[int, dict[str, int]]:
    details = body["usage"]["prompt_tokens_details"]
    return details["cached_tokens"], details["reuse"]


def layout(salt: str | None) -> dict[str, Any]:
    segs = [{"text": "Question first."}, {"text": DOC, "kind": "plus"}, {"text": " Why?"}]
    return {"segments": segs, "max_tokens": 2, "temperature": 0, **({"cache_salt": salt} if salt is not None else {})}


# ---------------------------------------------------------------------------- namespaces


@given(st.text(max_size=6), st.text(max_size=6), st.text(max_size=6), st.text(max_size=6))
@settings(max_examples=500, deadline=None)
def test_namespaces_are_injective(t1: str, s1: str, t2: str, s2: str) -> None:
    if (t1, s1) != (t2, s2):
        assert namespace_for(t1, s1) != namespace_for(t2, s2)


def test_namespace_separators_cannot_be_forged() -> None:
    assert namespace_for("a", "b:c") != namespace_for("a:b", "c")
    assert namespace_for("a", namespace_for("b", "s")) != namespace_for("b", "s")
    assert namespace_for(None, "s") == "s" and namespace_for(None, None) == ""  # no keys: the salt, as always
    assert namespace_for("a", None) == namespace_for("a", "")


# ---------------------------------------------------------------------------- the cache


def test_another_tenants_entries_are_invisible_whatever_the_salt(client: TestClient) -> None:
    first = client.post("/v1/completions", json=layout("s"), headers=auth("bob")).json()
    assert counts(first)[0] == 0
    again = client.post("/v1/completions", json=layout("s"), headers=auth("bob")).json()
    assert counts(again)[0] > 0 and counts(again)[1]["prefix"] > 0  # bob's own entries are there
    for salt in (None, "s", namespace_for("bob", "s"), "bob", "bob:s"):  # each a namespace of her own
        r = client.post("/v1/completions", json=layout(salt), headers=auth("alice"))
        assert r.status_code == 200, r.text
        cached, reuse = counts(r.json())
        assert cached == 0 and reuse["prefix"] == reuse["perforated"] == reuse["segment"] == 0, salt
        assert reuse["computed"] == r.json()["usage"]["prompt_tokens"]


def test_plain_prompts_and_chats_are_partitioned_too(client: TestClient) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    client.post("/v1/completions", json=body, headers=auth("bob"))
    assert counts(client.post("/v1/completions", json=body, headers=auth("bob")).json())[0] > 0
    assert counts(client.post("/v1/completions", json=body, headers=auth("carol")).json())[0] == 0
    chat = {"messages": [{"role": "user", "content": DOC, "kind": "plus"}, {"role": "user", "content": "Why?"}],
            "max_tokens": 1, "cache_salt": "chat"}
    client.post("/v1/chat/completions", json=chat, headers=auth("bob"))
    assert counts(client.post("/v1/chat/completions", json=chat, headers=auth("bob")).json())[0] > 0
    assert counts(client.post("/v1/chat/completions", json=chat, headers=auth("carol")).json())[0] == 0


def test_span_queries_are_partitioned(client: TestClient) -> None:
    query = {"g": {"model": "x", "input": {"cross": [{"system": "Answer briefly."}, {"plus": [{"user": PROMPT}]},
                                                      {"user": "Which saying?"}]}, "max_tokens": 2}}

    def run(tenant: str, salt: str) -> list[int]:
        r = client.post(f"/v1/query/execute?cache_salt={salt}", content=json.dumps(query), headers=auth(tenant))
        assert r.status_code == 200, r.text
        return [o["cached_tokens"] for o in r.json()["span_query"]["outputs"]]

    run("bob", "q")
    assert sum(run("bob", "q")) > 0
    assert sum(run("alice", "q")) == 0


# ---------------------------------------------------------------------------- pins


def test_pins_cannot_be_seen_removed_or_replaced_across_tenants(client: TestClient) -> None:
    pin = {"segments": [{"text": DOC, "key": "story"}], "cache_salt": "p"}
    assert client.post("/v1/segments", json=pin, headers=auth("bob")).status_code == 200
    # alice's DELETE of bob's key answers exactly what a key nobody pinned answers
    foreign = client.delete("/v1/segments/story", params={"cache_salt": "p"}, headers=auth("alice"))
    missing = client.delete("/v1/segments/nothing", params={"cache_salt": "p"}, headers=auth("alice"))
    assert foreign.status_code == missing.status_code == 404
    assert foreign.json() == json.loads(missing.text.replace("nothing", "story"))
    # alice pinning the same key pins her own text in her own namespace; bob's pin stays
    mine = {"segments": [{"text": "All that glitters is not gold.", "key": "story"}], "cache_salt": "p"}
    assert client.post("/v1/segments", json=mine, headers=auth("alice")).status_code == 200
    use = {"segments": [{"text": "Question first."}, {"text": DOC, "kind": "plus"}, {"text": " Why?"}],
           "max_tokens": 1, "cache_salt": "p"}
    assert counts(client.post("/v1/completions", json=use, headers=auth("bob")).json())[1]["segment"] > 0
    assert counts(client.post("/v1/completions", json=use, headers=auth("alice")).json())[1]["segment"] == 0
    for tenant in ("bob", "alice"):
        r = client.delete("/v1/segments/story", params={"cache_salt": "p"}, headers=auth(tenant))
        assert r.status_code == 200 and r.json()["deleted"] is True
    assert client.delete("/v1/segments/story", params={"cache_salt": "p"}, headers=auth("bob")).status_code == 404


def test_pin_quotas_hold_per_tenant_and_the_budget_for_all(client: TestClient) -> None:
    def pin(tenant: str, key: str, blocks: int) -> Any:
        ids = list(range(10 + len(key), 10 + len(key) + 8 * blocks))
        return client.post("/v1/segments", json={"segments": [{"token_ids": ids, "key": key}]}, headers=auth(tenant))

    pinned = []
    try:
        assert pin("alice", "a1", 30).status_code == 200
        pinned.append(("alice", "a1"))
        over = pin("alice", "a2", 3)  # 33 > her quota of 32
        assert over.status_code == 400 and over.json()["error"]["code"] == "pin_quota_exceeded"
        assert "pin quota" in over.json()["error"]["message"]
        assert pin("bob", "b1", 30).status_code == 200  # bob's quota is his own
        pinned.append(("bob", "b1"))
        full = pin("carol", "c1", 5)  # 65 > the budget of 64, though carol's quota is untouched
        assert full.status_code == 400 and full.json()["error"]["code"] == "pin_budget_exceeded"
        assert pin("carol", "c1", 4).status_code == 200
        pinned.append(("carol", "c1"))
    finally:
        for tenant, key in pinned:
            assert client.delete(f"/v1/segments/{key}", headers=auth(tenant)).status_code == 200
    assert pin("alice", "a2", 32).status_code == 200  # unpinning gave the quota back
    assert client.delete("/v1/segments/a2", headers=auth("alice")).status_code == 200


# ---------------------------------------------------------------------------- access and conformance


def test_every_route_but_health_needs_a_key_and_names_no_tenant_it_lacks(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer sk-nobody"}, {"Authorization": KEYS["bob"]}):
        r = client.get("/metrics", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client.get("/v1/models", headers=headers).status_code == 401
    assert client.get("/metrics", headers=auth("carol")).status_code == 200


def test_metrics_open_opts_out(model_dir: Path, keys_file: str) -> None:
    with serve(model_dir, keys_file, metrics_open=True) as c:
        assert c.get("/metrics").status_code == 200 and "spanserve_kv_blocks_total" in c.get("/metrics").text
        assert c.get("/v1/models").status_code == 401
    with serve(model_dir, None, api_key="sk-one") as c:  # --api-key alone: tenant "default"
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"Authorization": "Bearer sk-one"}).status_code == 200


def test_messages_without_content_are_400_naming_the_field(client: TestClient) -> None:
    for i, role in ((0, "user"), (1, "system")):
        msgs = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
        msgs[i] = {"role": role} if i == 0 else {"role": role, "content": None}
        r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1}, headers=auth("bob"))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"messages.{i}.content" and role in r.json()["error"]["message"]
    empty = {"messages": [{"role": "user", "content": []}], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=empty, headers=auth("bob")).json()["error"]["param"] == \
        "messages.0.content"
    tool_call = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": []},
                              {"role": "user", "content": "and?"}], "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=tool_call, headers=auth("bob")).status_code == 200
