"""Schema-driven fuzzing: schemathesis reads the server's own /openapi.json and sends bodies,
paths and queries generated from it (valid ones and ones that break it) to every route. The
server must answer 2xx or 4xx, never 5xx, in OpenAI's error shape when it refuses.

Complements test_server_fuzz.py, whose hand-written strategies aim at values near each field's
edges; this one follows whatever the schema declares, so a field added to a request model is
fuzzed without touching the test."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from test_server_harness import ServerProcess, build_tiny_model, run_server

KEY = "sk-fuzz"
EXAMPLES = 30  # per route: about 300 requests in all


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("schema-fuzz")
    path = build_tiny_model(root / "tiny")
    # A short context bounds the work of any body that happens to be valid.
    with run_server(str(path), root, "--kv-cache-memory", "2MiB", "--block-size", "8", "--max-model-len", "48",
                    "--served-model-name", "tiny", "--api-key", KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server: ServerProcess) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"})


# Cross-field rules the schema cannot state: one of two inputs, and the served model's name.
ONE_OF = {"/v1/completions": ("prompt", "segments"), "/tokenize": ("prompt", "messages")}
DEFAULT_INPUT = {"prompt": "The quick brown fox", "messages": [{"role": "user", "content": "hi"}]}


def steer(case: schemathesis.Case) -> schemathesis.Case:
    """Move a schema-valid body towards one the server accepts, so that most of them reach the
    engine instead of stopping at the model name or a missing input."""
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


def check(case: schemathesis.Case) -> None:
    r = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code < 500, (case.method, case.path, case.body, r.text[:500])
    event(f"{case.method} {case.path}: HTTP {r.status_code}")  # --hypothesis-show-statistics
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, r.text


def test_no_5xx_on_any_route(api_schema: schemathesis.BaseSchema) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
        "POST /v1/segments", "DELETE /v1/segments/{key}", "POST /v1/query/execute", "GET /v1/models"}
    for op in operations:
        # bodies that fit the schema and bodies that break it, in one deterministic run per route
        cases = st.one_of(op.as_strategy(GenerationMode.POSITIVE).map(steer),
                          op.as_strategy(GenerationMode.NEGATIVE))
        run = settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                       suppress_health_check=list(HealthCheck))(given(case=cases)(check))
        run()


def test_server_survived(server: ServerProcess) -> None:
    import httpx

    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "Traceback" not in server.log_text()
