"""Load: 32 concurrent streaming clients for SPANSERVE_LOAD_SECONDS (default 15), a third of them
hanging up at random points. The others must see no errors, and once everyone is gone every KV
block must be free again (aborts and preemptions included: the pool is sized to preempt)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from test_server_harness import ServerProcess, build_tiny_model, metric, run_server

LOAD_SECONDS = float(os.environ.get("SPANSERVE_LOAD_SECONDS", "15"))
CLIENTS = 32
SHARED = "The capital of France is Paris, and the capital of Italy is Rome. "


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("load")
    path = build_tiny_model(root / "tiny")
    # 128 blocks of 8 tokens: less than 32 clients at full length need, so preemption happens.
    with run_server(str(path), root, "--kv-cache-memory", "512KiB", "--block-size", "8",
                    "--served-model-name", "tiny", "--log-level", "warning") as srv:
        yield srv


@dataclass
class Stats:
    completed: int = 0
    disconnected: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def body_for(rng: random.Random, i: int, n: int) -> tuple[str, dict[str, object], int]:
    max_tokens = rng.randint(8, 64)
    common: dict[str, object] = {"model": "tiny", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                                 "stream_options": {"include_usage": True}, "seed": rng.randrange(2**31)}
    text = SHARED * rng.randint(0, 3) + f"client {i} request {n}: the quick brown fox"
    if rng.random() < 0.5:
        return "/v1/completions", {**common, "prompt": text}, max_tokens
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}, max_tokens


async def one_client(url: str, i: int, deadline: float, stats: Stats) -> None:
    rng = random.Random(i)
    hangs_up = i % 3 == 0
    n = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.monotonic() < deadline:
            n += 1
            route, body, max_tokens = body_for(rng, i, n)
            cut = rng.randint(1, 12) if hangs_up else None
            start = time.monotonic()
            events, usage, done, first = 0, None, False, None
            try:
                async with http.stream("POST", route, json=body) as r:
                    if r.status_code != 200:
                        stats.errors.append(f"{route} -> {r.status_code}: {(await r.aread())[:200]!r}")
                        continue
                    async for line in r.aiter_lines():
                        if not line:
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        obj = json.loads(line[len("data: "):])
                        if "error" in obj:
                            stats.errors.append(f"{route}: error event {obj}")
                            break
                        if first is None:
                            first = time.monotonic() - start
                        usage = obj.get("usage") or usage
                        events += 1
                        if cut is not None and events >= cut:
                            break  # leaving the block closes the connection mid-stream
            except httpx.HTTPError as e:
                stats.errors.append(f"{route}: {type(e).__name__}: {e}")
                continue
            if cut is not None and not done:
                stats.disconnected += 1
                continue
            if not done or usage is None:
                stats.errors.append(f"{route}: stream ended without [DONE] or usage")
                continue
            if usage["completion_tokens"] != max_tokens:
                stats.errors.append(f"{route}: {usage['completion_tokens']} tokens, wanted {max_tokens}")
            stats.completed += 1
            stats.tokens += usage["completion_tokens"]
            if first is not None:
                stats.ttft.append(first)


def test_concurrent_streams_with_disconnects(server: ServerProcess) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    free_before = metric(before, "spanserve_kv_blocks_free")
    assert free_before == metric(before, "spanserve_kv_blocks_total")
    stats = Stats()
    start = time.monotonic()

    async def main() -> None:
        deadline = time.monotonic() + LOAD_SECONDS
        await asyncio.gather(*(one_client(server.url, i, deadline, stats) for i in range(CLIENTS)))

    asyncio.run(main())
    elapsed = time.monotonic() - start

    settle = time.monotonic() + 15
    while True:
        after = httpx.get(f"{server.url}/metrics").text
        idle = metric(after, "spanserve_requests_running") == 0 and metric(after, "spanserve_requests_waiting") == 0
        if idle and metric(after, "spanserve_kv_blocks_free") == free_before:
            break
        assert time.monotonic() < settle, f"blocks not returned:\n{after}"
        time.sleep(0.1)

    ttft = sorted(stats.ttft) or [0.0]
    print(f"\nload: {LOAD_SECONDS:.0f} s target, {elapsed:.1f} s run, {CLIENTS} clients; "
          f"{stats.completed} completed, {stats.disconnected} disconnected, {len(stats.errors)} errors; "
          f"{stats.tokens} tokens streamed ({stats.tokens / elapsed:.0f} tok/s to completing clients); "
          f"TTFT p50 {statistics.median(ttft) * 1000:.0f} ms, p95 {ttft[int(0.95 * (len(ttft) - 1))] * 1000:.0f} ms; "
          f"preemptions {metric(after, 'spanserve_preemptions_total'):.0f}; "
          f"blocks free {metric(after, 'spanserve_kv_blocks_free'):.0f}/{metric(after, 'spanserve_kv_blocks_total'):.0f}")
    assert not stats.errors, stats.errors[:10]
    assert stats.completed > 0 and stats.disconnected > 0
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert "Traceback" not in server.log_text()
