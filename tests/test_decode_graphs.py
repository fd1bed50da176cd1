"""Decode steps through fixed-address buffers (the CUDA-graph path, run here without capture
through Triton's interpreter) give the same tokens as the eager reference backend."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from spanserve.attention.reference import ReferenceBackend  # noqa: E402
from spanserve.attention.triton import LaunchConfig, TritonBackend  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.engine.layout import Segment  # noqa: E402
from spanserve.engine.sampling import SamplingParams  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

SMALL = LaunchConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def _prompts(gen: torch.Generator, vocab: int) -> list:
    t = lambda n: torch.randint(3, vocab, (n,), generator=gen).tolist()  # noqa: E731
    doc = t(29)
    return [
        t(23),
        [Segment(token_ids=t(6)), Segment(token_ids=doc, kind="plus"), Segment(token_ids=t(17), kind="plus"),
         Segment(token_ids=t(5))],
        [Segment(token_ids=t(4)), Segment(token_ids=t(11), kind="plus"), Segment(token_ids=doc, kind="plus"),
         Segment(token_ids=t(3))],
        t(9),
    ]


def _run(engine: LLMEngine, prompts: list) -> list[list[int]]:
    reqs = [engine.add_request(p, SamplingParams(max_tokens=6 + 5 * i, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)]  # different lengths: the batch shrinks as they finish
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


def test_fixed_buffer_decode_matches_eager_reference(tmp_path) -> None:
    path, _ = make_tiny_model("llama", tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = _prompts(gen, 384)
    ref = LLMEngine(str(path), block_size=8, num_blocks=128, backend=ReferenceBackend())
    fixed = LLMEngine(str(path), block_size=8, num_blocks=128, backend=TritonBackend(SMALL, SMALL), cuda_graphs="eager")
    graphs = fixed.runner.graphs
    assert graphs is not None and not graphs.capture
    graphs.capacity = 64  # small, so the buffers must grow while the rows get longer
    want = _run(ref, prompts)
    assert _run(fixed, prompts) == want
    assert graphs.replays >= 20  # every decode-only step took the fixed-buffer path
    assert sorted(graphs.buffers) == [1, 2, 3, 4]  # one set of buffers per batch size seen
    assert graphs.buffers[4].static.capacity > 64
    # warm: the documents come back from the cache at new positions (non-zero deltas in decode)
    assert _run(fixed, prompts[::-1]) == _run(ref, prompts[::-1])


def test_eager_engine_has_no_graphs_on_cpu(tmp_path) -> None:
    path, _ = make_tiny_model("llama", tmp_path)
    assert LLMEngine(str(path), num_blocks=32, backend=TritonBackend()).runner.graphs is None
    assert LLMEngine(str(path), num_blocks=32, backend=TritonBackend(), cuda_graphs=False).runner.graphs is None
