"""Decode steps through fixed-address buffers (the CUDA-graph path, run here without capture
through Triton's interpreter) give the same tokens as the eager reference backend and as the eager
general Triton path; the packed layout a decode step sends equals the general layout."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from spanserve.attention.reference import ReferenceBackend  # noqa: E402
from spanserve.attention.triton import LaunchConfig, TritonBackend  # noqa: E402
from spanserve.attention.triton.graph_decode import StaticDecode  # noqa: E402
from spanserve.attention.triton.launch import build_layout  # noqa: E402
from spanserve.attention.triton.split import SplitPolicy  # noqa: E402
from spanserve.cache.claim import Task  # noqa: E402
from spanserve.cache.table import Entry  # noqa: E402
from spanserve.attention.decode import DecodeRows  # noqa: E402
from spanserve.attention.plan import Repair  # noqa: E402
from spanserve.reuse.policies import Policy  # noqa: E402
from spanserve.engine.batch import decode_rows, host_plan  # noqa: E402
from spanserve.engine.engine import LLMEngine  # noqa: E402
from spanserve.engine.layout import Segment  # noqa: E402
from spanserve.engine.params import SamplingParams  # noqa: E402
from spanserve.engine.scheduler import Chunk  # noqa: E402
from spanserve.worker.runner import device_plan  # noqa: E402
from engine_helpers import make_engine  # noqa: E402

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


def _run(engine: LLMEngine, prompts: list, policy=None) -> list[list[int]]:
    # 3, 5, 7, 9 tokens: the batch shrinks as they finish, two decode steps at each size
    reqs = [engine.add_request(p, SamplingParams(max_tokens=3 + 2 * i, temperature=0, ignore_eos=True), policy=policy)
            for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("split", [0, 64])
def test_fixed_buffer_decode_matches_eager_reference(tmp_path, split: int) -> None:
    # split 64: the tiny model's KV heads aim at 64 programs in all, so decode rows are cut into
    # shares merged by the combine pass (8-key tiles, so rows of 64+ keys have the 4 tiles per
    # share that a split needs).
    path, _ = make_tiny_model("llama", tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = _prompts(gen, 384)
    ref = make_engine(str(path), block_size=8, num_blocks=128, backend=ReferenceBackend())
    backend = TritonBackend(SMALL, LaunchConfig(16, 8, 4, 1) if split else SMALL, split_programs=split)
    fixed = make_engine(str(path), block_size=8, num_blocks=128, backend=backend, cuda_graphs="eager")
    graphs = fixed.executor.graphs
    assert graphs is not None and not graphs.capture
    graphs.capacity = 64  # small, so the buffers must grow while the rows get longer
    want = _run(ref, prompts)
    assert _run(fixed, prompts) == want
    assert graphs.replays >= 8  # every decode-only step took the fixed-buffer path
    assert sorted(graphs.buffers) == [1, 2, 4]  # one set per padded batch size seen (3 rows pad to 4)
    assert graphs.buffers[4].static.capacity > 64
    # warm: the documents come back from the cache at new positions (non-zero deltas in decode)
    assert _run(fixed, prompts[::-1]) == _run(ref, prompts[::-1])
    ways = {w for b in graphs.buffers.values() for _, w, _ in b.static._layouts}
    assert ways == {1} if not split else ways >= {1, 2}, ways  # the ways grew with the rows


def test_fixed_buffer_decode_reads_segments_repaired(tmp_path) -> None:
    """Decode rows whose plus segments are read with a temperature and log scale (beside plain
    rows) take the fixed-buffer path, cut into split shares, and give the reference backend's
    tokens, cold and warm (unsplit repaired decode launches: test_triton_attention.py)."""
    split = 64
    path, _ = make_tiny_model("llama", tmp_path)
    prompts = _prompts(torch.Generator().manual_seed(2), 384)
    policy = Policy("none", temperature=0.4, log_scale=1.5)
    ref = make_engine(str(path), block_size=8, num_blocks=128, backend=ReferenceBackend())
    backend = TritonBackend(SMALL, LaunchConfig(16, 8, 4, 1) if split else SMALL, split_programs=split)
    fixed = make_engine(str(path), block_size=8, num_blocks=128, backend=backend, cuda_graphs="eager")
    graphs = fixed.executor.graphs
    assert _run(fixed, prompts, policy) == _run(ref, prompts, policy)
    assert _run(fixed, prompts[::-1], policy) == _run(ref, prompts[::-1], policy)
    # repaired steps replayed, cut into split shares
    assert any(r and w > 1 for b in graphs.buffers.values() for _, w, r in b.static._layouts)


def test_eager_engine_has_no_graphs_on_cpu(tmp_path) -> None:
    path, _ = make_tiny_model("llama", tmp_path)
    assert make_engine(str(path), num_blocks=32, backend=TritonBackend()).executor.graphs is None
    assert make_engine(str(path), num_blocks=32, backend=TritonBackend(), cuda_graphs=False).executor.graphs is None


@pytest.mark.parametrize("split", [0, 64])
def test_lean_decode_matches_eager_general_path(tmp_path, split: int) -> None:
    """Warm span requests decode with deltas; tiny capacities make keys and tiles outgrow the
    buffers; a batch over max_batch falls back to the general eager path mid-run. With `split`
    both paths cut the decode rows into shares."""
    path, _ = make_tiny_model("llama", tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompts = _prompts(gen, 384)[1:3] + [torch.randint(3, 384, (37,), generator=gen).tolist()]
    backend = lambda: TritonBackend(SMALL, LaunchConfig(16, 8, 4, 1) if split else SMALL,  # noqa: E731
                                    split_programs=split)
    eager = make_engine(str(path), block_size=8, num_blocks=128, backend=backend(), cuda_graphs=False)
    lean = make_engine(str(path), block_size=8, num_blocks=128, backend=backend(), cuda_graphs="eager")
    graphs = lean.executor.graphs
    graphs.capacity = 16
    graphs.max_batch = 2  # batch 3 runs eagerly
    assert _run(lean, prompts) == _run(eager, prompts)
    warm = prompts[1::-1] + prompts[2:]  # the segments come back from the cache at new positions
    assert _run(lean, warm) == _run(eager, warm)
    assert sorted(graphs.buffers) == [1, 2]
    statics = [b.static for b in graphs.buffers.values()]
    assert all(s.capacity > 16 for s in statics) and any(s.tile_capacity > 4 for s in statics)
    assert any(fused for s in statics for fused, _, _ in s._layouts)  # some step rotated keys in the kernel
    assert max(w for s in statics for _, w, _ in s._layouts) == (1 if not split else 2)


def _decode_chunks(rng: random.Random, bs: int) -> list[Chunk]:
    """Decode rows over random block tables: partial blocks anywhere, runs of entries sharing a
    delta (zero or not), rows without any delta, and queries before the table's end."""
    free = list(range(1, 512))
    rng.shuffle(free)
    chunks = []
    for _ in range(rng.randint(1, 6)):
        entries, deltas = [], rng.random() < 0.7
        for _ in range(rng.randint(1, 24)):
            if not entries or rng.random() < 0.4:
                delta = rng.choice([0, rng.randint(1, 900), -rng.randint(1, 300)]) if deltas else 0
            n = bs if rng.random() < 0.6 else rng.randint(1, bs - 1)
            entries.append(Entry(free.pop(), delta, n))
        n_keys = sum(e.n_valid for e in entries)
        p = n_keys - 1 if rng.random() < 0.7 else rng.randint(0, n_keys - 1)
        tokens = [rng.randint(0, 99) for _ in range(n_keys)]
        repair = None
        if rng.random() < 0.4:
            end = rng.randint(1, n_keys)
            repair = Repair(np.array([rng.randint(0, end - 1)]), np.array([end]), 0.5, rng.choice([0.0, 1.25]))
        task = Task(tokens, entries, [], bs, sample=True, main=True, repair=repair)
        chunks.append(Chunk(request=None, task=task, positions=[p]))
    return chunks


