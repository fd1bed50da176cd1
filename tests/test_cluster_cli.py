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
                            "--engine-arg", "num_blocks=128", "--engine-arg", "kv-offload={'store_url': 'redis://h:6379/0', 'store_secret': 'a-secret-of-16-chars'}",
                            "--engine-arg", "reposition=eager",
                            "--address", "auto")
    assert (opts.model, opts.replicas, address) == ("m", 3, "auto")
    assert opts.engine["block_size"] == 8 and opts.engine_config().cache.block_size == 8
    assert opts.engine["num_blocks"] == 128  # literals are parsed, other text stays text
    assert opts.engine["kv_offload"] == {"store_url": "redis://h:6379/0", "store_secret": "a-secret-of-16-chars"}
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


def test_replicas_reserve_a_gpu_each_when_the_engine_runs_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from spanserve.cluster import app
    from spanserve.engine.runtime import Platform

    gpu, cpu = Platform(cuda_available=True), Platform(cuda_available=False)
    plain = ClusterOptions(model="m")
    assert (app.replica_gpus(plain, gpu), app.replica_gpus(plain, cpu)) == (1.0, 0.0)  # auto: by the machine
    tp2 = ClusterOptions(model="m", engine={"tensor_parallel_size": 2})
    assert (app.replica_gpus(tp2, gpu), app.replica_gpus(tp2, cpu)) == (2.0, 0.0)  # one per rank
    assert app.replica_gpus(ClusterOptions(model="m", engine={"device": "cpu"}), gpu) == 0.0
    # named CUDA: the replicas' machines have the GPUs even where this one has none
    assert app.replica_gpus(ClusterOptions(model="m", engine={"device": "cuda"}), cpu) == 1.0
    for explicit in (0.0, 0.5, 2.0):  # an explicit value wins
        assert app.replica_gpus(ClusterOptions(model="m", replica_gpus=explicit), gpu) == explicit
    with pytest.raises(ValueError, match="replica_gpus must be >= 0"):
        ClusterOptions(replica_gpus=-1)
    # the deployment reserves what replica_gpus says for this machine
    monkeypatch.setattr(app, "detect_platform", lambda model=None: gpu)
    engines = app.build_app(plain)._bound_deployment.init_args[0]._bound_deployment
    assert engines.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 1.0}


def test_engine_options_are_checked_when_the_options_are_built() -> None:
    from spanserve.reuse.policies import SparseQ

    with pytest.raises(ValueError, match="did you mean 'num_blocks'"):
        ClusterOptions(engine={"num_block": 8})
    with pytest.raises(ValueError, match="give the model as ClusterOptions.model"):
        ClusterOptions(engine={"model": "m"})
    with pytest.raises(ValueError, match="cannot be shipped"):
        ClusterOptions(engine={"default_policy": SparseQ()})  # an object: it would not reach a remote replica
