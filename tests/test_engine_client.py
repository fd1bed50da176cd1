"""The engine client over both transports, a core on a thread of this process and a core in a
process of its own (one per module, which every test's client joins as a client of its own):
streaming, errors before streaming, cancellation and aborts free blocks, capacity. Then what the
process boundary adds: a core that dies or never starts, calls that time out, messages it cannot
read, and bursts no queue may drop."""
from __future__ import annotations

import asyncio
import functools
import itertools
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
import zmq

from spanserve import LLM, SamplingParams
from spanserve.engine.client import EngineClient, EngineDeadError, EngineOverloaded, EngineTimeout, RequestSpec
from spanserve.engine.config import EngineConfig
from spanserve.engine.core_process import CoreProcess
from spanserve.engine.engine import LLMEngine
from spanserve.engine.inproc import inproc_client
from spanserve.engine.layout import Segment
from spanserve.engine.prepare import Prepared
from spanserve.engine.wire import ENCODER, Add, Call
from spanserve.model.loader import load_tokenizer
from engine_helpers import make_engine
from test_server_harness import build_tiny_model

T = TypeVar("T")
PROMPT = "The quick brown fox jumps over the lazy dog."
NUM_BLOCKS = 64
ENGINE = dict(num_blocks=NUM_BLOCKS, block_size=8)
Connect = Callable[..., EngineClient]  # a new, unstarted client; keywords go to EngineClient
_client_ids = itertools.count(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-async") / "tiny")


def core_factory(tiny: Path) -> Callable[[], LLMEngine]:
    """What a core process builds: the engine make_engine builds here, as a picklable factory."""
    return functools.partial(LLMEngine, EngineConfig.from_kwargs(model=str(tiny), device="cpu", dtype="float32",
                                                                 **ENGINE))


@pytest.fixture(scope="module")
def core(tiny: Path) -> Iterator[CoreProcess]:
    core = CoreProcess.launch(core_factory(tiny), "warning")
    try:
        yield core
    finally:
        os.kill(core.pid, signal.SIGCONT)  # a test may have stopped it
        assert core.stop() == 0  # SIGTERM: a clean stop


@pytest.fixture(params=["thread", "process"])
def connect(request: pytest.FixtureRequest, tiny: Path) -> Connect:
    if request.param == "thread":
        return lambda **kw: inproc_client(make_engine(str(tiny), **ENGINE), **kw)
    core: CoreProcess = request.getfixturevalue("core")
    tokenizer = load_tokenizer(str(tiny))
    return lambda **kw: core.client(tokenizer, next(_client_ids), **kw)


def run(connect: Connect, body: Callable[[EngineClient], Awaitable[T]], **kw: Any) -> T:
    """Run body against a fresh, started client and shut it down afterwards."""
    async def main() -> T:
        aeng = connect(**kw)
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


def test_generate_streams_progress_and_matches_offline(connect: Connect, tiny: Path) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)

    async def body(aeng: EngineClient) -> list[list[int]]:
        return [list(o.token_ids) async for o in aeng.generate(PROMPT, params, "r1")]

    seen = run(connect, body)
    assert [len(t) for t in seen] == sorted(len(t) for t in seen)  # cumulative, never shrinking
    assert len(seen[-1]) == 12
    offline = LLM(str(tiny), **ENGINE).generate(PROMPT, params)[0]
    assert seen[-1] == offline.token_ids


