"""Runtime defaults: `auto` device/dtype/backend/graphs/fused ops, resolved by a pure function
(the CUDA branches tested with a made-up platform), honoured by LLM(...), the CLI and the server."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spanserve import LLM, SamplingParams
from spanserve.attention.reference import ReferenceBackend
from spanserve.engine.runtime import (
    Platform,
    Runtime,
    RuntimeRequest,
    checkpoint_dtype,
    detect_platform,
    resolve_runtime,
)

CPU = Platform(cuda_available=False)
GPU = Platform(cuda_available=True)


def rt(platform: Platform, **asked: object) -> Runtime:
    return resolve_runtime(RuntimeRequest(**asked), platform)  # type: ignore[arg-type]


def choices(r: Runtime) -> tuple:
    return r.device, r.dtype, r.attention_backend, r.cuda_graphs, r.fused_ops


# ---------------------------------------------------------------------------- the pure function


def test_auto_on_cpu_is_float32_reference_eager() -> None:
    r = rt(CPU)
    assert choices(r) == ("cpu", "float32", "reference", False, False)
    assert r.summary().startswith("device=cpu (auto: no CUDA device), dtype=float32 (auto: CPU), "
                                  "attention=reference (auto: not CUDA), cuda_graphs=off")


def test_auto_on_cuda_is_bf16_triton_graphs_fused() -> None:
    r = rt(GPU)
    assert choices(r) == ("cuda", "bfloat16", "triton", True, True)
    assert r.summary() == ("device=cuda (auto: CUDA available), dtype=bfloat16 (auto: CUDA), attention=triton "
                           "(auto: CUDA), cuda_graphs=on (auto: CUDA with Triton), fused_ops=on (auto: CUDA)")


def test_cuda_fallbacks_without_bf16_or_triton() -> None:
    assert rt(Platform(cuda_available=True, bf16_supported=False)).dtype == "float16"
    r = rt(Platform(cuda_available=True, triton_available=False))
    assert choices(r) == ("cuda", "bfloat16", "reference", False, False)
    assert "triton package is not installed" in r.reasons["attention"]


def test_explicit_choices_are_honoured() -> None:
    assert choices(rt(GPU, device="cpu")) == ("cpu", "float32", "reference", False, False)
    assert choices(rt(GPU, device="cuda:1", dtype="float32")) == ("cuda:1", "float32", "triton", True, True)
    r = rt(GPU, attention_backend="reference")
    assert choices(r) == ("cuda", "bfloat16", "reference", False, True)
    assert "reference backend" in r.reasons["cuda_graphs"]
    r = rt(GPU, enforce_eager=True, fused_ops="off")
    assert choices(r) == ("cuda", "bfloat16", "triton", False, False)
    assert "cuda_graphs=off (enforce_eager)" in r.summary() and "fused_ops=off (explicit)" in r.summary()
    assert rt(CPU, dtype="bfloat16").dtype == "bfloat16"
    assert rt(GPU, device="AUTO").device == "cuda"


def test_other_devices_take_the_checkpoint_dtype() -> None:
    half = Platform(cuda_available=False, checkpoint_dtype="float16")
    assert rt(half, device="mps").dtype == "float16"
    assert rt(half).dtype == "float32"  # on the CPU float32 whatever the checkpoint says
    assert rt(CPU, device="mps").dtype == "float32"


@pytest.mark.parametrize("asked, platform, words", [
    ({"device": "tpu9"}, CPU, "not a device"),
    ({"device": "cuda"}, CPU, "torch.cuda.is_available() is False"),
    ({"device": "cuda:0"}, CPU, "no CUDA device"),
    ({"dtype": "fp8"}, GPU, "dtype 'fp8' is not supported"),
    ({"dtype": "bfloat16"}, Platform(cuda_available=True, bf16_supported=False), "no bfloat16 support"),
    ({"attention_backend": "flash"}, GPU, "attention backend 'flash' is not a backend"),
    ({"attention_backend": "triton"}, CPU, "TRITON_INTERPRET=1"),
    ({"attention_backend": "triton"}, Platform(cuda_available=True, triton_available=False), "not installed"),
    ({"fused_ops": "on"}, CPU, "need a CUDA device"),
    ({"fused_ops": "yes"}, GPU, "use one of auto, on, off"),
])
def test_bad_choices_give_clear_errors(asked: dict, platform: Platform, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        rt(platform, **asked)


def test_triton_on_cpu_runs_in_the_interpreter() -> None:
    r = rt(Platform(cuda_available=False, triton_interpret=True), attention_backend="triton", fused_ops="on")
    assert choices(r) == ("cpu", "float32", "triton", False, True)
    assert r.reasons["attention"] == "explicit, Triton interpreter"
    # auto never picks the interpreter: it is for testing, not speed
    assert rt(Platform(cuda_available=False, triton_interpret=True)).attention_backend == "reference"


def test_detect_platform_here_and_checkpoint_dtype(tmp_path: Path) -> None:
    p = detect_platform()
    assert p.cuda_available == torch.cuda.is_available()
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(str(tmp_path)) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "int8"}))
    assert checkpoint_dtype(tmp_path) is None
    assert checkpoint_dtype(tmp_path / "missing") is None and checkpoint_dtype(object()) is None


# ---------------------------------------------------------------------------- LLM(...) and the CLI


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tiny_models import make_tiny_model

    return str(make_tiny_model("llama", tmp_path_factory.mktemp("rt"))[0])


def test_llm_defaults_resolve_and_are_logged(tiny: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="spanserve"):
        llm = LLM(tiny, num_blocks=32)
    assert choices(llm.runtime) == ("cpu", "float32", "reference", False, False)
    assert "runtime: device=cpu (auto: no CUDA device), dtype=float32 (auto: CPU)" in caplog.text
    e = llm.engine
    assert e.device.type == "cpu" and e.dtype == torch.float32
    assert isinstance(e.executor.backend, ReferenceBackend) and e.executor.graphs is None
    assert e.model.ops.__name__ == "_Eager"


def test_llm_explicit_names_and_objects(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(tiny, num_blocks=32, dtype="bfloat16", backend="reference")
    assert llm.engine.dtype == torch.bfloat16 and llm.runtime.reasons["dtype"] == "explicit"
    obj = ReferenceBackend()
    assert LLM(tiny, num_blocks=32, backend=obj).engine.executor.backend is obj
    assert LLM(tiny, num_blocks=32, backend=None).runtime.attention_backend == "reference"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(tiny, num_blocks=32, backend="triton")
    with pytest.raises(ValueError, match="no CUDA device"):
        LLM(tiny, num_blocks=32, device="cuda")


def test_triton_by_name_on_cpu_runs_in_the_interpreter(tiny: str) -> None:
    """backend="triton", fused_ops="on" on a CPU: the interpreter has to be on before Triton is
    imported, so this runs in a fresh process; greedy tokens equal the reference backend's."""
    import os
    import subprocess
    import sys

    prompt = list(range(5, 30))
    code = (f"from spanserve import LLM, SamplingParams\n"
            f"llm = LLM({tiny!r}, num_blocks=32, backend='triton', fused_ops='on')\n"
            f"print(type(llm.engine.executor.backend).__name__, llm.engine.model.ops.__name__)\n"
            f"p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)\n"
            f"print(llm.generate({prompt}, p)[0].token_ids)\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    kinds, tokens = done.stdout.strip().splitlines()
    assert kinds == "TritonBackend spanserve.model.fused"
    ref = LLM(tiny, num_blocks=32).generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert tokens == str(ref[0].token_ids)


def test_cli_passes_choices_to_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from spanserve import cli
    from spanserve.server import launch

    seen = []
    monkeypatch.setattr(launch, "serve", lambda opts: seen.append(opts.engine) or 0)
    assert cli.main(["serve", "--model", "m"]) == 0
    e = seen[-1]
    assert (e.model.device, e.model.dtype, e.runtime.backend, e.runtime.enforce_eager, e.runtime.fused_ops,
            e.runtime.overlap) == ("auto", "auto", "auto", False, "auto", None)
    assert cli.main(["serve", "--model", "m", "--device", "cpu", "--dtype", "bfloat16", "--attention-backend",
                     "reference", "--enforce-eager", "--fused-ops", "off", "--no-overlap"]) == 0
    e = seen[-1]
    assert (e.model.device, e.model.dtype, e.runtime.backend, e.runtime.enforce_eager, e.runtime.fused_ops,
            e.runtime.overlap) == ("cpu", "bfloat16", "reference", True, "off", False)


def test_cli_bad_choices(tiny: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from spanserve import cli

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main(["generate", "hi", "--model", tiny, "--device", "cuda"]) == 2
    assert "asks for CUDA" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--model", tiny, "--attention-backend", "triton"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_serve_logs_what_it_chose(tiny: str, caplog: pytest.LogCaptureFixture,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The real start-up path up to uvicorn (whose run is stubbed: no port is opened)."""
    import uvicorn

    from spanserve.engine.config import EngineConfig
    from spanserve.server.launch import ServeOptions, serve

    ran = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: ran.append(self))
    with caplog.at_level("INFO", logger="spanserve"):
        opts = ServeOptions(EngineConfig.from_kwargs(model=tiny, kv_cache_memory=1 << 21))
        assert serve(opts) == 1  # never started
    assert ran
    assert ("runtime: device=cpu (auto: no CUDA device), dtype=float32 (auto: CPU), attention=reference "
            "(auto: not CUDA), cuda_graphs=off (not CUDA), fused_ops=off (auto: not CUDA)") in caplog.text
    assert "loading model" in caplog.text and "on cpu (float32)" in caplog.text