@pytest.mark.parametrize("split", [None, SplitPolicy(12), SplitPolicy(40, min_tiles=1)])
@pytest.mark.parametrize("block_n", [4, 16, 128])
def test_packed_layout_equals_general_layout(block_n: int, split: SplitPolicy | None) -> None:
    rng = random.Random(block_n)
    bs, small_q = 8, 4
    static = StaticDecode(6, torch.zeros(4), torch.device("cpu"), capacity=16, split=split)
    for trial in range(40):
        chunks = _decode_chunks(rng, bs)
        B = len(chunks)
        hp, sample_at = host_plan(chunks)
        ids, plan = device_plan(hp, torch.device("cpu"))
        lay = build_layout(plan, torch.zeros(4))
        small, big = lay.launches(small_q, block_n, 16, 64, True, split)
        assert StaticDecode.eligible(lay, small, big)
        rows, lean_sample_at = decode_rows(chunks)
        assert lean_sample_at == sample_at
        if static.batch != B:
            static = StaticDecode(B, torch.zeros(4), torch.device("cpu"), capacity=16, split=split)
        old = (static.capacity, static.tile_capacity)
        fixed, moved = static.load(rows, block_n)
        n_keys, n_tiles = lay.key_slots.numel(), small.tile_start.numel()
        assert moved == ((static.capacity, static.tile_capacity) != old)
        assert static.capacity >= n_keys and static.tile_capacity >= n_tiles
        got, want = fixed.fixed[0], small
        assert got.split == want.split and torch.equal(got.desc, want.desc), trial
        if want.split > 1:
            assert torch.equal(got.tokens, want.tokens)
        for g, w in ((got.tile_start, want.tile_start), (got.tile_end, want.tile_end),
                     (got.tile_delta, want.tile_delta)):
            assert torch.equal(g[:n_tiles], w)
        assert got.fused_delta == want.fused_delta == fixed.has_delta
        assert torch.equal(fixed.key_slots[:n_keys], lay.key_slots)
        assert (fixed.key_end is None) == (lay.key_end is None)
        if lay.key_end is not None:
            assert torch.equal(fixed.key_end[:n_keys], lay.key_end)
        assert torch.equal(fixed.q_pos, lay.q_pos)
        assert torch.equal(fixed.anchor, lay.anchor) and torch.equal(fixed.seg, lay.seg)
        assert torch.equal(fixed.write_slots, lay.write_slots)
        assert torch.equal(static.ids, ids) and torch.equal(static.positions, plan.positions)
        assert not fixed.has_plus and fixed.fixed[1].desc.shape[0] == 0