@pytest.mark.parametrize("policy", ["none", "cacheblend"])
def test_span_layout_matches_offline(connect: Connect, tiny: Path, policy: str) -> None:
    """A span layout (plus segments, an anchor, a policy) crosses to the core as it is: cold and
    then warm, tokens and logprobs equal the offline engine's, which the dense oracle checks
    (test_span_layouts.py)."""
    docs = ["All that glitters is not gold.", "A journey of a thousand miles begins with a single step."]
    layout = [Segment(text="Compare:", kind="cross")] + [Segment(text=d, kind="plus", anchor="prefix") for d in docs]
    layout.append(Segment(text=" Which one is wiser?"))
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
    salt = f"layout-{policy}-{next(_client_ids)}"  # cold in a core other tests share

    async def body(aeng: EngineClient) -> list[Any]:
        outs = []
        for i in range(2):
            (stream,) = await aeng.add_requests([RequestSpec(layout, params, f"layout-{i}", salt, policy)])
            outs.append([o async for o in stream][-1])
        return outs

    cold, warm = run(connect, body)
    offline = LLM(str(tiny), **ENGINE).generate(layout, params, policy=policy)[0]
    assert warm.metrics["reuse"]["computed"] < cold.metrics["reuse"]["computed"] == len(cold.prompt_token_ids)
    for served in (cold, warm):
        assert served.token_ids == offline.token_ids
        for a, b in zip(served.logprobs, offline.logprobs, strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top.keys() == b.top.keys()


def test_value_error_surfaces_before_streaming_and_batch_is_all_or_nothing(connect: Connect) -> None:
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

    assert run(connect, body) == NUM_BLOCKS


def test_closing_the_consumer_aborts_and_frees_blocks(connect: Connect) -> None:
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

    assert run(connect, body) == (NUM_BLOCKS, NUM_BLOCKS)


def test_abort_takes_effect_before_the_next_step(connect: Connect) -> None:
    """The core reads its inputs in the order sent: a call sent right after an abort finds the
    request gone and its blocks free. (How many steps ran between the earlier stats call and the
    abort depends on how fast the client's loop is, so it is not asserted.)"""
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def body(aeng: EngineClient) -> tuple[dict[str, Any], dict[str, Any]]:
        (stream,) = await aeng.add_requests([RequestSpec(PROMPT * 3, long, "aborted")])
        async for out in stream:
            if len(out.token_ids) >= 2:
                break
        before = await aeng.call("stats")
        stream.abort()
        return before, await aeng.call("stats")

    before, after = run(connect, body)
    assert before["running"] == 1 and before["blocks_free"] < NUM_BLOCKS
    assert after["running"] == after["waiting"] == 0 and after["blocks_free"] == NUM_BLOCKS
    assert after["steps"] >= before["steps"]


def test_capacity_limit_raises_overloaded(connect: Connect) -> None:
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

    assert run(connect, body, max_pending=2) == NUM_BLOCKS


def test_many_concurrent_consumers_all_finish(connect: Connect) -> None:
    async def one(aeng: EngineClient, i: int) -> int:
        outs = [o async for o in aeng.generate(f"{PROMPT} {i}", SamplingParams(max_tokens=8 + i, ignore_eos=True),
                                               f"c{i}")]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        return len(outs[-1].token_ids)

    async def body(aeng: EngineClient) -> list[int]:
        return list(await asyncio.gather(*(one(aeng, i) for i in range(16))))

    assert run(connect, body) == [8 + i for i in range(16)]


def test_calls_after_shutdown_fail_cleanly(connect: Connect) -> None:
    async def body(aeng: EngineClient) -> None:
        await aeng.shutdown()
        assert not aeng.is_alive
        with pytest.raises(EngineDeadError):
            await aeng.add_requests([RequestSpec(PROMPT, SamplingParams(), "late")])
        with pytest.raises(EngineDeadError):
            await aeng.call("stats")

    run(connect, body)


# ---------------------------------------------------------------------------- the process boundary


def process_run(core: CoreProcess, body: Callable[[EngineClient], Awaitable[T]], tokenizer: Any = None) -> T:
    return run(lambda: core.client(tokenizer, next(_client_ids)), body)


def test_a_call_times_out_on_a_stopped_core_and_leaks_nothing(core: CoreProcess) -> None:
    async def body(aeng: EngineClient) -> None:
        os.kill(core.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(EngineTimeout, match="'stats'"):
                await aeng.call("stats", timeout=0.3)
            assert 0.3 <= time.monotonic() - t0 < 5
            waiting = asyncio.create_task(aeng.call("stats"))  # cancelled, as a request handler can be
            await asyncio.sleep(0.1)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert not aeng._calls  # nothing left for a late answer to resolve
        finally:
            os.kill(core.pid, signal.SIGCONT)
        assert (await aeng.call("stats", timeout=30))["blocks_total"] == NUM_BLOCKS
        assert not aeng._calls

    process_run(core, body)


def test_no_output_is_dropped_while_the_client_does_not_read(core: CoreProcess) -> None:
    """ZeroMQ drops what a ROUTER cannot queue for a peer beyond its high-water mark: a client
    whose loop is busy for a while must still get every answer (and every delta)."""
    n = 5000

    async def body(aeng: EngineClient) -> int:
        calls = [asyncio.ensure_future(aeng.call("info")) for _ in range(n)]
        await asyncio.sleep(0)  # every call sent
        time.sleep(1.0)  # noqa: ASYNC251 - on purpose: the loop reads nothing meanwhile
        done, _ = await asyncio.wait(calls, timeout=60)
        return len(done)

    assert process_run(core, body) == n


def test_the_core_survives_messages_it_cannot_take(core: CoreProcess, tiny: Path) -> None:
    """A client's bug is the client's: what the core cannot decode is dropped; what it cannot
    queue or call is refused to the client that sent it; the core serves on."""
    bad_grammar = Prepared("bad-grammar", [5, 6, 7], [], SamplingParams(max_tokens=2), grammar="not a grammar")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"client-999")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(core.address)
    try:
        for junk in (b"", b"\xff\x00garbage", msgspec.msgpack.encode({"type": "nope"}),
                     msgspec.msgpack.encode({"type": "add", "requests": [{"request_id": 5}]}),
                     ENCODER.encode(Call(1, "no-such-call", [], 999)), ENCODER.encode(Call(2, "stats", [1, 2], 999)),
                     ENCODER.encode(Add([bad_grammar], 999))):
            sock.send(junk)
        answers = [msgspec.msgpack.decode(sock.recv()) for _ in range(3) if sock.poll(30_000)]
    finally:
        sock.close()
    replies = {a["call_id"]: a for a in answers if a["type"] == "reply"}
    assert "no call 'no-such-call'" in replies[1]["error"]
    assert replies[2]["error"]  # stats takes no arguments
    (refused,) = next(a for a in answers if a["type"] == "step")["deltas"]
    assert refused["request_id"] == "bad-grammar" and refused["finish_reason"] == "abort" and refused["error"]

    async def body(aeng: EngineClient) -> list[int]:
        out = [o async for o in aeng.generate(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True), "after")][-1]
        assert (await settled_free(aeng)) == NUM_BLOCKS
        return list(out.token_ids)

    assert len(process_run(core, body, load_tokenizer(str(tiny)))) == 3
    assert core.process.is_alive()


