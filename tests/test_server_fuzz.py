"""Fuzzing every route with random and malformed bodies, hand-written (values near each field's
edges) and schema-driven (schemathesis over /openapi.json): the server must answer 2xx or 4xx
(never 5xx), in OpenAI's error shape when it refuses, and stay healthy with no blocks leaked."""
from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from test_server_harness import ServerProcess, build_tiny_model, metric, run_server

OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")
SPAN_ROUTES = ("/v1/query/execute", "/v1/segments")
ROUTES = OPENAI_ROUTES + SPAN_ROUTES
SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("fuzz")
    path = build_tiny_model(root / "tiny")
    # A short context bounds the work of any body that happens to be valid.
    with run_server(str(path), root, "--kv-cache-memory", "2MiB", "--block-size", "8",
                    "--max-model-len", "48", "--served-model-name", "tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)

# Values near the edges of what each field accepts, so valid-looking bodies reach deep paths.
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["tiny", "other", ""]) | st.none(),
    "prompt": st.text(max_size=40) | st.lists(st.integers(-2, 500), max_size=8)
    | st.lists(st.text(max_size=10), max_size=3) | st.lists(st.lists(st.integers(0, 399), max_size=4), max_size=3),
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool", "bot"]),
         "content": st.text(max_size=20) | st.none() | st.just([{"type": "text", "text": "hi"}])},
        optional={"kind": st.sampled_from(["plus", "cross", "other"])}), max_size=3),
    "segments": st.lists(st.fixed_dictionaries(
        {}, optional={"text": st.text(max_size=12), "token_ids": st.lists(st.integers(-2, 500), max_size=4),
                      "kind": st.sampled_from(["plus", "cross", "x"]), "anchor": st.sampled_from(["none", "prefix"]),
                      "key": st.text(max_size=4)}), max_size=4),
    "policy": st.sampled_from(["none", "full", "cacheblend", "sparseq", "magic"]),
    "max_tokens": st.integers(-1, 60) | st.none(),
    "max_completion_tokens": st.integers(-1, 60),
    "temperature": st.floats(-1, 3) | st.integers(0, 2) | st.just(float("nan")),
    "top_p": st.floats(-0.5, 1.5) | st.just(float("inf")),
    "top_k": st.integers(-3, 500),
    "min_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-(2**64), 2**64),
    "n": st.integers(-1, 4),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3) | st.none(),
    "stop_token_ids": st.lists(st.integers(-2, 2**40), max_size=3),
    "logprobs": st.integers(-1, 25) | st.booleans() | st.none(),
    "top_logprobs": st.integers(-1, 25),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "ignore_eos": st.booleans(),
    "cache_salt": st.text(max_size=8),
    "echo": st.booleans(),
    "frequency_penalty": st.floats(-1, 1),
    "logit_bias": st.dictionaries(st.text(max_size=3) | st.integers(-1, 500).map(str), st.floats(-101, 101),
                                  max_size=3),
    "presence_penalty": st.floats(-3, 3) | st.none(),
    "repetition_penalty": st.floats(-1, 200) | st.just(float("nan")),
    "prompt_logprobs": st.integers(-1, 25) | st.none(),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "yaml"}, {}]) | json_values,
    "reasoning_effort": st.sampled_from(["low", "high", None]) | json_values,
    "tools": st.just([{"type": "function", "function": {"name": "f"}}]) | st.just([]) | json_values,
    "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
}


@st.composite
def near_valid_bodies(draw: st.DrawFn, route: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 4}
    body["prompt" if route == "/v1/completions" else "messages"] = (
        "The quick brown fox" if route == "/v1/completions" else [{"role": "user", "content": "hi"}])
    for key in draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), max_size=4, unique=True)):
        body[key] = draw(FIELD_VALUES[key])
    for key in draw(st.lists(st.sampled_from(sorted(body)), max_size=1)):
        if draw(st.booleans()):
            del body[key]
        else:
            body[key] = draw(json_values)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=6))] = draw(json_values)
    return body


def _message(draw: st.DrawFn) -> dict[str, Any]:
    op = draw(st.sampled_from(["user", "system", "assistant", "user", "ask", "bogus"]))
    return {op: draw(st.text(max_size=12))}


@st.composite
def span_queries(draw: st.DrawFn, depth: int = 0) -> Any:
    """spnl-shaped queries, small enough to run inside the fuzz server's 48-token context."""
    if depth >= 3 or draw(st.integers(0, 2)) == 0:
        return _message(draw) if draw(st.integers(0, 15)) else draw(json_values)
    op = draw(st.sampled_from(["cross", "plus", "seq", "par", "repeat", "g", "g"]))
    if op == "repeat":
        return {"repeat": {"n": draw(st.integers(-1, 2)), "query": draw(span_queries(depth + 1))}}
    if op == "g":
        body: dict[str, Any] = {"model": draw(st.sampled_from(["spnl/x", "ollama/granite3.2:2b"])),
                                "input": draw(span_queries(depth + 1))}
        for key, values in (("max_tokens", st.integers(-1, 4)), ("temperature", st.floats(-0.5, 2)),
                            ("policy", FIELD_VALUES["policy"])):
            if draw(st.booleans()):
                body[key] = draw(values)
        return {"g": body}
    return {op: draw(st.lists(span_queries(depth + 1), max_size=3))}


