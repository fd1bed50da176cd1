"""The reference backend against dense attention with keys rotated at their logical positions."""
import torch
from hypothesis import given, settings, strategies as st

from spanserve.attention.plan import AttentionPlan, Row
from spanserve.attention.reference import ReferenceBackend
from spanserve.cache.table import Entry, key_deltas, key_slots
from spanserve.rope import Rotary, apply_rotary

H, KVH, D = 6, 2, 16


def _dense(q_raw, k_raw, v, q_pos, anchor_end, seg_start, rot):
    """Plain attention: queries and keys rotated by logical position, explicit mask, loops."""
    n_keys = k_raw.shape[0]
    cq, sq = rot.cos_sin(q_pos, torch.float64)
    ck, sk = rot.cos_sin(torch.arange(n_keys), torch.float64)
    q = apply_rotary(q_raw, cq, sq)
    k = apply_rotary(k_raw, ck, sk)
    out = torch.zeros(len(q_pos), H * D, dtype=torch.float64)
    for i, t in enumerate(q_pos.tolist()):
        vis = [j for j in range(n_keys) if j < anchor_end or seg_start <= j <= t]
        for h in range(H):
            kv = h // (H // KVH)
            s = torch.stack([q[i, h] @ k[j, kv] for j in vis]) / D ** 0.5
            p = torch.softmax(s, 0)
            out[i, h * D:(h + 1) * D] = sum(p[n] * v[j, kv] for n, j in enumerate(vis))
    return out


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_delta_rotation_matches_absolute_positions(data):
    bs = data.draw(st.sampled_from([4, 16]))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    # A row made of entries with random fill and random delta: keys are stored rotated by their
    # local position (logical - delta), exactly as a reused segment would be.
    sizes = data.draw(st.lists(st.integers(1, bs), min_size=1, max_size=6))
    deltas = data.draw(st.lists(st.integers(-50, 50), min_size=len(sizes), max_size=len(sizes)))
    n_keys = sum(sizes)
    num_blocks = len(sizes) + 3
    perm = torch.randperm(num_blocks, generator=gen)[: len(sizes)].tolist()
    entries = [Entry(b, d, n) for b, d, n in zip(perm, deltas, sizes)]
    rot = Rotary(D, 10000.0, None, torch.device("cpu"))
    k_raw = torch.randn(n_keys, KVH, D, generator=gen, dtype=torch.float64)
    v = torch.randn(n_keys, KVH, D, generator=gen, dtype=torch.float64)
    k_cache = torch.full((num_blocks, bs, KVH, D), float("nan"), dtype=torch.float64)
    v_cache = torch.full((num_blocks, bs, KVH, D), float("nan"), dtype=torch.float64)
    slots = key_slots(entries, bs)
    per_key_delta = key_deltas(entries) or [0] * n_keys
    local = torch.arange(n_keys) - torch.tensor(per_key_delta)
    c, s = rot.cos_sin(local, torch.float64)
    k_cache.view(-1, KVH, D)[slots] = apply_rotary(k_raw, c, s)
    v_cache.view(-1, KVH, D)[slots] = v
    # queries: the last nq positions; optionally the plus-segment mask form
    nq = data.draw(st.integers(1, min(5, n_keys)))
    q_pos = torch.arange(n_keys - nq, n_keys)
    plus = data.draw(st.booleans())
    seg_start = data.draw(st.integers(0, n_keys - nq)) if plus else 0
    anchor_end = data.draw(st.integers(0, seg_start)) if plus else 0
    q_raw = torch.randn(nq, H, D, generator=gen, dtype=torch.float64)
    cq, sq = rot.cos_sin(q_pos, torch.float64)
    q = apply_rotary(q_raw, cq, sq)
    row = Row(0, nq, q_pos, torch.tensor(slots),
              None if key_deltas(entries) is None else torch.tensor(per_key_delta),
              torch.full((nq,), anchor_end) if plus else None, torch.full((nq,), seg_start) if plus else None)
    # this step writes nothing new: point writes at the keys' own slots with their own values
    write = torch.tensor(slots[-nq:])
    plan = AttentionPlan([row], q_pos, write)
    backend = ReferenceBackend()
    prepared = backend.prepare(plan, rot, bs)
    k_new = k_cache.view(-1, KVH, D)[write].clone()
    v_new = v_cache.view(-1, KVH, D)[write].clone()
    out = backend.forward(prepared, q, k_new, v_new, k_cache, v_cache)
    ref = _dense(q_raw, k_raw, v, q_pos, anchor_end, seg_start, rot)
    # angles are float32 (as in every RoPE implementation), so rotation composes to ~1e-7
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_rows_share_one_call_and_stay_separate():
    """Several single-query rows over different tables give each row its own answer."""
    rot = Rotary(D, 10000.0, None, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    bs, nb = 4, 12
    k_cache = torch.randn(nb, bs, KVH, D, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(nb, bs, KVH, D, generator=gen, dtype=torch.float64)
    tables = [[Entry(0, 0, 4), Entry(3, 0, 2)], [Entry(5, 7, 3)], [Entry(7, 0, 4), Entry(8, -2, 4), Entry(9, 0, 1)]]
    rows, qs = [], []
    for i, t in enumerate(tables):
        n = sum(e.n_valid for e in t)
        d = key_deltas(t)
        rows.append(Row(i, i + 1, torch.tensor([n - 1]), torch.tensor(key_slots(t, bs)),
                        None if d is None else torch.tensor(d)))
    q = torch.randn(len(tables), H, D, generator=gen, dtype=torch.float64)
    write = torch.tensor([key_slots(t, bs)[-1] for t in tables])
    plan = AttentionPlan(rows, torch.tensor([r.q_pos.item() for r in rows]), write)
    be = ReferenceBackend()
    kn, vn = k_cache.view(-1, KVH, D)[write].clone(), v_cache.view(-1, KVH, D)[write].clone()
    together = be.forward(be.prepare(plan, rot, bs), q, kn, vn, k_cache, v_cache)
    for i, r in enumerate(rows):
        alone_plan = AttentionPlan([Row(0, 1, r.q_pos, r.key_slots, r.key_delta)], r.q_pos, write[i:i + 1])
        alone = be.forward(be.prepare(alone_plan, rot, bs), q[i:i + 1], kn[i:i + 1], vn[i:i + 1], k_cache, v_cache)
        torch.testing.assert_close(together[i:i + 1], alone)