def test_core_death_fails_streams_calls_and_requests_waiting_on_a_grammar(tiny: Path) -> None:
    """A core that dies mid-stream, with a call pending and a request whose grammar is still
    compiling: each ends with EngineDeadError, nothing is left pending, nothing hangs."""
    core = CoreProcess.launch(core_factory(tiny), "warning")

    async def compile_then_kill(_fmt: dict) -> str:
        os.kill(core.pid, signal.SIGKILL)
        while aeng.is_alive:
            await asyncio.sleep(0.01)
        return "{}"

    aeng = core.client(load_tokenizer(str(tiny)), owner=True, compile_grammar=compile_then_kill)

    async def body() -> None:
        aeng.start()
        (stream,) = await aeng.add_requests([RequestSpec(PROMPT, SamplingParams(max_tokens=400, ignore_eos=True),
                                                         "long")])
        assert not (await stream.__anext__()).finished
        os.kill(core.pid, signal.SIGSTOP)  # the call below stays unanswered until the core is gone
        call = asyncio.create_task(aeng.call("stats"))
        await asyncio.sleep(0.05)
        structured = SamplingParams(max_tokens=4, response_format={"type": "json_object"})
        with pytest.raises(EngineDeadError, match="exit code -9"):
            await aeng.add_requests([RequestSpec(PROMPT, structured, "structured")])
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await call
        assert aeng.num_pending == 0 and not aeng._calls
        with pytest.raises(EngineDeadError):
            await aeng.add_requests([RequestSpec(PROMPT, SamplingParams(), "later")])
        await aeng.shutdown()

    try:
        asyncio.run(asyncio.wait_for(body(), 60))
    finally:
        code = core.stop()
    assert code == -signal.SIGKILL


def test_a_core_that_fails_to_start_says_why(tmp_path: Path) -> None:
    missing = tmp_path / "no-model"
    with pytest.raises(ValueError, match="failed to start.*no-model"):
        CoreProcess.launch(functools.partial(LLMEngine, EngineConfig.from_kwargs(model=str(missing))), "critical")
    with pytest.raises(ValueError, match=r"exited while starting \(exit code 3\)"):
        CoreProcess.launch(functools.partial(os._exit, 3), "critical")
