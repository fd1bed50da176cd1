"""Decode steps chained on the device (the next step launched before the host sees this one's
picks) give exactly the tokens, texts and finish reasons of steps taken one at a time, through
stops, aborts, requests that cannot chain, and new arrivals; no block is leaked. Run through the
fixed-buffer decode path without capture (Triton's interpreter)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from spanserve.attention.triton import LaunchConfig, TritonBackend  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.engine.layout import Segment  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.worker.host_tokens import HostTokens  # noqa: E402
from engine_helpers import make_engine  # noqa: E402

SMALL = LaunchConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
N_BLOCKS = 96


def _engine(path, overlap: bool) -> LLMEngine:
    eng = make_engine(str(path), block_size=8, num_blocks=N_BLOCKS, backend=TritonBackend(SMALL),
                      cuda_graphs="eager", overlap=overlap)
    assert eng.overlap is overlap
    return eng


def _requests(gen: torch.Generator) -> list[tuple[object, SamplingParams]]:
    t = lambda n: torch.randint(3, 300, (n,), generator=gen).tolist()  # noqa: E731
    doc = t(21)
    return [
        (t(13), SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)),
        (t(9), SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)),
        ([Segment(token_ids=t(4)), Segment(token_ids=doc, kind="plus"), Segment(token_ids=t(6))],
         SamplingParams(max_tokens=11, temperature=0.7, top_k=20, seed=3, ignore_eos=True)),
        (t(7), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)),
        (t(17), SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True, logprobs=2)),
        (t(11), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.3)),
    ]


def _drive(eng: LLMEngine, reqs: list, late: list, abort_at: int | None = None) -> dict:
    """All of `reqs` at once, `late` after a few steps; the first request aborted at `abort_at`."""
    handles = [eng.add_request(p, s) for p, s in reqs]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 4:
            handles += [eng.add_request(p, s) for p, s in late]
        if steps == abort_at:
            eng.abort(handles[0].request_id)
    return {h.request_id: (h.output_token_ids, h.text, h.finish_reason, h.stop_reason, h.logprobs) for h in handles}


def test_chained_decode_matches_steps_one_at_a_time(tmp_path) -> None:
    """Tokens, texts, finish and stop reasons and logprobs; a request with penalties cannot chain
    (its batch takes steps one at a time until it finishes)."""
    path, _ = make_tiny_model("llama", tmp_path)
    gen = torch.Generator().manual_seed(0)
    reqs = _requests(gen)
    late = [(torch.randint(3, 300, (10,), generator=gen).tolist(), SamplingParams(max_tokens=6, temperature=0))]
    plain, chained = _engine(path, False), _engine(path, True)
    solo = []
    for eng in (plain, chained):  # alone (chains from its second token), then the mixed batch
        solo.append(eng.add_request(reqs[0][0], reqs[0][1]))
        while eng.has_unfinished():
            eng.step()
    assert solo[1].output_token_ids == solo[0].output_token_ids and chained.chained_steps == 12
    fetched: list[list[list]] = []  # what chained steps brought to the host: picks, then logprob tensors
    fetch = chained.executor.fetch
    chained.executor.fetch = lambda picks: fetched.append(fetch(picks)) or fetched[-1]
    want, got = _drive(plain, reqs, late), _drive(chained, reqs, late)
    assert got == want
    assert chained.chained_steps > 12 + 3 and plain.chained_steps == 0
    assert any(len(lists) > 1 for lists in fetched)  # logprobs came through chained steps
    assert chained.pool.num_free == plain.pool.num_free == N_BLOCKS  # nothing held after the end


def test_stops_and_aborts_while_a_step_is_in_flight(tmp_path) -> None:
    path, _ = make_tiny_model("llama", tmp_path, seed=1)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 300, (12,), generator=gen).tolist()
    probe = _engine(path, False)
    seen = probe.add_request(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    while probe.has_unfinished():
        probe.step()
    stop_tok = seen.output_token_ids[5]  # a pick in the middle ends it: the step after it is wasted
    first = seen.output_token_ids.index(stop_tok)
    text = probe.tokenizer.decode(seen.output_token_ids[first + 1:first + 3])
    reqs = [
        (prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok])),
        (prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=[text] if text.strip() else [])),
        (torch.randint(3, 300, (20,), generator=gen).tolist(), SamplingParams(max_tokens=15, temperature=0)),
    ]
    for abort_at in (None, 3, 6):
        plain, chained = _engine(path, False), _engine(path, True)
        want, got = _drive(plain, reqs, [], abort_at), _drive(chained, reqs, [], abort_at)
        first = next(iter(want))
        if abort_at:  # aborted with its pick in flight: that token is dropped, nothing else differs
            (w, _, w_reason, _, _), (g, _, g_reason, _, _) = want.pop(first), got.pop(first)
            assert (g, g_reason) == (w, w_reason) or (g_reason == "abort" and g == w[:len(g)] and len(g) >= len(w) - 1)
        assert got == want, abort_at
        assert abort_at or want[first][2] == "stop"
        assert chained.pool.num_free == N_BLOCKS and not chained.has_unfinished()


def test_host_tokens_pick_rows_in_order() -> None:
    picks = HostTokens(torch.tensor([5, 6, 7]), torch.tensor([[1.5], [2.5], [3.5]]))
    assert picks.lists() == [[5, 6, 7], [[1.5], [2.5], [3.5]]]
    assert picks.rows([0, 1, 2]) is picks.device_ids
    assert picks.rows([2, 0]).tolist() == [7, 5]


def test_chained_decode_under_tensor_parallelism(tmp_path) -> None:
    """TP=2 (gloo): the driver broadcasts its picks into every rank's input buffer; the tokens are
    those of TP=1 taking its steps one at a time."""
    path, _ = make_tiny_model("llama", tmp_path, seed=2)
    gen = torch.Generator().manual_seed(2)
    reqs = [(torch.randint(3, 300, (n,), generator=gen).tolist(),
             SamplingParams(max_tokens=m, temperature=t, seed=5, ignore_eos=True))
            for n, m, t in ((9, 10, 0.0), (14, 7, 0.8), (5, 12, 0.0))]
    plain = _engine(path, False)
    two = make_engine(str(path), block_size=8, num_blocks=N_BLOCKS, backend=TritonBackend(SMALL),
                      cuda_graphs="eager", overlap=True, tensor_parallel_size=2)
    try:
        want = _drive(plain, reqs, [], abort_at=5)
        got = _drive(two, reqs, [], abort_at=5)
        first = next(iter(want))
        (w, *_), (g, *_) = want.pop(first), got.pop(first)
        assert g == w[:len(g)] and len(g) >= len(w) - 1  # aborted with a pick in flight, or not
        assert got == want and two.chained_steps >= 5
        assert two.pool.num_free == N_BLOCKS
    finally:
        two.shutdown()


def test_streams_through_the_engine_client(tmp_path) -> None:
    """The server's engine loop: streams see every token once, in order, the same as offline
    steps one at a time; a consumer that walks away mid-stream frees its blocks."""
    import asyncio

    from spanserve.engine.inproc import inproc_client

    path, _ = make_tiny_model("llama", tmp_path, seed=3)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (8, 15)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    plain = _engine(path, False)
    want = [_drive(plain, [(p, params)], [])["req-%d" % i][0] for i, p in enumerate(prompts)]
    chained = _engine(path, True)

    async def main() -> tuple[list[list[list[int]]], int]:
        aeng = inproc_client(chained)
        aeng.start()
        try:
            async def stream(i: int, stop_after: int | None) -> list[list[int]]:
                seen = []
                async for o in aeng.generate(prompts[i], params, f"s{i}-{stop_after}"):
                    seen.append(list(o.token_ids))
                    if stop_after is not None and len(seen) == stop_after:
                        break  # the consumer leaves: the request is aborted
                return seen

            streams = await asyncio.gather(stream(0, None), stream(1, None), stream(0, 4))
            for _ in range(200):
                stats = await aeng.call("stats")
                if not stats["running"] and not stats["waiting"]:
                    return streams, stats["blocks_free"]
                await asyncio.sleep(0.01)
            raise AssertionError("engine still busy")
        finally:
            await aeng.shutdown()

    (full0, full1, cut), free = asyncio.run(main())
    assert full0[-1] == want[0] and full1[-1] == want[1]
    for s in (full0, full1, cut):
        assert all(b[:len(a)] == a and len(b) > len(a) for a, b in zip(s, s[1:]))  # cumulative, growing
    assert cut[-1] == want[0][:len(cut[-1])]
    assert free == N_BLOCKS and chained.chained_steps > 5
