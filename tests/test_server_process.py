"""`spanserve serve` with the engine core in a process of its own, as a user runs it: a core that
dies ends every stream with an error, new requests get 503 and the server exits non-zero (or
starts a new core with --restart-engine); a client that disconnects has its request aborted in
the core; /health follows the core's step heartbeat; several API servers share one port and one
core, and the death of any process stops them all."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from test_server_harness import ServerProcess, build_tiny_model, core_pid, metric, run_server, spawned_children

PROMPT = "The quick brown fox jumps over the lazy dog."
LONG = {"model": "tiny", "prompt": PROMPT, "max_tokens": 450, "stream": True, "ignore_eos": True}
EXIT_S = 5.0  # the server exits this soon after its core dies
STEP_TIMEOUT_S = 2.0
SERVE = ("--kv-cache-memory", "16MiB", "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("core-process") / "tiny")


@pytest.fixture(scope="module")
def restarting(tiny: Path) -> Iterator[ServerProcess]:
    """A server that starts a new core when its core dies; /health is 503 after STEP_TIMEOUT_S
    without a step while requests wait."""
    with run_server(str(tiny), tiny.parent, *SERVE, "--restart-engine", "--step-timeout", str(STEP_TIMEOUT_S)) as srv:
        yield srv


def events(lines: Iterator[str]) -> list[Any]:
    """The JSON payloads of the SSE lines left in a stream, and "[DONE]"."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def stream_until_core_killed(url: str, core: int) -> list[Any]:
    """Start a long stream, kill the core after its first event; what the stream sent after."""
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        os.kill(core, signal.SIGKILL)
        return events(lines)


def assert_ended_with_error(rest: list[Any]) -> None:
    assert rest[-1] == "[DONE]" and "error" in rest[-2], rest[-3:]
    assert "engine core" in rest[-2]["error"]["message"]
    assert not any(isinstance(e, dict) and "choices" in e and e["choices"][0].get("finish_reason") for e in rest)


