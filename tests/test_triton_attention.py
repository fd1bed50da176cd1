"""TritonBackend and reposition_blocks against the reference, on CPU through Triton's interpreter.

The interpreter is chosen before triton is first imported: the flag is read at import time."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402
import random  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from spanserve.attention.plan import AttentionPlan, Repair, Row  # noqa: E402
from spanserve.attention.reference import ReferenceBackend  # noqa: E402
from spanserve.attention.triton import LaunchConfig, TritonBackend, reposition_blocks  # noqa: E402
from spanserve.cache.table import Entry, key_deltas, key_slots  # noqa: E402
from spanserve.rope import Rotary, apply_rotary  # noqa: E402

D = 32
BS = 8
# Small tiles so that a row spans many programs and tiles, and tiles straddle entries and spans.
SMALL = LaunchConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


@dataclass
class Case:
    plan: AttentionPlan
    num_blocks: int
    used: set[int]  # slots some row reads


def _entries(rng: random.Random, n_keys: int, free: list[int]) -> list[Entry]:
    """Segments of a few entries sharing one delta (zero, positive or negative); about a third of
    the entries are partial, wherever they fall in the row."""
    out: list[Entry] = []
    total = 0
    while total < n_keys:
        delta = rng.choice([0, 0, rng.randint(1, 5000), -rng.randint(1, 3000)])
        for _ in range(rng.randint(1, 4)):
            n = BS if rng.random() < 0.65 else rng.randint(1, BS - 1)
            n = min(n, n_keys - total)
            out.append(Entry(free.pop(), delta, n))
            total += n
            if total == n_keys:
                break
    return out


def _repair(rng: random.Random, n_keys: int) -> Repair | None:
    """Random plus segments in a row's keys, some queries after them, some inside."""
    if rng.random() < 0.25 or n_keys < 2:
        return None
    cuts = sorted(rng.sample(range(n_keys + 1), min(n_keys + 1, 2 * rng.randint(1, 3))))
    starts, ends = np.array(cuts[0::2], dtype=np.int64), np.array(cuts[1::2], dtype=np.int64)
    return Repair(starts[:len(ends)], ends, rng.choice([0.25, 0.6, 1.7]), rng.choice([-2.0, 0.5, 3.0]))


