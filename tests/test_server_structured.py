"""response_format over HTTP (in-process app): chat and completions, streamed and not, on a
noise model behind SmolLM2's tokenizer; bad formats are 400s that name the field."""
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient

from spanserve.model.loader import load_tokenizer
from spanserve.server.app import create_app
from spanserve.server.context import ServerConfig
from engine_helpers import make_engine
from structured_helpers import build_tiny_smollm2, json_schema_format, random_schema, schema_output


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = build_tiny_smollm2(tmp_path_factory.mktemp("structured-http") / "tiny", load_tokenizer("smollm2"))
    engine = make_engine(str(path), num_blocks=256, block_size=16)
    app = create_app(engine, ServerConfig(served_model_name="tiny", model_source=str(path)))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def schemas() -> list[dict[str, Any]]:
    rng = random.Random(2024)
    return [random_schema(rng) for _ in range(4)]


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client: TestClient, schemas: list[dict[str, Any]], route: str,
                                      stream: bool) -> None:
    k = ["chat", "completions"].index(route) * 2 + int(stream)
    schema = schemas[k]
    text, reason = schema_output(client, route, stream, schema, k)
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_json_object_over_chat(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 60, "n": 4, "seed": 0,
        "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    for c in choices:
        assert c["message"]["content"].startswith("{")
        if c["finish_reason"] == "stop":
            assert isinstance(json.loads(c["message"]["content"]), dict)
    text = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "response_format": {"type": "text"}})
    assert text.status_code == 200


def test_length_cut_is_reported(client: TestClient) -> None:
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 40}}, "required": ["story"]}
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "response_format": json_schema_format(schema)})
    assert r.status_code == 200
    choice, text = r.json()["choices"][0], r.json()["choices"][0]["text"]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 5
    assert text.startswith('{"story":"') or '{"story":"'.startswith(text)  # a prefix of the only way on


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},  # the compiler refuses it
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "[a-"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},  # no schema
    {"type": "yaml"},
    "json",
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_bad_response_format_is_400(client: TestClient, fmt: Any, route: str) -> None:
    body: dict[str, Any] = {"max_tokens": 4, "response_format": fmt}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in route else {"prompt": "hi"})
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "response_format" in err["message"]
    # the field, or the part of it that is wrong (an unknown type names response_format.type)
    assert err["param"] in ("response_format", "response_format.type")
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200  # nothing was left behind
    assert client.app.state.ctx.engine.transport.core.engine.grammars.live == 0  # type: ignore[attr-defined]
