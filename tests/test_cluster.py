"""Replicas behind the segment-aware router on a local Ray Serve instance (tiny random model):
the `spanserve serve-cluster` command with default engine flags serves a chat request; requests
sharing documents in any order meet their KV on one replica, answers equal a single server's,
and a replica killed mid-request is survived and restarted. One Ray instance at a time: Ray is
heavy on a small machine."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from spanserve.cluster.app import ClusterOptions
from spanserve.cluster.launch import run_application, start_ray, stop
from tiny_models import make_tiny_model

ENGINE = {"num_blocks": 256, "block_size": 8, "max_num_seqs": 8}
DOCS = ["the cat sat on the mat . the dog ran .", "hello world , the dog sat on a mat !",
        "a cat ran on the mat ? the world sat ."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("cluster"))
    return path


def _group(pgid: int) -> list[int]:
    """The processes still in process group `pgid`: a command and everything it started (Ray
    makes its driver a group leader and starts its own processes in that group)."""
    alive = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    alive.append(int(d.name))
            except ProcessLookupError:
                pass
    return alive


def _serving(c: httpx.Client, proc: subprocess.Popen[bytes], timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, f"serve-cluster exited with {proc.returncode}"
        try:
            if c.get("/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"serve-cluster did not answer /health within {timeout:.0f} s")


def _interactive_sigint() -> None:
    """SIGINT as a terminal's Ctrl-C finds it: handled, not blocked. A process inherits its parent's
    ignored and blocked signals, and this test's worker may have run code that left SIGINT so (the
    command then slept through the test's Ctrl-C in full runs, never alone)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_the_serve_cluster_command_with_default_engine_flags_serves_chat(model_dir: Path, tmp_path: Path) -> None:
    """The command as the README gives it, run as a process (first in this module: before the
    module's own Ray instance starts). Every engine option is left at its default (auto device,
    dtype and backend), except the KV pool's size, kept small for a quick start."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    log = tmp_path / "serve-cluster.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "spanserve.cli", "serve-cluster", "--replicas", "2",
                                 "--model", str(model_dir), "--port", str(port), "--kv-cache-memory", "16MiB",
                                 "--tool-call-parser", "hermes"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_interactive_sigint)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            _serving(c, proc, timeout=300)
            r = c.post("/v1/chat/completions", json={"model": model_dir.name, "max_tokens": 4,
                                                    "messages": [{"role": "user", "content": "hello world"}]})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["role"] == "assistant"
            # the replicas parse tool calls with the parser the command named
            tool = {"type": "function", "function": {"name": "ping", "parameters": {
                "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["n"], "additionalProperties": False}}}
            r = c.post("/v1/chat/completions", json={"model": model_dir.name, "max_tokens": 60, "tools": [tool],
                                                    "tool_choice": "required", "parallel_tool_calls": False,
                                                    "messages": [{"role": "user", "content": "ping"}]})
            assert r.status_code == 200, r.text
            call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
            assert call["name"] == "ping" and json.loads(call["arguments"])["n"] in range(10)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130  # stopped by Ctrl-C, after stopping Ray
        _wait(lambda: not _group(proc.pid), 60, "Ray's processes to exit")
    except BaseException:
        if proc.poll() is None:  # still running: where each of its threads waits, into the log
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(2)
        print(log.read_text(errors="replace")[-12000:])
        raise
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        if _group(proc.pid):  # whatever is left of Ray, by the group the command leads
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[httpx.Client]:
    port = _free_port()
    start_ray(None, num_cpus=2, object_store_bytes=80 << 20)
    try:
        opts = ClusterOptions(model=str(model_dir), replicas=2, engine=ENGINE, served_model_name="tiny",
                              replica_cpus=0.5, health_check_period_s=1.0)
        run_application(opts, "127.0.0.1", port)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            yield c
    finally:
        stop()


@pytest.fixture(scope="module")
def single(model_dir: Path) -> Iterator[TestClient]:
    from spanserve.engine.config import EngineConfig
    from spanserve.engine.engine import LLMEngine
    from spanserve.server.app import create_app
    from spanserve.server.context import ServerConfig

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE))  # resolved as a replica does
    with TestClient(create_app(engine, ServerConfig("tiny", str(model_dir)))) as c:
        yield c


def layout(docs: list[str], question: str, **extra: Any) -> dict[str, Any]:
    segs = [{"text": d, "kind": "plus"} for d in docs] + [{"text": question}]
    return {"model": "tiny", "segments": segs, "max_tokens": 6, "temperature": 0, **extra}


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_shared_documents_meet_on_one_replica_and_answer_as_one_server(cluster: httpx.Client,
                                                                        single: TestClient) -> None:
    first = cluster.post("/v1/completions", json=layout(DOCS[:2], "the cat ?"))
    again = cluster.post("/v1/completions", json=layout(DOCS[1::-1], "a dog ?"))  # same documents, swapped
    assert again.headers["x-spanserve-replica"] == first.headers["x-spanserve-replica"]
    assert _ok(again)["usage"]["prompt_tokens_details"]["reuse"]["segment"] > 0
    plain = {"model": "tiny", "prompt": "hello world , the cat", "max_tokens": 6, "temperature": 0}
    chat = {"model": "tiny", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": DOCS[2], "kind": "plus"}, {"role": "user", "content": "?"}]}
    for path, body, got in [("/v1/completions", layout(DOCS[:2], "the cat ?"), first),
                            ("/v1/completions", layout(DOCS[1::-1], "a dog ?"), again),
                            ("/v1/completions", plain, cluster.post("/v1/completions", json=plain)),
                            ("/v1/chat/completions", chat, cluster.post("/v1/chat/completions", json=chat))]:
        want = single.post(path, json=body)
        assert want.status_code == 200, want.text
        text = [c.get("text", c.get("message", {}).get("content")) for c in _ok(got)["choices"]]
        assert text == [c.get("text", c.get("message", {}).get("content")) for c in want.json()["choices"]]
    # errors come back as a single server gives them, not as gateway failures
    bad = cluster.post("/v1/completions", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["message"]
    assert cluster.get("/v1/models").json()["data"][0]["id"] == "tiny"


def _engine_actors() -> dict[str, Any]:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if "SpanserveEngine" in a["name"]]
    return {n.rsplit("#", 1)[-1]: ray.get_actor(n, namespace="serve") for n in names}


def _wait(cond: Any, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


def test_a_killed_replica_is_survived_and_restarted(cluster: httpx.Client) -> None:
    import ray

    body = layout(DOCS[1:], "the world ?")
    warm = cluster.post("/v1/completions", json=body)
    victim = warm.headers["x-spanserve-replica"]
    actors = _engine_actors()
    assert victim in actors and len(actors) == 2
    long = dict(body, max_tokens=150, ignore_eos=True)
    result: dict[str, Any] = {}

    def send() -> None:
        result["r"] = cluster.post("/v1/completions", json=long)
        result["done"] = time.monotonic()

    t = threading.Thread(target=send)
    t.start()
    time.sleep(0.05)
    killed = time.monotonic()
    ray.kill(actors[victim], no_restart=True)
    t.join(timeout=120)
    assert not t.is_alive()
    r = result["r"]
    if r.status_code == 200:  # retried on the survivor: a whole answer
        # (on a fast machine the victim may have answered before the kill: nothing was in flight)
        assert r.headers["x-spanserve-replica"] != victim or result["done"] < killed
        assert r.json()["usage"]["completion_tokens"] == 150
    else:  # or a clear error naming the cause
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "replica_unavailable"
    # new requests for the same documents go to the survivor
    after = cluster.post("/v1/completions", json=body)
    assert after.status_code == 200, after.text
    assert after.headers["x-spanserve-replica"] != victim
    # and Ray Serve starts a replacement
    _wait(lambda: len(_engine_actors()) == 2 and victim not in _engine_actors(), 180, "a new replica")
    seen = set()
    for i in range(12):  # the router spreads plain prompts it has no keys for by load
        seen.add(_ok_headers(cluster.post("/v1/completions", json={"model": "tiny", "prompt": f"hello {i} cat",
                                                                    "max_tokens": 2, "temperature": 0})))
    assert victim not in seen


def _ok_headers(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.headers["x-spanserve-replica"]
