"""response_format with the engine core in a process of its own, as `spanserve serve` runs it:
the API server compiles the grammar and sends its serialized text, which the core opens with the
same tokenizer. Streamed and not, chat and completions, JSON schema and json_object."""
from __future__ import annotations

import json
import random
from collections.abc import Iterator

import jsonschema
import pytest
from starlette.testclient import TestClient

from spanserve.server.context import ServerConfig
from structured_helpers import random_schema, schema_output
from test_server_harness import app_client, build_tiny_model


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    path = str(build_tiny_model(tmp_path_factory.mktemp("structured-process") / "tiny"))
    with app_client(path, ServerConfig(served_model_name="tiny", model_source=path), process=True,
                    num_blocks=256, block_size=16) as c:
        yield c


@pytest.mark.parametrize(("route", "stream"), [("chat", False), ("completions", True)])
def test_json_schema_output_validates_through_a_core_process(client: TestClient, route: str, stream: bool) -> None:
    schema = random_schema(random.Random(7 + stream))
    text, reason = schema_output(client, route, stream, schema, 3)
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
