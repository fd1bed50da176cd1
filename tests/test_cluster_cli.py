"""`spanserve serve-cluster` turns its arguments into the application's options."""
from __future__ import annotations

from typing import Any

import pytest

from spanserve import cli
from spanserve.cluster.app import ClusterOptions


def _parsed(monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[ClusterOptions, Any]:
    import spanserve.cluster.launch as launch

    seen: dict[str, Any] = {}

    def fake(opts: ClusterOptions, address: Any, host: str, port: int) -> int:
        seen.update(opts=opts, address=address)
        return 0

    monkeypatch.setattr(launch, "serve_cluster", fake)
    assert cli.main(["serve-cluster", *argv]) == 0
    return seen["opts"], seen["address"]


def test_engine_options_reach_every_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    opts, address = _parsed(monkeypatch, "--model", "m", "--replicas", "3", "--block-size", "8",
                            "--engine-arg", "num_blocks=128", "--engine-arg", "kv-offload={'store_url': 'redis://h:6379/0'}",
                            "--engine-arg", "reposition=eager",
                            "--address", "auto")
    assert (opts.model, opts.replicas, address) == ("m", 3, "auto")
    assert opts.engine["block_size"] == 8 and opts.engine_config().cache.block_size == 8
    assert opts.engine["num_blocks"] == 128  # literals are parsed, other text stays text
    assert opts.engine["kv_offload"] == {"store_url": "redis://h:6379/0"}
    assert opts.engine["reposition"] == "eager"
    local, address = _parsed(monkeypatch, "--model", "m")
    assert address is None and local.replicas == 2 and local.replica_gpus is None  # None: by the device


def test_bad_options_are_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import spanserve.cluster.launch as launch

    monkeypatch.setattr(launch, "serve_cluster", lambda *a: 0)
    assert cli.main(["serve-cluster", "--replicas", "0"]) == 2
    assert "replicas must be >= 1" in capsys.readouterr().err
    assert cli.main(["serve-cluster", "--engine-arg", "novalue"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_serve_config_builder_reads_text_values() -> None:
    from ray.serve import Application

    from spanserve.cluster.app import app_builder

    app = app_builder({"model": "m", "replicas": "3", "engine": "{'block_size': 8}", "slack": 0.5})
    assert isinstance(app, Application)
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        app_builder({"replicas": "0"})
