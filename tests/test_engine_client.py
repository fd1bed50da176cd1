"""The engine client over a core on a thread of this process: streaming, errors before streaming,
cancellation frees blocks, capacity."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from spanserve import LLM, SamplingParams
from spanserve.engine.client import EngineClient, EngineDeadError, EngineOverloaded, RequestSpec
from spanserve.engine.inproc import inproc_client
from engine_helpers import make_engine
from test_server_harness import build_tiny_model

T = TypeVar("T")
PROMPT = "The quick brown fox jumps over the lazy dog."
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-async") / "tiny")


def run(tiny: Path, body: Callable[[EngineClient], Awaitable[T]], **kw: object) -> T:
    """Run body against a fresh, started client and shut it down afterwards."""
    engine = make_engine(str(tiny), num_blocks=NUM_BLOCKS, block_size=8)

    async def main() -> T:
        aeng = inproc_client(engine, **kw)  # type: ignore[arg-type]
        aeng.start()
        try:
            return await body(aeng)
        finally:
            await aeng.shutdown()

    return asyncio.run(main())


async def settled_free(aeng: EngineClient) -> int:
    """Free blocks once the engine has no work left (aborts are processed between steps)."""
    for _ in range(200):
        stats = await aeng.call("stats")
        if not stats["running"] and not stats["waiting"]:
            return stats["blocks_free"]
        await asyncio.sleep(0.01)
    raise AssertionError("engine still busy")


def test_generate_streams_progress_and_matches_offline(tiny: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)

    async def body(aeng: EngineClient) -> list[list[int]]:
        return [list(o.token_ids) async for o in aeng.generate(PROMPT, params, "r1")]

    seen = run(tiny, body)
    assert [len(t) for t in seen] == sorted(len(t) for t in seen)  # cumulative, never shrinking
    assert len(seen[-1]) == 12
    offline = LLM(str(tiny), num_blocks=NUM_BLOCKS, block_size=8).generate(PROMPT, params)[0]
    assert seen[-1] == offline.token_ids


def test_value_error_surfaces_before_streaming_and_batch_is_all_or_nothing(tiny: Path) -> None:
    ok = SamplingParams(max_tokens=4)

    async def body(aeng: EngineClient) -> int:
        with pytest.raises(ValueError, match="empty"):
            async for _ in aeng.generate([], ok, "empty"):
                raise AssertionError("no output may come before the error")
        with pytest.raises(ValueError, match="out of range"):
            await aeng.add_requests([RequestSpec(PROMPT, ok, "good"), RequestSpec([10**9], ok, "bad")])
        # The good one was rolled back, so its id is free again and no work is left.
        assert aeng.num_pending == 0  # nothing was sent to the engine
        (stream,) = await aeng.add_requests([RequestSpec(PROMPT, ok, "good")])
        assert [o async for o in stream][-1].finished
        return await settled_free(aeng)

    assert run(tiny, body) == NUM_BLOCKS


def test_closing_the_consumer_aborts_and_frees_blocks(tiny: Path) -> None:
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def body(aeng: EngineClient) -> tuple[int, int]:
        gen = aeng.generate(PROMPT * 3, long, "closed")
        first = await gen.__anext__()
        assert not first.finished
        assert (await aeng.call("stats"))["blocks_free"] < NUM_BLOCKS
        await gen.aclose()
        after_close = await settled_free(aeng)

        async def consume() -> None:
            async for _ in aeng.generate(PROMPT * 3, long, "cancelled"):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return after_close, await settled_free(aeng)

    assert run(tiny, body) == (NUM_BLOCKS, NUM_BLOCKS)


def test_capacity_limit_raises_overloaded(tiny: Path) -> None:
    params = SamplingParams(max_tokens=50, ignore_eos=True)

    async def body(aeng: EngineClient) -> int:
        streams = await aeng.add_requests([RequestSpec(PROMPT, params, f"r{i}") for i in range(2)])
        with pytest.raises(EngineOverloaded):
            await aeng.add_requests([RequestSpec(PROMPT, params, "r2")])
        for s in streams:
            s.abort()
        await settled_free(aeng)
        assert aeng.num_pending == 0
        (s,) = await aeng.add_requests([RequestSpec(PROMPT, params, "r3")])  # room again
        s.abort()
        return await settled_free(aeng)

    assert run(tiny, body, max_pending=2) == NUM_BLOCKS


def test_many_concurrent_consumers_all_finish(tiny: Path) -> None:
    async def one(aeng: EngineClient, i: int) -> int:
        outs = [o async for o in aeng.generate(f"{PROMPT} {i}", SamplingParams(max_tokens=8 + i, ignore_eos=True),
                                               f"c{i}")]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        return len(outs[-1].token_ids)

    async def body(aeng: EngineClient) -> list[int]:
        return list(await asyncio.gather(*(one(aeng, i) for i in range(16))))

    assert run(tiny, body) == [8 + i for i in range(16)]


def test_calls_after_shutdown_fail_cleanly(tiny: Path) -> None:
    async def body(aeng: EngineClient) -> None:
        await aeng.shutdown()
        assert not aeng.is_alive
        with pytest.raises(EngineDeadError):
            await aeng.add_requests([RequestSpec(PROMPT, SamplingParams(), "late")])

    run(tiny, body)
