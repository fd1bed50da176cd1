"""EngineConfig: built from LLM(...) keywords, the command line or server options, checked with
errors that say what to change, resolved by one function on every path (LLM, serve,
serve-cluster), and shippable as plain data."""
from __future__ import annotations

import json
import pickle
from dataclasses import asdict, replace
from typing import Any

import pytest
import torch

import spanserve.engine.config as config_mod
# imported before any test stands in for LLMEngine: a module first imported while the stand-in is
# in place would keep it (server.app binds the name at import), failing later tests in this process
import spanserve.server.app  # noqa: F401
from spanserve import LLM, cli
from spanserve.attention.reference import ReferenceBackend
from spanserve.cache.tiers import OffloadConfig
from spanserve.engine.config import EngineConfig
from spanserve.engine.engine import LLMEngine
from spanserve.engine.runtime import Platform

CPU = Platform(cuda_available=False)
GPU = Platform(cuda_available=True)


class _Built(Exception):
    """Raised by the stand-in LLMEngine: the config it got is recorded, nothing is loaded."""


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[EngineConfig]:
    import spanserve.engine.engine as engine_mod
    import spanserve.llm as llm_mod

    seen: list[EngineConfig] = []

    def record(config: EngineConfig) -> None:
        seen.append(config)
        raise _Built

    monkeypatch.setattr(engine_mod, "LLMEngine", record)
    monkeypatch.setattr(llm_mod, "LLMEngine", record)
    return seen


# ---------------------------------------------------------------------------- building and checking


def test_unknown_keyword_names_it_and_the_close_match() -> None:
    with pytest.raises(ValueError, match=r"unknown engine option 'num_block' \(did you mean 'num_blocks'\?\)") as e:
        EngineConfig.from_kwargs(model="m", num_block=64)
    assert "known options: backend, block_size," in str(e.value)
    with pytest.raises(ValueError, match="unknown engine option 'zzz'; known options"):
        EngineConfig.from_kwargs(zzz=1)
    with pytest.raises(ValueError, match="did you mean 'max_num_seqs'"):
        LLM("m", max_num_seq=4)


def test_keywords_land_in_their_parts_and_old_spellings_are_read() -> None:
    cfg = EngineConfig.from_kwargs(model="m", block_size=8, max_num_seqs=4, tensor_parallel_size=2, overlap=False,
                                   dtype=torch.bfloat16, fused_ops=None, backend=None,
                                   kv_offload=OffloadConfig(cpu_bytes=1 << 20), sink_prefix=[1, 2])
    assert (cfg.model.source, cfg.model.dtype) == ("m", "bfloat16")
    assert (cfg.cache.block_size, cfg.scheduler.max_num_seqs) == (8, 4)
    assert (cfg.parallel.tensor_parallel_size, cfg.runtime.overlap) == (2, False)
    assert (cfg.runtime.fused_ops, cfg.runtime.backend, cfg.cache.sink_prefix) == ("auto", "auto", (1, 2))
    assert cfg.cache.kv_offload == asdict(OffloadConfig(cpu_bytes=1 << 20))
    assert EngineConfig.from_kwargs(**cfg.to_kwargs()) == cfg
    assert cfg.updated(block_size=4).cache.block_size == 4 and cfg.cache.block_size == 8  # frozen: a new config


