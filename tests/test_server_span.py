"""The span extensions end to end on a `spanserve serve` subprocess (tiny model): span queries
posted as spnl JSON, `segments`/`policy` on the OpenAI routes, and pinned segments."""
from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletion

from test_server_harness import ServerProcess, build_tiny_model, metric, run_server

MODEL = "tiny"
INNER = {"g": {"model": "spnl/x", "input": {"user": "Once upon a time there was a small engine"},
               "max_tokens": 8, "temperature": 0.5}}
JUDGE = {"g": {"model": "spnl/x", "input": {"cross": [
    {"system": "You judge stories by their first lines"},
    {"plus": [{"repeat": {"n": 3, "query": INNER}}]},
    {"user": "Which story is best?"},
]}, "max_tokens": 8}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("span")
    path = build_tiny_model(root / MODEL)
    # 128 blocks of 8 tokens: room for every test, and a pin budget (half) small enough to hit.
    with run_server(str(path), root, "--kv-cache-memory", "512KiB", "--block-size", "8",
                    "--served-model-name", MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def reuse_counter(http: httpx.Client, kind: str) -> float:
    want = f'spanserve_prompt_tokens_by_reuse_total{{kind="{kind}"}} '
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    raise KeyError(kind)


def gauge(http: httpx.Client, name: str) -> float:
    return metric(http.get("/metrics").text, name)


def error(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def reuse(body: dict[str, Any]) -> dict[str, int]:
    details = body["usage"]["prompt_tokens_details"]
    counts: dict[str, int] = details["reuse"]
    assert details["cached_tokens"] == counts["prefix"] + counts["perforated"] + counts["segment"]
    return counts


# ---------------------------------------------------------------------------- span queries


def test_judge_query_reads_the_inner_conversations_from_cache(http: httpx.Client) -> None:
    before = reuse_counter(http, "segment")
    r = http.post("/v1/query/execute", content=json.dumps(JUDGE), headers={"content-type": "text/plain"})
    assert r.status_code == 200, r.text
    body = r.json()
    answer = ChatCompletion.model_validate(body)  # the shape OpenAI clients parse
    assert answer.model == MODEL and answer.object == "chat.completion"
    outputs = body["span_query"]["outputs"]
    inner = [o for o in outputs if "in" in o["path"]]
    (root,) = [o for o in outputs if o["path"] == []]
    assert len(inner) == 3
    assert answer.choices[0].message.content == root["text"]
    assert body["usage"]["completion_tokens"] == root["completion_tokens"] <= 8
    # The judge reads every inner conversation (prompt + answer) from the KV its request left.
    hits = reuse(body)["segment"]
    assert hits >= sum(o["prompt_tokens"] + o["completion_tokens"] - 1 for o in inner)
    assert reuse_counter(http, "segment") - before >= hits


def test_streamed_query_matches_and_ends_with_done(http: httpx.Client) -> None:
    whole = http.post("/v1/query/execute", json=JUDGE).json()["choices"][0]["message"]["content"]
    with http.stream("POST", "/v1/query/execute?stream=true", json=JUDGE) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # Seeds follow each generation's place in the tree, so a rerun (now warm) answers the same.
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == whole
    assert chunks[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    assert chunks[-1]["usage"]["prompt_tokens_details"]["reuse"]["segment"] > 0


def test_bad_query_json_names_the_path(http: httpx.Client) -> None:
    bad = {"g": {"model": "m", "input": {"cross": [{"system": "s"}, {"user": 5}]}}}
    err = error(http.post("/v1/query/execute", json=bad))
    assert err["param"] == "$.g.input.cross[1].user" and "$.g.input.cross[1].user" in err["message"]
    err = error(http.post("/v1/query/execute", json={"g": {"input": {"user": "x"}}}))
    assert err["param"] == "$.g" and "'model'" in err["message"]
    assert error(http.post("/v1/query/execute", content=b'{"g": '))["param"] == "$"
    assert error(http.post("/v1/query/execute", content=b"\xff\xfe\x00"))["param"] == "$"


def test_unknown_operator_lists_the_supported_ones(http: httpx.Client) -> None:
    for op in ("frobnicate", "ask"):
        err = error(http.post("/v1/query/execute", json={"g": {"model": "m", "input": {"cross": [{op: "x"}]}}}))
        assert err["param"] == "$.g.input.cross[0]" and f"unknown operator '{op}'" in err["message"]
        assert all(k in err["message"] for k in ("cross", "plus", "g", "repeat", "user", "system"))


@pytest.mark.parametrize("query, needle", [
    ({"g": {"model": "m", "input": {"plus": []}}}, "no messages"),
    ({"g": {"model": "m", "input": {"user": "x"}, "temperature": -1.0}}, "temperature"),
    ({"g": {"model": "m", "input": {"user": "x"}, "policy": "magic"}}, "policy"),
    ({"cross": [{"user": "x"}]}, "no generation"),
    ({"repeat": {"n": 5000, "query": {"g": {"model": "m", "input": {"user": "x"}}}}}, "at most"),
    ({"g": {"model": "m", "input": {"user": "x " * 600}}}, "tokens"),
])
def test_queries_that_cannot_run_are_400(http: httpx.Client, query: dict[str, Any], needle: str) -> None:
    assert needle in error(http.post("/v1/query/execute", json=query))["message"]


def test_query_parameters_are_checked(http: httpx.Client) -> None:
    assert error(http.post("/v1/query/execute?stream=maybe", json=JUDGE))["param"] == "stream"
    assert error(http.post("/v1/query/execute?policy=magic", json=JUDGE))["param"] == "policy"
    assert error(http.post("/v1/query/execute?seed=-3", json=JUDGE))["param"] == "seed"


def test_seed_parameter_changes_the_samples(http: httpx.Client) -> None:
    def inner_texts(seed: int) -> list[str]:
        outs = http.post("/v1/query/execute", params={"seed": seed}, json=JUDGE).json()["span_query"]["outputs"]
        return [o["text"] for o in outs if o["path"]]

    assert inner_texts(7) == inner_texts(7) != inner_texts(8)


# ---------------------------------------------------------------------------- span layouts


DOCS = ["All that glitters is not gold; all who wander are not lost.",
        "A journey of a thousand miles begins with a single step."]


def layout(docs: list[str], **extra: Any) -> dict[str, Any]:
    segs: list[dict[str, Any]] = [{"text": d, "kind": "plus"} for d in docs]
    return {"model": MODEL, "segments": segs + [{"text": " Which one is wiser?"}], "max_tokens": 4,
            "temperature": 0, **extra}


@pytest.mark.parametrize("policy", ["none", "cacheblend", "none+repair"])
def test_completion_segments_reuse_at_another_position(http: httpx.Client, policy: str) -> None:
    salt = {"cache_salt": f"layout-{policy}"}  # a tenant of its own: a cold first request
    first = http.post("/v1/completions", json=layout(DOCS, policy=policy, **salt)).json()
    assert first["choices"][0]["finish_reason"] in ("length", "stop")
    assert reuse(first)["computed"] == first["usage"]["prompt_tokens"]
    swapped = http.post("/v1/completions", json=layout(DOCS[::-1], policy=policy, **salt)).json()
    assert swapped["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert reuse(swapped)["segment"] > 0


def test_bad_segments_and_policy_are_400(http: httpx.Client) -> None:
    assert error(http.post("/v1/completions", json=layout(DOCS, policy="magic")))["param"] == "policy"
    plus_tail = layout(DOCS)
    plus_tail["segments"][-1]["kind"] = "plus"
    assert "cross" in error(http.post("/v1/completions", json=plus_tail))["message"]
    error(http.post("/v1/completions", json={**layout(DOCS), "prompt": "both"}))
    error(http.post("/v1/completions", json={**layout(DOCS), "segments": []}))
    error(http.post("/v1/completions", json={"segments": [{"text": "a", "kind": "cross", "anchor": "prefix"}]}))
    error(http.post("/v1/completions", json={"segments": [{"text": "a", "token_ids": [1]}]}))


def test_chat_plus_messages_are_reused_in_any_order(http: httpx.Client) -> None:
    def chat(docs: list[str]) -> dict[str, Any]:
        msgs = [{"role": "system", "content": "Pick the wiser saying."}]
        msgs += [{"role": "user", "content": d, "kind": "plus"} for d in docs]
        msgs.append({"role": "user", "content": "Which one?"})
        body = {"model": MODEL, "messages": msgs, "max_tokens": 4, "cache_salt": "chat"}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    first, swapped = chat(DOCS), chat(DOCS[::-1])
    assert swapped["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert reuse(swapped)["segment"] > 0
    bad = {"model": MODEL, "messages": [{"role": "function", "name": "f", "content": "x", "kind": "plus"},
                                        {"role": "user", "content": "q"}]}
    assert error(http.post("/v1/chat/completions", json=bad))["param"] == "messages.0.role"
    orphan = {"model": MODEL, "messages": [{"role": "tool", "content": "x", "kind": "plus", "tool_call_id": "c1"},
                                           {"role": "user", "content": "q"}]}
    assert error(http.post("/v1/chat/completions", json=orphan))["param"] == "messages.0.tool_call_id"


# ---------------------------------------------------------------------------- pinning


def test_pin_use_and_unpin(http: httpx.Client) -> None:
    doc = "Once upon a time there was a small engine that served many requests."
    r = http.post("/v1/segments", json={"segments": [{"text": doc, "key": "story"}, {"token_ids": [40, 41, 42]}],
                                        "cache_salt": "pins"})
    assert r.status_code == 200, r.text
    pinned = r.json()["data"]
    assert pinned[0]["key"] == "story" and pinned[0]["tokens"] > 5 and pinned[1]["tokens"] == 3
    assert gauge(http, "spanserve_segments_pinned") == 2
    # The first request that reads the pinned text anywhere already finds it cached.
    use = http.post("/v1/completions", json={"model": MODEL, "segments": [
        {"text": "Question first.", "kind": "cross"}, {"text": doc, "kind": "plus"}, {"text": " Why?"}],
        "max_tokens": 2, "cache_salt": "pins"}).json()
    assert reuse(use)["segment"] >= pinned[0]["tokens"] - 1
    assert error(http.delete("/v1/segments/story"), 404)["code"] == "segment_not_found"  # other tenant
    assert http.delete("/v1/segments/story", params={"cache_salt": "pins"}).json()["deleted"] is True
    assert error(http.delete("/v1/segments/story", params={"cache_salt": "pins"}), 404)["param"] == "key"
    other = urllib.parse.quote(pinned[1]["key"], safe="")
    assert http.delete(f"/v1/segments/{other}", params={"cache_salt": "pins"}).status_code == 200
    assert gauge(http, "spanserve_segments_pinned") == 0 and gauge(http, "spanserve_kv_blocks_pinned") == 0


def test_unkeyed_segment_is_pinned_under_its_text(http: httpx.Client) -> None:
    text = "The quick brown fox\njumps over the lazy dog."  # newlines and all: the route takes any key
    r = http.post("/v1/segments", json={"segments": [{"text": text}]})
    assert r.json()["data"][0]["key"] == text
    assert http.delete("/v1/segments/" + urllib.parse.quote(text, safe="")).status_code == 200


def test_pin_budget_is_400_with_the_engines_message(http: httpx.Client) -> None:
    big = {"segments": [{"token_ids": list(range(10, 310)), "key": "big"}]}
    assert http.post("/v1/segments", json=big).status_code == 200
    try:
        again = {"segments": [{"token_ids": list(range(20, 320)), "key": "big-2"}]}
        err = error(http.post("/v1/segments", json=again))
        assert "pin budget" in err["message"] and err["code"] == "pin_budget_exceeded"
        error(http.post("/v1/segments", json={"segments": [{"text": "a", "key": "x"}, {"text": "b", "key": "x"}]}))
        error(http.post("/v1/segments", json={"segments": []}))
    finally:
        assert http.delete("/v1/segments/big").status_code == 200
    assert gauge(http, "spanserve_kv_blocks_pinned") == 0
