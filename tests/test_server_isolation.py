"""Hostile requests against `spanserve serve` with its engine core in a process of its own: while
one client's prompt is being tokenized and another's response format is being compiled, a
1-token request completes; each hostile request then gets its 400. The server runs with the
prompt and pattern bounds lifted so that the tokenizing and compiling really happen (with the
default bounds both are refused before any work: tests/test_server_limits.py)."""
from __future__ import annotations

import select
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from test_server_harness import ServerProcess, build_tiny_model, free_port, healthy, run_process

PROMPT_CHARS = 3_000_000  # the server's bound: a 10 MB prompt is refused, a 2.5 MB one is tokenized
GRAMMAR_TIMEOUT_S = 8.0
SERVE = f"""
import sys
from spanserve.engine.config import EngineConfig
from spanserve.server.launch import ServeOptions, serve
from spanserve.server.limits import RequestLimits

model, port = sys.argv[1], int(sys.argv[2])
limits = RequestLimits(max_prompt_chars={PROMPT_CHARS}, max_pattern_repeat=10**9, grammar_timeout_s={GRAMMAR_TIMEOUT_S})
engine = EngineConfig.from_kwargs(model=model, device="cpu", dtype="float32", num_blocks=256, block_size=8)
sys.exit(serve(ServeOptions(engine=engine, port=port, limits=limits, max_queued_requests=64)))
"""
PATTERN = {"type": "json_schema", "json_schema": {"name": "p", "schema": {
    "type": "object", "properties": {"s": {"type": "string", "pattern": "[a-z]{1,20000}"}}, "required": ["s"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("isolation")
    model = build_tiny_model(tmp / "tiny")
    port = free_port()
    with run_process([sys.executable, "-c", SERVE, str(model), str(port)], port, tmp / "server.log", 180) as srv:
        yield srv


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=300)


def test_a_probe_completes_while_a_prompt_tokenizes_and_a_grammar_compiles(server: ServerProcess) -> None:
    probe = {"prompt": "The quick brown fox", "max_tokens": 1}
    assert post(server, "/v1/completions", probe).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with ThreadPoolExecutor(3) as pool:
        huge = pool.submit(post, server, "/v1/completions", {"prompt": "word " * 2_000_000, "max_tokens": 1})
        tokenizing = pool.submit(post, server, "/v1/completions", {"prompt": "word " * 500_000, "max_tokens": 1})
        compiling = pool.submit(post, server, "/v1/chat/completions", {**chat, "response_format": PATTERN})
        refused = huge.result()  # bounded: refused before it is tokenized
        time.sleep(1.0)  # the other two are under way
        answered = post(server, "/v1/completions", probe)
        running = (tokenizing.done(), compiling.done())
        tokenized, compiled = tokenizing.result(), compiling.result()
    assert answered.status_code == 200, answered.text
    assert running == (False, False), "the probe waited for a hostile request"
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert "characters" in refused.json()["error"]["message"]
    assert tokenized.status_code == 400 and tokenized.json()["error"]["code"] == "context_length_exceeded"
    assert "tokens" in tokenized.json()["error"]["message"]  # counted after tokenizing
    err = compiled.json()["error"]
    assert compiled.status_code == 400 and err["param"] == "response_format", err
    assert f"did not compile within {GRAMMAR_TIMEOUT_S:g} s" in err["message"]
    assert post(server, "/v1/chat/completions", {**chat, "response_format": {"type": "json_object"}}).status_code == 200


def chunked_upload(port: int, mib: int) -> tuple[int, int]:
    """POST `mib` MiB as a chunked body over a raw socket, watching for an early answer after
    every chunk: (the status, MiB sent when it came)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n" % (1 << 20) + b"x" * (1 << 20) + b"\r\n"
        sent = 0
        while sent < mib and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(chunk)
            except OSError:  # closed on us: the answer is waiting
                break
            sent += 1
        if sent == mib:
            sock.sendall(b"0\r\n\r\n")
        status = int(sock.recv(4096).split(b" ", 2)[1])
    return status, sent


def test_a_chunked_body_is_refused_before_it_has_all_arrived(server: ServerProcess) -> None:
    status, sent = chunked_upload(server.port, 300)
    assert status == 413
    assert sent < 300  # answered while the client was still sending
    assert healthy(server)