def wait_for(check: Any, timeout: float, what: str) -> float:
    """Seconds until check() is true; AssertionError after timeout."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def health(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)


def test_core_death_ends_streams_and_the_server_exits_nonzero(tiny: Path) -> None:
    with run_server(str(tiny), tiny.parent, *SERVE) as srv:
        rest = stream_until_core_killed(srv.url, core_pid(srv))
        killed = time.monotonic()
        assert_ended_with_error(rest)
        # The server is on its way out: whatever still answers refuses with a message.
        try:
            r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 503 and "engine" in r.json()["error"]["message"], r.text
        except httpx.TransportError:
            pass  # already closed its port
        code = srv.proc.wait(timeout=EXIT_S + 10)
        assert time.monotonic() - killed < EXIT_S and code != 0, (code, srv.log_text())
        assert "the engine core died" in srv.log_text()


def test_health_follows_the_core_step_heartbeat(restarting: ServerProcess) -> None:
    url, core = restarting.url, core_pid(restarting)
    os.kill(core, signal.SIGSTOP)
    try:  # idle, a stopped core does not matter yet
        time.sleep(STEP_TIMEOUT_S + 0.5)
        assert health(url).status_code == 200
    finally:
        os.kill(core, signal.SIGCONT)
    time.sleep(0.6)  # a heartbeat

    done: list[httpx.Response] = []
    waiting = threading.Thread(target=lambda: done.append(httpx.post(
        f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3}, timeout=60)), daemon=True)
    os.kill(core, signal.SIGSTOP)
    try:
        waiting.start()
        took = wait_for(lambda: health(url).status_code == 503, STEP_TIMEOUT_S + 5, "/health 503 on a stalled core")
        assert took >= STEP_TIMEOUT_S / 2  # not at once: the core spoke a heartbeat or so before it stopped
        r = health(url)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stalled", r.text
        m = httpx.get(f"{url}/metrics", timeout=10)  # a scrape does not hang on a wedged core
        assert m.status_code == 503 and m.json()["error"]["code"] == "engine_stalled", m.text
        assert not done
    finally:
        os.kill(core, signal.SIGCONT)
    wait_for(lambda: health(url).status_code == 200, 10, "/health 200 once the core steps again")
    waiting.join(30)
    assert done and done[0].status_code == 200, done


def test_disconnect_aborts_the_request_in_the_core(restarting: ServerProcess) -> None:
    url = restarting.url
    finished = "spanserve_engine_requests_finished_total"  # by the core; an abort does not count
    before = httpx.get(f"{url}/metrics").text
    with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")

    def idle() -> bool:
        text = httpx.get(f"{url}/metrics").text
        return (metric(text, "spanserve_requests_running") == 0
                and metric(text, "spanserve_kv_blocks_free") == metric(text, "spanserve_kv_blocks_total"))

    wait_for(idle, 10, "the core idle after the client left")
    after = httpx.get(f"{url}/metrics").text
    aborted = 'spanserve_requests_finished_total{reason="abort"}'
    assert metric(after, aborted) == (metric(before, aborted) if aborted in before else 0) + 1
    assert metric(after, finished) == metric(before, finished)  # the core never ran it to its length


def test_restart_engine_serves_again_and_the_core_outlives_no_server(restarting: ServerProcess) -> None:
    url = restarting.url
    rest = stream_until_core_killed(url, core_pid(restarting))
    assert_ended_with_error(rest)
    wait_for(lambda: health(url).status_code == 503, 5, "/health 503 while the core is down")
    # the new core takes seconds to start (a fresh interpreter, the model): requests wait for it
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
    assert "engine core" in r.json()["error"]["message"]
    wait_for(lambda: health(url).status_code == 200, 120, "a new core")
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                                  "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert restarting.proc.poll() is None

    # A core whose server is killed outright (no shutdown) stops by itself.
    core = core_pid(restarting)
    os.kill(restarting.proc.pid, signal.SIGKILL)
    restarting.proc.wait()
    wait_for(lambda: not Path(f"/proc/{core}").exists() or _zombie(core), EXIT_S, "the orphaned core to stop")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_for_both(url: str) -> dict[str, int]:
    """Completions until both API servers have answered: how many each answered."""
    servers: dict[str, int] = {}

    def complete() -> None:
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3,
                                                      "ignore_eos": True}, timeout=30)
        assert r.status_code == 200, r.text
        name = r.headers["x-spanserve-api-server"]
        servers[name] = servers.get(name, 0) + 1

    wait_for(lambda: complete() or len(servers) == 2, 60, "answers from both API servers")
    return servers


def test_api_servers_share_the_port_and_the_core(tiny: Path) -> None:
    with run_server(str(tiny), tiny.parent, *SERVE, "--api-server-count", "2") as srv:
        servers = wait_for_both(srv.url)
        sent = sum(servers.values())
        core_counts, own = {}, {}
        while len(core_counts) < 2:  # each server's page: the core's count, and its own
            r = httpx.get(f"{srv.url}/metrics")
            name = r.headers["x-spanserve-api-server"]
            core_counts[name] = metric(r.text, "spanserve_engine_requests_finished_total")
            own[name] = metric(r.text, 'spanserve_requests_finished_total{reason="length"}')
        assert set(core_counts.values()) == {sent}, (core_counts, servers)
        assert own == {k: float(v) for k, v in servers.items()}

        core = core_pid(srv)
        (api,) = set(spawned_children(srv.proc.pid)) - {core}
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        code = srv.proc.wait(timeout=EXIT_S + 10)
        assert time.monotonic() - killed < EXIT_S and code != 0, (code, srv.log_text())
        assert not Path(f"/proc/{api}").exists()
        assert "API server 1 exited with code 1" in srv.log_text(), srv.log_text()


def test_a_dead_api_server_stops_the_others_and_the_core(tiny: Path) -> None:
    with run_server(str(tiny), tiny.parent, *SERVE, "--api-server-count", "2") as srv:
        wait_for_both(srv.url)
        core = core_pid(srv)
        (api,) = set(spawned_children(srv.proc.pid)) - {core}
        os.kill(api, signal.SIGKILL)
        killed = time.monotonic()
        code = srv.proc.wait(timeout=EXIT_S + 10)
        assert time.monotonic() - killed < EXIT_S and code != 0, (code, srv.log_text())
        assert not Path(f"/proc/{core}").exists()
        assert "API server 1 exited unexpectedly (exit code -9)" in srv.log_text(), srv.log_text()