def _case(rng: random.Random, n_rows: int, plus: bool, max_keys: int = 120, repair: bool = False) -> Case:
    num_blocks = 400 * -(-max_keys // 120)
    # Block 0 stays finite and unused: the reference pads its key lists with slot 0.
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    rows: list[Row] = []
    positions: list[int] = []
    writes: list[int] = []
    used: set[int] = set(range(BS))
    for _ in range(n_rows):
        n_keys = rng.randint(1, max_keys)
        entries = _entries(rng, n_keys, free)
        slots = key_slots(entries, BS)
        deltas = key_deltas(entries)
        nq = 1 if rng.random() < 0.5 else rng.randint(1, n_keys)
        q_pos = list(range(n_keys - nq, n_keys))
        start = len(positions)
        positions.extend(q_pos)
        writes.extend(slots[p] for p in q_pos)
        used.update(slots)
        anchor = seg = None
        if plus and rng.random() < 0.7:
            # Per-query bounds, each query still sees itself (seg_start <= t).
            anchor = torch.tensor([rng.randint(0, t) for t in q_pos])
            seg = torch.tensor([rng.randint(0, t) for t in q_pos])
        rows.append(Row(
            q_start=start, q_end=start + nq, q_pos=torch.tensor(q_pos),
            key_slots=torch.tensor(slots),
            key_delta=None if deltas is None else torch.tensor(deltas),
            anchor_end=anchor, seg_start=seg, repair=_repair(rng, n_keys) if repair else None,
        ))
    plan = AttentionPlan(rows, torch.tensor(positions), torch.tensor(writes))
    return Case(plan, num_blocks, used)


def _run(case: Case, H: int, KVH: int, dtype: torch.dtype, backend: TritonBackend, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    rotary = Rotary(D, 10000.0, None, torch.device("cpu"))
    T = int(case.plan.positions.numel())
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    k = torch.randn(T, 1, D, generator=gen).repeat(1, KVH, 1).to(dtype)
    k += torch.randn(T, KVH, D, generator=gen).to(dtype)
    v = torch.randn(T, KVH, D, generator=gen).to(dtype)
    shape = (case.num_blocks, BS, KVH, D)
    cache_k = torch.randn(shape, generator=gen).to(dtype)
    cache_v = torch.randn(shape, generator=gen).to(dtype)
    # Slots no row reads hold NaN: a kernel that touches one (past n_valid, a wrong block) fails.
    unused = torch.ones(case.num_blocks * BS, dtype=torch.bool)
    unused[list(case.used)] = False
    cache_k.view(-1, KVH, D)[unused] = float("nan")
    cache_v.view(-1, KVH, D)[unused] = float("nan")

    ref_k, ref_v = cache_k.float(), cache_v.float()
    ref = ReferenceBackend()
    want = ref.forward(ref.prepare(case.plan, rotary, BS), q.float(), k.float(), v.float(), ref_k, ref_v)

    got_k, got_v = cache_k.clone(), cache_v.clone()
    got = backend.forward(backend.prepare(case.plan, rotary, BS), q, k, v, got_k, got_v)

    assert got.shape == (T, H * D) and got.dtype == dtype
    assert torch.isfinite(got).all(), "an output was left unwritten or a NaN slot was read"
    torch.testing.assert_close(got_k.float(), ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got_v.float(), ref_v, rtol=0, atol=0, equal_nan=True)
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < (2e-6 if dtype == torch.float32 else 2e-3), err


# Prefill rows either prerotate their delta keys into scratch, or rotate Q per span in-kernel;
# 64-row programs re-read Q at each span, the 16-row (decode) ones keep it in registers.
BACKENDS = {
    "prerotate": lambda: TritonBackend(SMALL, SMALL),
    "fused": lambda: TritonBackend(LaunchConfig(64, 16, 4, 1), SMALL, prerotate_prefill=False),
    # Prefill programs cut along keys into shares merged by the combine pass.
    "split": lambda: TritonBackend(SMALL, SMALL, split_programs=1000),
    "split-fused": lambda: TritonBackend(LaunchConfig(64, 16, 4, 1), SMALL, prerotate_prefill=False,
                                         split_programs=1000),
}


@pytest.mark.parametrize("mode", sorted(BACKENDS))
@pytest.mark.parametrize("G", [1, 3])
@pytest.mark.parametrize("seed", range(4))
def test_random_layouts_match_reference(mode: str, G: int, seed: int) -> None:
    rng = random.Random(1000 * G + seed)
    case = _case(rng, n_rows=rng.randint(1, 6), plus=seed % 2 == 1)
    _run(case, H=2 * G, KVH=2, dtype=torch.float32, backend=BACKENDS[mode](), seed=seed)


@pytest.mark.parametrize("mode", sorted(BACKENDS))
@pytest.mark.parametrize("seed", range(2))
def test_repaired_rows_match_reference(mode: str, seed: int) -> None:
    """Rows whose plus segments are read with a temperature and log scale (plan.Repair), beside
    rows without, prefill and decode launches, split or not, prerotated or fused."""
    rng = random.Random(500 + seed)
    case = _case(rng, n_rows=rng.randint(2, 6), plus=seed == 1, max_keys=200, repair=True)
    _run(case, H=6, KVH=2, dtype=torch.float32, backend=BACKENDS[mode](), seed=seed)


@pytest.mark.parametrize("mode", ["split", "split-fused"])
@pytest.mark.parametrize("seed", range(3))
def test_split_launches_on_long_rows(mode: str, seed: int) -> None:
    # Rows of up to 600 keys: many shares per query block, some covering only anchor tiles or only
    # the causal part, so every combine sees shares of unequal weight.
    rng = random.Random(77 + seed)
    case = _case(rng, n_rows=rng.randint(1, 4), plus=seed != 0, max_keys=600)
    backend = BACKENDS[mode]()
    lay = backend.prepare(case.plan, Rotary(D, 10000.0, None, torch.device("cpu")), BS)
    _, big = backend.launches(lay, 2, 2)
    if big.desc.shape[0]:
        assert big.split > 1
    _run(case, H=4, KVH=2, dtype=torch.float32, backend=backend, seed=seed)


@pytest.mark.parametrize("seed", range(3))
def test_fresh_rows_through_dense_attention(seed: int) -> None:
    # Fresh prompt rows (all own keys, causal from 0, no deltas) and later chunks of them (their
    # queries the last of such keys) go to torch's attention on K/V gathered from the cache; the
    # other rows of the step (deltas, plus rows, decodes) stay in the Triton launches. Scattered
    # slots: the gather must follow key_slots.
    rng = random.Random(500 + seed)
    case = _case(rng, n_rows=4, plus=seed == 1, max_keys=80)
    free = sorted({s // BS for s in range(case.num_blocks * BS)} - {s // BS for s in case.used} - {0})
    rng.shuffle(free)
    rows, positions, writes = list(case.plan.rows), case.plan.positions.tolist(), case.plan.write_slots.tolist()
    chunk = rng.randint(9, 30)  # the third row: its last `chunk` keys are its queries
    for which, n in enumerate((rng.randint(9, 40), rng.randint(9, 40), chunk + rng.randint(1, 30))):
        slots = [b * BS + i for b in free[:-(-n // BS)] for i in range(BS)][:n]
        free = free[-(-n // BS):]
        case.used.update(slots)
        at = rng.randint(0, len(rows))
        m = chunk if which == 2 else n
        rows.insert(at, Row(0, m, torch.arange(n - m, n), torch.tensor(slots)))
    start, positions, writes = 0, [], []
    for r in rows:  # renumber the rows' query ranges in their new order
        nq = r.num_queries
        r.q_start, r.q_end = start, start + nq
        start += nq
        positions += r.q_pos.tolist()
        writes += r.key_slots[r.q_pos].tolist()
    plan = AttentionPlan(rows, torch.tensor(positions), torch.tensor(writes))
    case = Case(plan, case.num_blocks, case.used)
    backend = TritonBackend(SMALL, SMALL, dense_prefill=9)
    lay = backend.prepare(plan, Rotary(D, 10000.0, None, torch.device("cpu")), BS)
    dense = lay.dense_rows(9)
    assert len(dense) >= 3 and any(r.n_keys > r.q_end - r.q_start for r in dense)
    _, big = backend.launches(lay, 2, 2)
    starts = set(big.desc[:, 0].tolist())
    assert not any(r.q_start in starts for r in dense), "a dense row is also in the Triton launch"
    _run(case, H=4, KVH=2, dtype=torch.float32, backend=backend, seed=seed)


def test_split_shares_partition_tiles() -> None:
    # Each query block's shares cover its tiles exactly once, in order, and no share is empty of
    # both parts unless the block itself has fewer tiles than shares.
    from spanserve.attention.triton.descriptors import F_PART0, F_SPLIT
    from spanserve.attention.triton.descriptors import split_shares as _split
    rng = np.random.default_rng(0)
    desc = np.zeros((50, 16), dtype=np.int64)
    lo0 = rng.integers(0, 100, 50)
    lo1 = lo0 + rng.integers(0, 30, 50)
    desc[:, F_PART0 + 2], desc[:, F_PART0 + 3] = lo0, lo0 + rng.integers(0, 30, 50)
    desc[:, F_PART0 + 3] = np.minimum(desc[:, F_PART0 + 3], lo1)
    desc[:, F_PART0 + 6], desc[:, F_PART0 + 7] = lo1, lo1 + rng.integers(0, 40, 50)
    for ways in (1, 2, 7):
        out = _split(desc, ways).reshape(50, ways, 16)
        for d, shares in zip(desc, out):
            want = list(range(d[F_PART0 + 2], d[F_PART0 + 3])) + list(range(d[F_PART0 + 6], d[F_PART0 + 7]))
            got = [j for s in shares for p in (0, 4) for j in range(s[F_PART0 + 2 + p], s[F_PART0 + 3 + p])]
            assert got == want
            assert shares[:, F_SPLIT].tolist() == list(range(ways))
            sizes = [(s[F_PART0 + 3] - s[F_PART0 + 2]) + (s[F_PART0 + 7] - s[F_PART0 + 6]) for s in shares]
            assert max(sizes) - min(sizes) <= 1


def test_default_tiles_and_fp16() -> None:
    # The production tile shapes (128-row prefill programs) on a mixed batch, in half precision.
    rng = random.Random(7)
    case = _case(rng, n_rows=5, plus=True)
    _run(case, H=8, KVH=2, dtype=torch.float16, backend=TritonBackend(), seed=7)


def test_all_zero_deltas_take_plain_path() -> None:
    # A key_delta tensor of zeros must give the same as no deltas (the kernel skips rotation).
    rng = random.Random(3)
    case = _case(rng, n_rows=3, plus=False)
    for r in case.plan.rows:
        r.key_delta = torch.zeros(r.num_keys, dtype=torch.long)
    lay = TritonBackend().prepare(case.plan, Rotary(D, 10000.0, None, torch.device("cpu")), BS)
    assert not lay.has_delta
    _run(case, H=4, KVH=2, dtype=torch.float32, backend=TritonBackend(SMALL, SMALL), seed=3)


def test_spans_follow_delta_runs() -> None:
    # Spans cut at delta changes only: partial entries with the same delta stay in one span.
    entries = [Entry(3, 5, BS), Entry(9, 5, 3), Entry(4, 5, BS), Entry(1, 0, 2), Entry(2, -7, BS)]
    slots, deltas = key_slots(entries, BS), key_deltas(entries)
    n = len(slots)
    row = Row(0, 1, torch.tensor([n - 1]), torch.tensor(slots), torch.tensor(deltas))
    plan = AttentionPlan([row], torch.tensor([n - 1]), torch.tensor([slots[-1]]))
    lay = TritonBackend().prepare(plan, Rotary(D, 10000.0, None, torch.device("cpu")), BS)
    r = lay.rows[0]
    assert r.span_starts.tolist() == [0, 19, 21] and r.span_ends.tolist() == [19, 21, 29]
    assert r.span_delta.tolist() == [5, 0, -7]
    # Fused tiles stop at span ends; prerotated tiles ignore spans.
    (fused, _) = lay.launches(4, 8, 16, 8, prerotate_big=True)
    assert fused.tile_start.tolist() == [0, 8, 16, 19, 21] and fused.tile_delta.tolist() == [5, 5, 5, 0, -7]
    assert fused.fused_delta and fused.prerotation is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reposition_matches_copy_and_rotate(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    L, NB, KVH = 3, 12, 2
    k = torch.randn(L, NB, BS, KVH, D, generator=gen).to(dtype)
    v = torch.randn(L, NB, BS, KVH, D, generator=gen).to(dtype)
    # Includes delta 0, a negative delta, partial copies and a rotation in place (block 11).
    jobs = [(0, 6, BS, 37), (1, 7, 3, 0), (2, 8, BS, -1200), (3, 9, 1, 99999), (4, 10, 5, 4), (11, 11, BS, 250)]
    rotary = Rotary(D, 10000.0, None, torch.device("cpu"))
    want_k, want_v = k.clone(), v.clone()
    for src, dst, n, delta in jobs:
        cos, sin = rotary.cos_sin(torch.tensor([delta]), torch.float32)
        for layer in range(L):
            x = k[layer, src, :n].float()
            want_k[layer, dst, :n] = apply_rotary(x, cos.expand(n, -1), sin.expand(n, -1)).to(dtype)
            want_v[layer, dst, :n] = v[layer, src, :n]
    reposition_blocks(k, v, jobs, rotary.inv_freq)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(k, want_k, rtol=tol, atol=tol)
    torch.testing.assert_close(v, want_v, rtol=0, atol=0)


def test_reposition_then_attend_equals_deferred_rotation() -> None:
    # Eager repositioning (rotate K, delta becomes 0) and deferred rotation are the same attention.
    rng = random.Random(5)
    rotary = Rotary(D, 10000.0, None, torch.device("cpu"))
    entries = _entries(rng, 50, list(range(30, 0, -1)))
    # The step's own token is written at delta 0 in both layouts.
    entries[-1] = Entry(entries[-1].block, 0, entries[-1].n_valid)
    gen = torch.Generator().manual_seed(5)
    KVH, H = 1, 2
    k_all = torch.randn(1, 64, BS, KVH, D, generator=gen)
    v_all = torch.randn(1, 64, BS, KVH, D, generator=gen)
    slots = key_slots(entries, BS)
    n = len(slots)
    q = torch.randn(1, H, D, generator=gen)
    kv = torch.randn(1, KVH, D, generator=gen)
    deferred = Row(0, 1, torch.tensor([n - 1]), torch.tensor(slots), None if key_deltas(entries) is None
                   else torch.tensor(key_deltas(entries)))
    backend = TritonBackend(SMALL, SMALL)
    plan = AttentionPlan([deferred], torch.tensor([n - 1]), torch.tensor([slots[-1]]))
    a = backend.forward(backend.prepare(plan, rotary, BS), q, kv, kv, k_all[0].clone(), v_all[0].clone())
    jobs = [(e.block, e.block + 32, e.n_valid, e.delta) for e in entries]
    reposition_blocks(k_all, v_all, jobs, rotary.inv_freq)
    moved = [Entry(dst, 0, nv) for (_, dst, nv, _) in jobs]
    mslots = key_slots(moved, BS)
    plan2 = AttentionPlan([Row(0, 1, torch.tensor([n - 1]), torch.tensor(mslots))], torch.tensor([n - 1]),
                          torch.tensor([mslots[-1]]))
    b = backend.forward(backend.prepare(plan2, rotary, BS), q, kv, kv, k_all[0], v_all[0])
    assert math.isclose((a - b).abs().max().item(), 0.0, abs_tol=1e-5)


def test_split_ways_follow_programs_and_tiles() -> None:
    from spanserve.attention.triton.split import SplitPolicy, decode_split
    p = SplitPolicy(33)  # 264 programs over 8 KV heads: two per SM of an H100
    assert p.ways(16, None) == 3  # prefill launches round up
    assert decode_split(p).ways(16, None) == 2  # decodes round down: 256 programs, one wave
    assert decode_split(p).ways(17, None) == 1 and p.ways(40, None) == 1
    assert p.ways(1, 37) == 8 and p.ways(1, 63) == 8 and p.ways(1, 64) == 16  # tiles floored to 2^k, 4 per share
    assert p.ways(1, 7) == 1 and p.ways(1, 8) == 2
    assert p.ways(1, None) == 33 and decode_split(p).ways(1, 10_000) == 33



def test_tiles_sized_for_dtype_and_head_dim() -> None:
    # float32 at head_dim 128 asked 262,144 bytes of shared memory of an H200 (232,448) with the
    # bf16 tiles: the engine's backend halves them there, and keeps the tuned ones for 2-byte types.
    from spanserve.attention.triton.backend import DECODE, PREFILL

    b = TritonBackend(split_programs=64)
    assert b.sized_for(torch.bfloat16, 128) is b and b.sized_for(torch.float32, 64) is b
    f = b.sized_for(torch.float32, 128)
    assert (f.prefill_cfg.block_m, f.prefill_cfg.block_n, f.decode_cfg.block_m, f.decode_cfg.block_n) == (64, 64, 16, 64)
    assert f.prefill_cfg.num_stages == f.decode_cfg.num_stages == 2 and f.split_programs == 64
    assert (b.prefill_cfg, b.decode_cfg) == (PREFILL, DECODE)
    # the halved tiles still compute the same attention
    rng = random.Random(11)
    case = _case(rng, n_rows=4, plus=True)
    _run(case, H=4, KVH=2, dtype=torch.float32, backend=TritonBackend(SMALL, SMALL).sized_for(torch.float32, 4 * D),
         seed=11)


def test_engine_runs_the_backend_sized_for_its_model() -> None:
    from engine_helpers import make_engine

    from spanserve.model.config import ModelConfig
    from spanserve.model.weights import RandomWeights

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=256, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=128, max_position_embeddings=256)
    eng = make_engine(RandomWeights(cfg, seed=0), dtype="float32", num_blocks=8, backend=TritonBackend())
    assert (eng.executor.backend.prefill_cfg.block_m, eng.executor.backend.decode_cfg.block_n) == (64, 64)


@pytest.mark.parametrize("ways_target", [0, 12, 64])
def test_decode_rows_described_over_arrays_as_row_by_row(ways_target: int) -> None:
    """A launch of decode rows (one causal query at the row's last key, deltas in runs) is
    described with arrays; it equals the row-by-row description, splits included."""
    from spanserve.attention.triton.descriptors import describe_decodes as _describe_decodes
    from spanserve.attention.triton.launch import _describe_host, _describe_rows, _RowHost
    from spanserve.attention.triton.split import SplitPolicy

    rng = np.random.default_rng(ways_target)
    for _ in range(40):
        rows, q0, key_base = [], int(rng.integers(0, 5)), 0
        for _ in range(int(rng.integers(1, 30))):
            n = int(rng.integers(1, 300))
            cuts = np.sort(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(0, 4))), replace=False)) \
                if n > 1 else np.zeros(0, dtype=np.int64)
            starts = np.concatenate(([0], cuts)).astype(np.int64)
            ends = np.concatenate((cuts, [n])).astype(np.int64)
            delta = rng.integers(-50, 50, len(starts)) * (rng.random() < 0.6)
            rows.append(_RowHost(q0, q0 + 1, key_base, n, starts, ends, delta.astype(np.int64),
                                 np.array([n - 1]), np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)))
            q0, key_base = q0 + 1 + int(rng.integers(0, 3)), key_base + n
        split = SplitPolicy(ways_target) if ways_target else None
        bn = int(rng.choice([4, 16, 64]))
        fast, slow = _describe_host(rows, 16, bn, False, split), _describe_rows(rows, 16, bn, False, split)
        assert np.array_equal(_describe_decodes(rows, bn)[0][:, 0], [r.q_start for r in rows])
        for field in ("desc", "tile_start", "tile_end", "tile_delta", "tokens"):
            a, b = getattr(fast, field), getattr(slow, field)
            assert (a is None and b is None) or np.array_equal(a, b), field
        assert (fast.split, fast.fused_delta) == (slow.split, slow.fused_delta)