@st.composite
def near_valid_span_bodies(draw: st.DrawFn, route: str) -> dict[str, Any]:
    if route == "/v1/query/execute":
        return {"g": {"model": "spnl/x", "input": draw(span_queries()), "max_tokens": draw(st.integers(0, 4))}}
    source = st.fixed_dictionaries({"text": st.text(max_size=12)}) | st.fixed_dictionaries(
        {"token_ids": st.lists(st.integers(-1, 400), max_size=4)})
    segment = st.tuples(source, st.none() | st.text(max_size=4)).map(
        lambda sk: sk[0] if sk[1] is None else {**sk[0], "key": sk[1]})
    body: dict[str, Any] = {"segments": draw(st.lists(segment, max_size=3) | FIELD_VALUES["segments"])}
    if draw(st.booleans()):
        body["cache_salt"] = draw(st.text(max_size=4))
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=6))] = draw(json_values)
    return body


def check(http: httpx.Client, route: str, content: bytes, content_type: str = "application/json") -> None:
    with http.stream("POST", route, content=content, headers={"content-type": content_type}) as r:
        raw = r.read()
    assert r.status_code < 500, (route, content[:300], raw[:500])
    event(f"HTTP {r.status_code}")  # --hypothesis-show-statistics: how many bodies got through
    if r.status_code >= 400:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}, raw
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in raw.decode().split("\n") if line]
        assert events[-1] == "data: [DONE]", raw[-300:]
        assert not any('"error"' in e[:12] for e in events), raw[:500]
    elif route == "/v1/segments":
        body = json.loads(raw)
        for seg in body["data"]:  # unpinned again, so the leak check at the end still holds
            key = urllib.parse.quote(seg["key"], safe="")
            assert http.delete(f"/v1/segments/{key}", params={"cache_salt": body["cache_salt"] or ""}).status_code == 200
    else:
        assert "choices" in json.loads(raw)


@pytest.mark.parametrize("route", OPENAI_ROUTES)
@SETTINGS
@given(data=st.data())
def test_near_valid_bodies(http: httpx.Client, route: str, data: st.DataObject) -> None:
    body = data.draw(near_valid_bodies(route))
    check(http, route, json.dumps(body, allow_nan=True).encode())


@pytest.mark.parametrize("route", SPAN_ROUTES)
@SETTINGS
@given(data=st.data())
def test_near_valid_span_bodies(http: httpx.Client, route: str, data: st.DataObject) -> None:
    body = data.draw(near_valid_span_bodies(route))
    check(http, route, json.dumps(body, allow_nan=True).encode(), data.draw(st.sampled_from(["application/json",
                                                                                              "text/plain"])))


@settings(SETTINGS, max_examples=120)
@given(route=st.sampled_from(ROUTES), value=json_values)
def test_arbitrary_json(http: httpx.Client, route: str, value: Any) -> None:
    check(http, route, json.dumps(value, allow_nan=True).encode())


@settings(SETTINGS, max_examples=100)
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=64),
       content_type=st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded"]))
def test_malformed_bytes(http: httpx.Client, route: str, raw: bytes, content_type: str) -> None:
    check(http, route, raw, content_type)


# ---------------------------------------------------------------------------- schema-driven
# schemathesis reads the server's own /openapi.json and sends what it declares (bodies that fit the
# schema and bodies that break it) to every route: a field added to a request model is fuzzed
# without touching this file. Cross-field rules the schema cannot state (one of two inputs, the
# served model's name) are steered towards acceptance so that most valid bodies reach the engine.

SCHEMA_EXAMPLES = 30  # per route: about 300 requests in all
ONE_OF = {"/v1/completions": ("prompt", "segments"), "/tokenize": ("prompt", "messages")}
DEFAULT_INPUT: dict[str, Any] = {"prompt": "The quick brown fox", "messages": [{"role": "user", "content": "hi"}]}


def steer(case: schemathesis.Case) -> schemathesis.Case:
    body = case.body
    if not isinstance(body, dict):
        return case
    if "model" in body:
        body["model"] = "tiny"
    pair = ONE_OF.get(case.path)
    if pair is not None:
        first, second = pair
        if body.get(first) is not None and body.get(second) is not None:
            body.pop(second)
        if body.get(first) is None and body.get(second) is None:
            body.pop(second, None)
            body[first] = DEFAULT_INPUT[first]
    return case


def check_case(http: httpx.Client, case: schemathesis.Case) -> None:
    r = case.call(base_url=str(http.base_url).rstrip("/"), timeout=60)
    assert r.status_code < 500, (case.method, case.path, case.body, r.text[:500])
    event(f"{case.method} {case.path}: HTTP {r.status_code}")
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, r.text
    elif case.path == "/v1/segments" and case.method.upper() == "POST":
        body = r.json()
        for seg in body["data"]:  # unpinned again, so the leak check at the end still holds
            key = urllib.parse.quote(seg["key"], safe="")
            assert http.delete(f"/v1/segments/{key}", params={"cache_salt": body["cache_salt"] or ""}).status_code == 200


def test_schema_driven_every_route(server: ServerProcess, http: httpx.Client) -> None:
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
        "POST /v1/segments", "DELETE /v1/segments/{key}", "POST /v1/query/execute", "GET /v1/models"}
    for op in operations:
        cases = st.one_of(op.as_strategy(GenerationMode.POSITIVE).map(steer), op.as_strategy(GenerationMode.NEGATIVE))

        @settings(SETTINGS, max_examples=SCHEMA_EXAMPLES)
        @given(case=cases)
        def run(case: schemathesis.Case) -> None:
            check_case(http, case)

        run()


def test_server_healthy_and_no_blocks_leaked(server: ServerProcess, http: httpx.Client) -> None:
    # Runs after the fuzzers (file order): anything they broke or leaked shows here.
    assert http.get("/health").status_code == 200
    deadline = time.monotonic() + 10
    while True:
        text = http.get("/metrics").text
        if metric(text, "spanserve_kv_blocks_free") == metric(text, "spanserve_kv_blocks_total"):
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 2})
    assert r.status_code == 200
    assert "Traceback" not in server.log_text()
