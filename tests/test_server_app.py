"""The app in-process (Starlette's TestClient runs its lifespan): paths that need a server
configured differently from the shared subprocess one."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from spanserve.server.app import create_app
from spanserve.server.context import ServerConfig
from engine_helpers import make_engine
from test_server_harness import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-app") / "tiny")


@pytest.fixture()
def client(tiny: Path) -> Iterator[TestClient]:
    engine = make_engine(str(tiny), num_blocks=64, block_size=8)
    app = create_app(engine, ServerConfig(served_model_name="tiny", model_source=str(tiny), max_pending=2))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def test_over_capacity_is_429_and_nothing_is_half_added(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 2, "n": 3})
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "rate_limit_error"
    ok = client.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 2, "n": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_health_reports_a_stopped_engine(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    ctx = client.app.state.ctx  # type: ignore[attr-defined]
    client.portal.call(ctx.engine.shutdown)  # type: ignore[union-attr]
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    r = client.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 2})
    assert r.status_code == 503


def test_served_name_and_models(client: TestClient) -> None:
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny"] and data[0]["max_model_len"] == 512