def test_packed_layout_alternates_host_buffers() -> None:
    """Consecutive steps are written into different host buffers (one may still feed an earlier
    copy), and each step's contents arrive whole."""
    rng = random.Random(5)
    static = StaticDecode(1, torch.zeros(4), torch.device("cpu"), capacity=1 << 12)
    seen = []
    for _ in range(4):
        chunks = _decode_chunks(rng, 8)[:1]
        rows, _ = decode_rows(chunks)
        seen.append(static._turn)
        fixed, moved = static.load(rows, 16)
        assert not moved
        slots = chunks[0].task.slots[:rows.pos[0] + 1]
        assert np.array_equal(fixed.key_slots[:len(slots)].numpy(), slots)
        assert static.ids.item() == rows.ids[0] and fixed.write_slots.item() == slots[-1]
    assert seen == [0, 1, 0, 1]


def test_graph_batch_sizes_cover_every_batch_up_to_the_largest() -> None:
    from spanserve.worker.cuda_graphs import batch_sizes, padded

    for largest in (1, 3, 16, 64, 100, 256, 512):
        sizes = batch_sizes(largest)
        assert sizes == sorted(set(sizes)) and sizes[-1] == largest
        for b in range(1, largest + 1):  # each batch pads to the smallest size that holds it
            size = next(s for s in sizes if s >= b)
            assert size < 2 * b or size == b == 1  # never twice the rows it holds
    rows = DecodeRows([5, 6], [3, 9], [np.arange(4), np.arange(10)], [None, np.zeros(10, dtype=np.int64)])
    out = padded(rows, 4, scratch_slot=77)
    assert (out.ids, out.pos) == ([5, 6, 0, 0], [3, 9, 0, 0])
    assert [s.tolist() for s in out.slots[2:]] == [[77], [77]] and out.deltas[2:] == [None, None]
    assert padded(rows, 2, 77) is rows


@pytest.mark.parametrize("ways", [1, 2, 3])
@pytest.mark.parametrize("block_n", [4, 16, 128])
def test_plain_rows_are_written_as_row_by_row(block_n: int, ways: int) -> None:
    """A step without deltas is written with arrays (write_plain); the bytes equal the row-by-row
    writer's (write_rows, the reference), rows of every length, tiles split into `ways`."""
    from spanserve.attention.triton.decode_launch import HostArrays, PlainSpans, decode_spans, write_plain, write_rows
    from spanserve.attention.triton.graph_decode import Packed, Regions

    rng = np.random.default_rng(block_n * 10 + ways)
    for _ in range(30):
        B = int(rng.integers(1, 40))
        pos = rng.integers(0, 400, B).tolist()
        slots = [rng.permutation(5000)[:p + 1 + int(rng.integers(0, 5))].astype(np.int64) for p in pos]
        rows = DecodeRows(rng.integers(0, 1000, B).tolist(), pos, slots, [None] * B)
        regions = Regions(B, sum(pos) + B, sum(-(-(p + 1) // block_n) for p in pos), max(ways, 1))
        got, want = (HostArrays.of(Packed.allocate(regions, torch.device("cpu"))) for _ in range(2))
        write_plain(got, rows, PlainSpans.of(rows, block_n), block_n, ways)
        index = np.arange(regions.key_cap, dtype=np.int32)
        assert not write_rows(want, rows, decode_spans(rows, block_n), block_n, index, ways)
        for field in HostArrays.__dataclass_fields__:
            assert np.array_equal(getattr(got, field), getattr(want, field)), field
