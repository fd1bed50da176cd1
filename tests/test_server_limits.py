"""Bounds on hostile input, in-process (Starlette's TestClient): prompts too long for the context
are refused before any tokenizing, stop strings, choices and response formats are bounded, span
queries are measured before they expand, bodies are counted while they stream in, and /health
notices a core that stops stepping."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from spanserve.server.app import create_app
from spanserve.server.context import ServerConfig
from spanserve.server.limits import MAX_CHARS_PER_TOKEN, RequestLimits
from engine_helpers import make_engine
from test_server_harness import TINY_CONTEXT, build_tiny_model

BIG = "word " * 2_000_000  # 10 MB of text
PATHOLOGICAL = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"s": {"type": "string", "pattern": "[a-z]{1,20000}"}}, "required": ["s"]}}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-limits") / "tiny")


def serve(tiny: Path, **limits: Any) -> TestClient:
    engine = make_engine(str(tiny), num_blocks=128, block_size=8)
    config = ServerConfig(served_model_name="tiny", model_source=str(tiny), limits=RequestLimits(**limits))
    return TestClient(create_app(engine, config), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(tiny: Path) -> Iterator[TestClient]:
    with serve(tiny, max_body_bytes=12 << 20) as c:
        yield c


@pytest.fixture()
def tokenized(client: TestClient) -> list[int]:
    """Counts every call onto the tokenizer workers while the test runs."""
    pool = client.app.state.ctx.tokenizers  # type: ignore[attr-defined]
    calls: list[int] = []
    run = pool.run

    async def counting(fn: Any, *args: Any) -> Any:
        calls.append(1)
        return await run(fn, *args)

    pool.run = counting
    yield calls
    pool.run = run


def error(r: Any, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    return err


def test_the_default_prompt_bound_is_the_context_in_characters(client: TestClient) -> None:
    assert client.app.state.ctx.max_prompt_chars == TINY_CONTEXT * MAX_CHARS_PER_TOKEN  # type: ignore[attr-defined]


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": BIG, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": ["hello", BIG], "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": BIG}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG, "kind": "plus"},
                                           {"role": "user", "content": "q"}]}, "messages"),
    ("/v1/completions", {"segments": [{"text": "a"}, {"text": BIG, "kind": "plus"}], "max_tokens": 1}, "segments"),
    ("/tokenize", {"prompt": BIG}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": BIG}]}, "messages"),
    ("/v1/segments", {"segments": [{"text": BIG}]}, "segments"),
    ("/v1/query/execute", {"g": {"model": "m", "input": {"user": BIG}}}, "$"),
])
def test_text_beyond_the_context_is_refused_before_tokenizing(client: TestClient, tokenized: list[int], route: str,
                                                               body: dict[str, Any], param: str) -> None:
    err = error(client.post(route, json=body))
    assert err["code"] == "context_length_exceeded" and err["param"] == param, err
    assert "characters" in err["message"]
    assert tokenized == []


def test_a_rendered_conversation_is_bounded_too(tiny: Path) -> None:
    """Tool calls reach the template without being content: the rendered text is checked as well."""
    engine = make_engine(str(tiny), num_blocks=64, block_size=8)
    engine.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}{{ c['function']['arguments'] }}{% endfor %}\n{% endfor %}")
    config = ServerConfig(served_model_name="tiny", model_source=str(tiny),
                          limits=RequestLimits(max_prompt_chars=2000))
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "x" * 5000}}]
    with TestClient(create_app(engine, config), raise_server_exceptions=False) as c:
        short = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls[:0]}]
        assert c.post("/tokenize", json={"messages": short}).status_code == 200
        long = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}]
        err = error(c.post("/tokenize", json={"messages": long}))
        assert err["param"] == "messages" and "rendered conversation" in err["message"]


def test_stop_strings_and_choices_are_capped(client: TestClient, tokenized: list[int]) -> None:
    base = {"prompt": "hello world", "max_tokens": 1}
    err = error(client.post("/v1/completions", json={**base, "stop": [f"s{i}" for i in range(1_000_000)]}))
    assert err["param"] == "stop" and err["code"] == "too_many_stop_strings"
    err = error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "stop": ["x" * 257]}))
    assert err["param"] == "stop" and err["code"] == "stop_string_too_long"
    vocab = client.app.state.ctx.engine.info.vocab_size  # type: ignore[attr-defined]
    err = error(client.post("/v1/completions", json={**base, "stop_token_ids": [1] * (vocab + 1)}))
    assert err["param"] == "stop_token_ids"
    err = error(client.post("/v1/completions", json={**base, "prompt": ["hello"] * 64, "n": 16}))
    assert err["param"] == "n" and err["code"] == "too_many_choices" and "1024" in err["message"]
    assert tokenized == []  # all refused before any prompt was tokenized
    ok = client.post("/v1/completions", json={**base, "prompt": ["hello"] * 4, "n": 16,
                                              "stop": [f"s{i}" for i in range(16)]})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 64


def test_bodies_over_the_limit_are_413(client: TestClient) -> None:
    """Chunked (no Content-Length to check first) or declared; tests/test_server_isolation.py shows
    over a socket that a chunked body is refused before it has all arrived."""
    chunks = (b"x" * (64 << 10) for _ in range(256))  # 16 MiB
    err = error(client.post("/v1/completions", content=chunks, headers={"content-type": "application/json"}), 413)
    assert err["code"] == "body_too_large"
    declared = client.post("/v1/completions", content=b"{}", headers={"content-length": str(13 << 20)})
    assert declared.status_code == 413


def test_span_queries_are_measured_before_they_expand(client: TestClient, tokenized: list[int]) -> None:
    def repeat(n: int, q: dict[str, Any]) -> dict[str, Any]:
        return {"repeat": {"n": n, "query": q}}

    huge = {"g": {"model": "m", "input": repeat(100_000, repeat(100_000, {"user": "x"}))}}
    err = error(client.post("/v1/query/execute", json=huge))
    assert err["code"] == "query_too_large" and "nodes" in err["message"]
    deep: dict[str, Any] = {"user": "x"}
    for _ in range(100):
        deep = repeat(2, deep)
    err = error(client.post("/v1/query/execute", json={"g": {"model": "m", "input": deep}}))
    assert err["code"] == "query_too_large"
    err = error(client.post("/v1/query/execute", json=repeat(64, repeat(64, {"g": {"model": "m", "input": {"user": "x"}}}))))
    assert err["code"] == "query_too_large" and "4096 generations" in err["message"]
    # A message repeated inside one generation's input is that much prompt text.
    text = "x" * 1000
    err = error(client.post("/v1/query/execute", json={"g": {"model": "m", "input": repeat(100, {"user": text})}}))
    assert err["code"] == "context_length_exceeded" and "100000 characters" in err["message"]
    assert tokenized == []


def test_response_formats_are_bounded_before_compiling(client: TestClient) -> None:
    ctx = client.app.state.ctx  # type: ignore[attr-defined]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    err = error(client.post("/v1/chat/completions", json={**body, "response_format": PATHOLOGICAL}))
    assert err["param"] == "response_format" and err["code"] == "response_format_too_complex"
    assert "20000" in err["message"]
    nested = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "string", "pattern": "(([a-z]{1,6}){1,6}){1,6}"}}}
    err = error(client.post("/v1/chat/completions", json={**body, "response_format": nested}))
    assert err["code"] == "response_format_too_complex" and "216" in err["message"]
    wide = {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "properties": {f"p{i:06d}": {"type": "integer"} for i in range(8000)}}}}
    err = error(client.post("/v1/chat/completions", json={**body, "response_format": wide}))
    assert err["code"] == "response_format_too_complex" and "bytes" in err["message"]
    assert ctx.grammars._all == set()  # no compile worker was ever started for them


def test_a_compile_that_overruns_is_killed_and_the_next_one_works(tiny: Path) -> None:
    with serve(tiny, max_pattern_repeat=10**9, grammar_timeout_s=1.0, grammar_workers=1) as c:
        pool = c.app.state.ctx.grammars  # type: ignore[attr-defined]
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        err = error(c.post("/v1/chat/completions", json={**body, "response_format": PATHOLOGICAL}))
        assert err["param"] == "response_format" and err["code"] == "response_format_too_complex"
        assert "did not compile within 1 s" in err["message"] and pool.killed == 1
        ok = c.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
        assert ok.status_code == 200, ok.text
        (worker,) = pool._all
        worker.proc.kill()  # a worker that dies idle is replaced, not blamed on the next request
        worker.proc.join()
        ok = c.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
        assert ok.status_code == 200, ok.text


def test_health_reports_a_core_that_stops_stepping(tiny: Path) -> None:
    engine = make_engine(str(tiny), num_blocks=64, block_size=8)
    stepping, release = threading.Event(), threading.Event()
    advance = engine.advance

    def blocked() -> Any:
        stepping.set()
        release.wait()
        return advance()

    engine.advance = blocked  # type: ignore[method-assign]
    config = ServerConfig(served_model_name="tiny", model_source=str(tiny), step_timeout_s=0.3)
    with TestClient(create_app(engine, config), raise_server_exceptions=False) as c:
        assert c.get("/health").status_code == 200  # idle: no step is owed
        pending = threading.Thread(target=c.post, args=("/v1/completions",),
                                   kwargs={"json": {"prompt": "hello", "max_tokens": 2}})
        pending.start()
        assert stepping.wait(60)
        time.sleep(0.6)  # longer than the step timeout, with a request waiting
        err = error(c.get("/health"), 503)
        assert err["code"] == "engine_stalled"
        release.set()
        pending.join(60)
        assert c.get("/health").status_code == 200