@pytest.mark.parametrize("options, says", [
    ({"model": " "}, "model is empty"),
    ({"device": "tpu9"}, "device 'tpu9' is not a device; use auto, cpu, cuda or cuda:N"),
    ({"dtype": "fp8"}, "dtype 'fp8' is not one of auto, float32, bfloat16, float16"),
    ({"block_size": 0}, "block_size must be an integer >= 1, got 0"),
    ({"block_size": "8"}, "block_size must be an integer >= 1, got '8'"),
    ({"num_blocks": 1}, "a KV pool needs at least 2 blocks"),
    ({"kv_cache_memory": "64MiB"}, "kv_cache_memory must be an integer >= 1, got '64MiB'; give the KV pool's size "
                                   "in bytes"),
    ({"pin_fraction": 1.5}, r"pin_fraction must be a number in \[0, 1\]"),
    ({"pin_quota": -0.1}, r"pin_quota must be a number in \[0, 1\] \(the share of the KV pool one tenant's pins"),
    ({"pin_quota": True}, r"pin_quota must be a number in \[0, 1\]"),
    ({"reposition": "lazy"}, "reposition 'lazy' is not one of deferred, eager"),
    ({"kv_offload": {"cpu": "1GiB"}}, "unknown kv_offload settings"),
    ({"kv_offload": {"cpu_bytes": -1}}, "kv_offload cpu_bytes must be a size >= 0"),
    ({"sink_prefix": [1, -2]}, "sink_prefix must be a list of token ids"),
    ({"max_num_seqs": 0}, "max_num_seqs must be an integer >= 1"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be an integer >= 1"),
    ({"max_model_len": 1}, "max_model_len must be an integer >= 2"),
    ({"default_policy": "fancy"}, "unknown recomputation policy 'fancy'"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
    ({"tp_on_failure": "ignore"}, "tp_on_failure 'ignore' is not one of raise, exit"),
    ({"tp_peer_sum": "yes"}, "tp_peer_sum must be True or False"),
    ({"emulate_tp": 0}, "emulate_tp must be an integer >= 1"),
    ({"emulate_tp": 3, "tensor_parallel_size": 2}, "give it with tensor_parallel_size=1"),
    ({"backend": "flash"}, "backend 'flash' is not one of auto, triton, reference"),
    ({"cuda_graphs": "always"}, "cuda_graphs must be auto, True, False or 'eager'"),
    ({"fused_ops": "yes"}, "fused_ops 'yes' is not one of auto, on, off"),
    ({"overlap": "on"}, "overlap must be True or False or None"),
    ({"enforce_eager": True, "cuda_graphs": True}, "drop one of the two"),
])
def test_each_bad_value_is_refused_saying_what_to_change(options: dict[str, Any], says: str) -> None:
    cfg = EngineConfig.from_kwargs(**options)
    with pytest.raises(ValueError, match=says):
        cfg.check()
    with pytest.raises(ValueError, match=says):  # resolving checks first: nothing unchecked gets built
        cfg.resolve(CPU)


def test_llm_engine_takes_one_config() -> None:
    with pytest.raises(TypeError, match=r"LLMEngine takes one EngineConfig, e.g. LLMEngine\(EngineConfig.from_kwargs"):
        LLMEngine("smollm2")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- resolving


def test_resolve_makes_every_auto_choice_with_its_reason() -> None:
    cpu = EngineConfig.from_kwargs(model="m").resolve(CPU)
    assert (cpu.model.device, cpu.model.dtype, cpu.runtime.backend, cpu.runtime.cuda_graphs, cpu.runtime.fused_ops) \
        == ("cpu", "float32", "reference", False, "off")
    assert cpu.resolved and cpu.resolve(GPU) is cpu  # resolved once; its choices stay
    assert cpu.summary().startswith("device=cpu (auto: no CUDA device), dtype=float32 (auto: CPU)")
    gpu = EngineConfig.from_kwargs(model="m").resolve(GPU)
    assert (gpu.model.device, gpu.model.dtype, gpu.runtime.backend, gpu.runtime.cuda_graphs, gpu.runtime.fused_ops) \
        == ("cuda", "bfloat16", "triton", True, "on")
    assert EngineConfig.from_kwargs(cuda_graphs=False).resolve(GPU).runtime.cuda_graphs is False
    assert EngineConfig.from_kwargs(enforce_eager=True).resolve(GPU).reasons["cuda_graphs"] == "enforce_eager"
    eager = EngineConfig.from_kwargs(model="m", cuda_graphs="eager").resolve(CPU)
    assert eager.runtime.cuda_graphs == "eager" and eager.reasons["cuda_graphs"] == "explicit"
    obj = ReferenceBackend()
    assert EngineConfig.from_kwargs(backend=obj).resolve(GPU).runtime.backend is obj  # objects are kept
    assert EngineConfig.from_kwargs(kv_offload={"cpu_bytes": 0}).resolve(CPU).cache.kv_offload is None  # all off
    with pytest.raises(ValueError, match="asks for CUDA but torch sees no CUDA device"):
        EngineConfig.from_kwargs(device="cuda").resolve(CPU)
    with pytest.raises(ValueError, match="resolve"):
        EngineConfig().choices()


def test_a_resolved_config_round_trips_through_plain_data() -> None:
    cfg = EngineConfig.from_kwargs(model="/models/x", block_size=8, num_blocks=64, sink_prefix=[1, 2],
                                   kv_offload={"cpu_bytes": 1 << 20, "store_url": "redis://h:6379/0", "store_secret": "a-secret-of-16-chars"},
                                   default_policy="sparseq", tensor_parallel_size=2).resolve(GPU)
    data = cfg.to_dict()
    assert data["model"] == {"source": "/models/x", "device": "cuda", "dtype": "bfloat16", "quantization": None}
    assert EngineConfig.from_dict(data) == cfg
    back = EngineConfig.from_dict(json.loads(json.dumps(data)))  # lists for tuples: read back the same
    assert back == cfg and back.resolved and back.summary() == cfg.summary()
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    with pytest.raises(ValueError, match="unknown engine config sections"):
        EngineConfig.from_dict({**data, "extra": {}})
    with pytest.raises(ValueError, match="unknown engine option 'cache.blocks'"):
        EngineConfig.from_dict({"cache": {"blocks": 3}})


def test_objects_work_in_process_but_are_not_shipped() -> None:
    cfg = EngineConfig.from_kwargs(model="m", backend=ReferenceBackend()).resolve(CPU)
    with pytest.raises(ValueError, match="backend is a ReferenceBackend, which cannot be shipped"):
        cfg.to_dict()


# ---------------------------------------------------------------------------- the three paths


FLAGS = ["--model", "m", "--device", "cpu", "--dtype", "bfloat16", "--block-size", "8", "--kv-cache-memory", "64MiB",
         "--max-num-seqs", "4", "--no-overlap", "--default-policy", "full", "--engine-arg", "pin_fraction=0.25",
         "--engine-arg", "reposition=eager", "--pin-quota", "0.125"]
KWARGS = dict(model="m", device="cpu", dtype="bfloat16", block_size=8, kv_cache_memory=64 << 20, max_num_seqs=4,
              overlap=False, default_policy="full", pin_fraction=0.25, reposition="eager", pin_quota=0.125)


def test_command_line_flags_build_the_config_llm_keywords_build(built: list[EngineConfig],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import spanserve.cluster.launch as cluster_launch
    import spanserve.server.launch as server_launch

    want = EngineConfig.from_kwargs(**KWARGS)
    assert cli.engine_config(cli.build_parser().parse_args(["generate", "hi", *FLAGS])) == want
    got: dict[str, Any] = {}
    monkeypatch.setattr(server_launch, "serve", lambda opts: got.update(serve=opts.engine) or 0)
    monkeypatch.setattr(cluster_launch, "serve_cluster", lambda opts, *a: got.update(cluster=opts.engine_config()) or 0)
    assert cli.main(["serve", *FLAGS]) == 0 and cli.main(["serve-cluster", *FLAGS]) == 0
    assert got == {"serve": want, "cluster": want}
    with pytest.raises(_Built):
        cli.main(["generate", "hi", *FLAGS])
    with pytest.raises(_Built):
        LLM(**KWARGS)
    assert built == [want.resolve(), want.resolve()]


def test_a_bad_engine_arg_fails_at_the_command_line(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import spanserve.cluster.launch as cluster_launch

    started = []
    monkeypatch.setattr(cluster_launch, "serve_cluster", lambda *a: started.append(a) or 0)
    assert cli.main(["serve-cluster", "--engine-arg", "num_block=64"]) == 2
    assert "unknown engine option 'num_block' (did you mean 'num_blocks'?)" in capsys.readouterr().err
    assert cli.main(["serve-cluster", "--engine-arg", "block_size=0"]) == 2
    assert "block_size must be an integer >= 1" in capsys.readouterr().err
    assert cli.main(["serve", "--engine-arg", "pin_fraction=2"]) == 2
    assert "pin_fraction" in capsys.readouterr().err
    assert not started


@pytest.mark.parametrize("platform", [CPU, GPU], ids=["cpu", "cuda"])
def test_llm_serve_and_replicas_resolve_auto_with_one_function(platform: Platform, built: list[EngineConfig],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each path builds its config from its own options and resolves it with EngineConfig.resolve
    on the machine's Platform (made up here): all three end with the same choices."""
    from spanserve.cluster.app import ClusterOptions, EngineReplica
    from spanserve.server.launch import ServeOptions, serve

    asked: list[Any] = []
    monkeypatch.setattr(config_mod, "detect_platform", lambda model=None: asked.append(model) or platform)
    threads = torch.get_num_threads()
    try:
        for start in (lambda: LLM("m", num_blocks=32),
                      # the config is resolved before the core starts: here on this process's thread
                      lambda: serve(ServeOptions(EngineConfig.from_kwargs(model="m", num_blocks=32),
                                                 engine_process=False)),
                      lambda: EngineReplica(asdict(ClusterOptions(model="m", engine={"num_blocks": 32})))):
            with pytest.raises(_Built):
                start()
    finally:
        torch.set_num_threads(threads)  # a replica sets its own
    assert asked == ["m", "m", "m"]
    want = EngineConfig.from_kwargs(model="m", num_blocks=32).resolve(platform)
    assert want.model.device == ("cuda" if platform.cuda_available else "cpu")
    llm, served, replica = built
    assert llm == want and replica == want
    assert served == replace(want, parallel=replace(want.parallel, tp_on_failure="exit"))  # a server exits
