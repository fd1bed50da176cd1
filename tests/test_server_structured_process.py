"""response_format with the engine core in a process of its own, as `spanserve serve` runs it:
the API server compiles the grammar and sends its serialized text, which the core opens with the
same tokenizer. Streamed and not, chat and completions, JSON schema and json_object."""
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from starlette.testclient import TestClient

from spanserve.server.context import ServerConfig
from structured_helpers import json_schema_format, random_schema
from test_server_harness import app_client, build_tiny_model
from test_server_structured import streamed_text


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = str(build_tiny_model(tmp_path_factory.mktemp("structured-process") / "tiny"))
    with app_client(path, ServerConfig(served_model_name="tiny", model_source=path), process=True,
                    num_blocks=256, block_size=16) as c:
        yield c


@pytest.mark.parametrize(("route", "stream"), [("chat", False), ("completions", True)])
def test_json_schema_output_validates_through_a_core_process(client: TestClient, route: str, stream: bool) -> None:
    schema = random_schema(random.Random(7 + stream))
    body: dict[str, Any] = {"max_tokens": 300, "seed": 3, "stream": stream,
                            "response_format": json_schema_format(schema)}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "Give me the record as JSON."}]
    else:
        body["prompt"] = "Record as JSON:"
    url = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    if stream:
        with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            text, reason = streamed_text(r, route == "chat")
    else:
        r = client.post(url, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text, reason = (choice["message"]["content"] if route == "chat" else choice["text"]), choice["finish_reason"]
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_json_object_through_a_core_process(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 60, "n": 2, "seed": 0,
        "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["message"]["content"].startswith("{")
        if c["finish_reason"] == "stop":
            assert isinstance(json.loads(c["message"]["content"]), dict)
    stats = client.get("/metrics")
    assert stats.status_code == 200 and "spanserve_kv_blocks_total 256.0" in stats.text
