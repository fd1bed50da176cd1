"""Shared harness for the server tests: a tiny random Llama checkpoint built offline and a
`spanserve serve` subprocess on a free port.

Kept in a test module (the server tests may only add tests/test_server*.py files); the tests
at the bottom check the harness itself, so a broken fixture fails here first and clearly.
"""
from __future__ import annotations

import functools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]

# Repetitive on purpose: the byte-level BPE then learns whole words, so prompts stay short in
# tokens and the tests can reason about lengths.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "To be or not to be, that is the question.",
    "All that glitters is not gold; all who wander are not lost.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Once upon a time there was a small engine that served many requests.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
] * 20

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_CONTEXT = 512


def build_tiny_model(path: Path) -> Path:
    """A 2-layer random Llama plus a byte-level BPE tokenizer with a chat template, saved as a
    Hugging Face directory that `--model` accepts."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    eos = fast.convert_tokens_to_ids("<|im_end|>")
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TINY_CONTEXT,
                         tie_word_embeddings=True, bos_token_id=fast.bos_token_id, eos_token_id=eos)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path):
        self.proc = proc
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextmanager
def run_server(model: str | None, log_dir: Path, *extra: str, timeout: float = 120.0) -> Iterator[ServerProcess]:
    """`spanserve serve` in a subprocess (model None = the CLI's default), its engine core in a
    process of its own unless `extra` says --no-engine-process; yields once /health answers, stops
    it and every process it started on exit."""
    port = free_port()
    model_args = ["--model", model] if model is not None else []
    cmd = [sys.executable, "-m", "spanserve.cli", "serve", *model_args, "--port", str(port), *extra]
    with run_process(cmd, port, log_dir / f"server-{port}.log", timeout) as server:
        if "--no-engine-process" not in extra:  # every server test goes through the process boundary
            core_pid(server)
        yield server


@contextmanager
def run_process(cmd: list[str], port: int, log: Path, timeout: float = 120.0) -> Iterator[ServerProcess]:
    """A server command serving on `port`, its output in `log`: yields once /health answers,
    stops it and every process it started on exit."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "wb") as fh:  # a session of its own: its processes (core, API servers) are one group
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    server = ServerProcess(proc, port, log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_text()}")
            if healthy(server):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not come up in {timeout} s:\n{server.log_text()}")
            time.sleep(0.2)
        yield server
    finally:
        _signal_group(proc.pid, signal.SIGCONT)  # a test may have stopped a process of it
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # whatever outlived the server


def healthy(server: ServerProcess) -> bool:
    try:
        return httpx.get(f"{server.url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def spawned_children(pid: int) -> list[int]:
    """Processes that `pid` started with multiprocessing's spawn (engine core, API servers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def core_pid(server: ServerProcess) -> int:
    """The engine core of a `spanserve serve` started with the core in its own process: the pid
    its log names (at log level info), checked to be a spawned child of the server; else its one
    spawned child."""
    children = spawned_children(server.proc.pid)
    pids = re.findall(r"engine core \(pid (\d+)\)", server.log_text())
    if not pids:
        assert len(children) == 1, f"no engine core process among {children}:\n{server.log_text()}"
        return children[0]
    pid = int(pids[-1])
    assert pid in children, f"engine core {pid} is not a child of the server ({children})"
    return pid


@contextmanager
def app_client(model: str, config: Any, process: bool = False, **engine: Any) -> Iterator[Any]:
    """A TestClient of `create_app` over an engine of `model` (CPU, float32, options `engine`)
    whose core steps on a thread of this process, or in a process of its own (`process`), as
    `spanserve serve` runs it; the app's lifespan starts and stops either."""
    from starlette.testclient import TestClient

    from spanserve.engine.config import EngineConfig
    from spanserve.engine.core_process import process_client
    from spanserve.engine.engine import LLMEngine
    from spanserve.model.loader import load_tokenizer
    from spanserve.server.app import create_app

    engine_config = EngineConfig.from_kwargs(model=model, **{"device": "cpu", "dtype": "float32", **engine})
    if process:
        target: Any = process_client(functools.partial(LLMEngine, engine_config), load_tokenizer(model),
                                     config.max_pending, log_level="warning")
    else:
        target = LLMEngine(engine_config)
    with TestClient(create_app(target, config), raise_server_exceptions=False) as client:
        yield client


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample in Prometheus text format."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


# ---------------------------------------------------------------------------- harness checks


def test_tiny_model_loads_and_generates(tmp_path: Path) -> None:
    from spanserve import LLM, SamplingParams

    path = build_tiny_model(tmp_path / "tiny")
    llm = LLM(str(path), num_blocks=64, block_size=8)
    out = llm.generate("The quick brown fox", SamplingParams(max_tokens=5, temperature=0))[0]
    assert len(out.token_ids) <= 5 and out.finish_reason in ("length", "stop")
    assert llm.tokenizer.chat_template == CHAT_TEMPLATE


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
