"""Triton kernels, used by every step on CUDA (eager or replayed from a graph): paged attention
with deferred rotation and the combine pass of split launches, the per-layer prerotation of a
prefill launch's keys, the KV write, and eager repositioning (an 8-bit cache's write: kv_quant.py).

Conventions shared by all of them: a layer's cache is addressed as flat slots
[num_blocks * block_size, KVH, D] with the (KVH, D) part contiguous; RoPE is the rotate-half form,
so rotating x by angle a is x*cos(a) + swap(x)*sign*sin(a), where swap exchanges the two halves of
D and sign is -1 on the first half and +1 on the second (the inverse rotation flips sign).
Slot arithmetic is done in int64 because all-layer caches exceed 2**31 elements.
"""
from __future__ import annotations

import triton
import triton.language as tl

from spanserve.attention.triton import descriptors

# Jitted code may only read globals wrapped as constexpr.
F_TOK0 = tl.constexpr(descriptors.F_TOK0)
F_TOK1 = tl.constexpr(descriptors.F_TOK1)
F_KEY_BASE = tl.constexpr(descriptors.F_KEY_BASE)
F_PART0 = tl.constexpr(descriptors.F_PART0)
F_MIN_ANCHOR = tl.constexpr(descriptors.F_MIN_ANCHOR)
F_MAX_SEG = tl.constexpr(descriptors.F_MAX_SEG)
F_MIN_T = tl.constexpr(descriptors.F_MIN_T)
F_SPLIT = tl.constexpr(descriptors.F_SPLIT)
F_LOC0 = tl.constexpr(descriptors.F_LOC0)
F_SCRATCH_BASE = tl.constexpr(descriptors.F_SCRATCH_BASE)
F_INV_T = tl.constexpr(descriptors.F_INV_T)
F_LOG_S = tl.constexpr(descriptors.F_LOG_S)


@triton.jit
def attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
    desc_ptr, key_slots_ptr, key_end_ptr, qpos_ptr, anchor_ptr, seg_ptr,
    tile_start_ptr, tile_end_ptr, tile_delta_ptr, inv_freq_ptr, part_o_ptr, part_lse_ptr, part_ts_ptr,
    stride_qt, stride_qh, stride_cs, stride_ch, stride_ot, n_loc, n_heads, n_kvh,
    qk_scale,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_FIELDS: tl.constexpr, HAS_DELTA: tl.constexpr, KEEP_Q: tl.constexpr,
    K_SCRATCH: tl.constexpr, HAS_PLUS: tl.constexpr, PREC: tl.constexpr,
    SPLIT: tl.constexpr, HAS_REPAIR: tl.constexpr, K_FP8: tl.constexpr, V_FP8: tl.constexpr,
    V_SCRATCH: tl.constexpr,
):
    """One program: up to BLOCK_M // G query tokens of one row times the G query heads that share
    KV head `program_id(1)`, packed along M so every K/V tile is loaded once for all G heads.

    HAS_DELTA: tiles carry their span's delta; when it changes, the queries are rotated by -delta
    (from Q and swap(Q) kept in registers if KEEP_Q, else re-read), so the loop itself only adds one
    pipelined scalar load and a compare. K_SCRATCH: k_cache_ptr is the launch's prerotated K
    scratch, holding the row's keys in order from F_SCRATCH_BASE; V is read through the slots.
    SPLIT: the program covers one share of
    its query block's tiles and writes its normalized output and log2-sum-exp to the partial
    buffers [split, launch-local token, head], for `combine_kernel`.
    HAS_REPAIR: key_end_ptr holds each key's plus-segment end (plan.Repair.key_ends, parallel to
    the key slots); a query at t >= it reads the key as one of its context keys (plan.Repair), in
    a pass of its own before the others: scores times F_INV_T (1 / T), their result then one key
    of logit T * log2-sum-exp + F_LOG_S. Both passes read every tile of the program: skipping the
    tiles without a pair for the pass (a block reduction and a branch per tile) made the kernel 17x
    slower on an H100 (its loads no longer pipelined).
    K_FP8 / V_FP8: the cache holds e4m3 rows and a power-of-two scale per (slot, KV head) at
    k_scale_ptr / v_scale_ptr (attention/kv_cache.py). K's scale multiplies the scores and V's the
    probabilities: a power of two scales without rounding, so the products summed are those of
    the computation over the dequantized cache (bit for bit in the interpreter; compiled, the
    converted tiles may take another matrix instruction, which sums in another order)."""
    HALF: tl.constexpr = D // 2
    BLOCK_Q: tl.constexpr = BLOCK_M // G
    desc = desc_ptr + tl.program_id(0) * NUM_FIELDS
    kvh = tl.program_id(1)
    tok0 = tl.load(desc + F_TOK0)
    tok1 = tl.load(desc + F_TOK1)
    key_base = tl.load(desc + F_KEY_BASE)
    min_t = tl.load(desc + F_MIN_T)
    if K_SCRATCH:
        scratch_base = tl.load(desc + F_SCRATCH_BASE)
    if HAS_REPAIR:
        inv_t = tl.load(desc + F_INV_T).to(tl.float32, bitcast=True)
        inv_t = tl.where(inv_t > 0.0, inv_t, 1.0)  # a graph's padding descriptor is all zero
        log_s = tl.load(desc + F_LOG_S).to(tl.float32, bitcast=True)

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // G
    head = kvh * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (tok < tok1)
    t = tl.load(qpos_ptr + tok, mask=row_ok, other=0)
    anc = tl.load(anchor_ptr + tok, mask=row_ok, other=0)
    seg = tl.load(seg_ptr + tok, mask=row_ok, other=0)

    dd = tl.arange(0, D)
    q_ptrs = q_ptr + (tok.to(tl.int64) * stride_qt + head * stride_qh)[:, None] + dd[None, :]
    swap_ptrs = q_ptrs + tl.where(dd < HALF, HALF, -HALF)[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    if HAS_DELTA:
        freq = tl.load(inv_freq_ptr + dd % HALF)
        # R(-d) q = q cos + swap(q) sin * (+1 on the first half, -1 on the second).
        sign = tl.where(dd < HALF, 1.0, -1.0)
        if KEEP_Q:
            q_sw = tl.load(swap_ptrs, mask=row_ok[:, None], other=0.0)
        qc = q
        cur = tl.program_id(0) * 0  # delta that qc is rotated by; q itself is delta 0
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    # m_i starts finite, so a query that has seen no visible key yet gets p = 0 and alpha = 1
    # rather than exp(-inf + inf) = NaN.
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    kv_col = kvh * stride_ch + dd

    if SPLIT:
        loc = tl.load(desc + F_LOC0) + (tok - tok0)
        share = tl.load(desc + F_SPLIT).to(tl.int64)
    # HAS_REPAIR: pass 0 reads each query's context keys (scores / T), which then become one key of
    # logit T * their log2-sum-exp + log scale (or, split, a partial result of group 0), and pass 1
    # reads the other keys on top of it
    for grp in tl.static_range(2 if HAS_REPAIR else 1):
        for part in tl.static_range(2):
            if part == 1 or HAS_PLUS:
                klo = tl.load(desc + F_PART0 + 4 * part)
                khi = tl.load(desc + F_PART0 + 4 * part + 1)
                j_lo = tl.load(desc + F_PART0 + 4 * part + 2)
                j_hi = tl.load(desc + F_PART0 + 4 * part + 3)
                # Keys in [f_lo, f_hi) are visible to every query of the program.
                if part == 0:
                    f_lo = klo
                    f_hi = tl.load(desc + F_MIN_ANCHOR)
                else:
                    f_lo = tl.maximum(klo, tl.load(desc + F_MAX_SEG))
                    f_hi = min_t + 1
                for j in range(j_lo, j_hi):
                    k0 = tl.maximum(tl.load(tile_start_ptr + j), klo)
                    k1 = tl.minimum(tl.load(tile_end_ptr + j), khi)
                    kk = k0 + tl.arange(0, BLOCK_N)
                    kin = kk < k1
                    if HAS_REPAIR:
                        # the pass's (query, key) pairs: context ones in pass 0, the others in pass 1
                        kend = tl.load(key_end_ptr + key_base + kk, mask=kin, other=2147483647)
                        if grp == 0:
                            mine = t[:, None] >= kend[None, :]
                        else:
                            mine = t[:, None] < kend[None, :]
                    slot = tl.load(key_slots_ptr + key_base + kk, mask=kin, other=0).to(tl.int64)
                    if K_SCRATCH:
                        # Contiguous rows and no second index load: this is why the prerotation copies
                        # zero spans too (the slot-list variant ran 4-7% slower on H100).
                        k_row = (scratch_base + kk).to(tl.int64)
                        k_ptrs = k_cache_ptr + k_row[:, None] * stride_cs + kv_col[None, :]
                    else:
                        k_ptrs = k_cache_ptr + slot[:, None] * stride_cs + kv_col[None, :]
                    if V_SCRATCH:
                        v_ptrs = v_cache_ptr + k_row[:, None] * stride_cs + kv_col[None, :]
                    else:
                        v_ptrs = v_cache_ptr + slot[:, None] * stride_cs + kv_col[None, :]
                    kt = tl.load(k_ptrs, mask=kin[:, None], other=0.0)
                    if K_FP8:
                        kt = kt.to(q.dtype)
                        ks = tl.load(k_scale_ptr + slot * n_kvh + kvh, mask=kin, other=0.0).to(tl.float32)
                    if HAS_DELTA:
                        dl = tl.load(tile_delta_ptr + j)
                        if dl != cur:
                            # A new span: rotate the queries once for all of its tiles.
                            ang = dl.to(tl.float32) * freq
                            c = tl.cos(ang)[None, :]
                            sn = (tl.sin(ang) * sign)[None, :]
                            if KEEP_Q:
                                qc = (q.to(tl.float32) * c + q_sw.to(tl.float32) * sn).to(q.dtype)
                            else:
                                # Re-read (L2) rather than held: at BLOCK_M = 128 a second and third
                                # [BLOCK_M, D] operand in registers spill inside this loop.
                                qa = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
                                qs = tl.load(swap_ptrs, mask=row_ok[:, None], other=0.0)
                                qc = (qa.to(tl.float32) * c + qs.to(tl.float32) * sn).to(qa.dtype)
                            cur = dl
                        s = tl.dot(qc, tl.trans(kt), input_precision=PREC)
                    else:
                        s = tl.dot(q, tl.trans(kt), input_precision=PREC)
                    if K_FP8:
                        s = s * (ks * qk_scale)[None, :]
                    else:
                        s = s * qk_scale
                    if HAS_REPAIR:
                        if grp == 0:
                            s = s * inv_t
                        s = tl.where(mine, s, float("-inf"))
                    full = (k0 >= f_lo) & (k0 + BLOCK_N <= tl.minimum(k1, f_hi))
                    if not full:
                        vis = kk[None, :] <= t[:, None]
                        if HAS_PLUS:
                            vis = ((kk[None, :] >= seg[:, None]) & vis) | (kk[None, :] < anc[:, None])
                        s = tl.where(vis & kin[None, :], s, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    alpha = tl.exp2(m_i - m_new)
                    p = tl.exp2(s - m_new[:, None])
                    l_i = l_i * alpha + tl.sum(p, 1)
                    v = tl.load(v_ptrs, mask=kin[:, None], other=0.0)
                    if V_FP8:
                        v = v.to(q.dtype)
                        p = p * tl.load(v_scale_ptr + slot * n_kvh + kvh, mask=kin, other=0.0).to(tl.float32)[None, :]
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
                    m_i = m_new
        if HAS_REPAIR and grp == 0:
            has = l_i > 0.0
            l_c = tl.where(has, l_i, 1.0)
            if SPLIT:
                cell = ((share * 2) * n_loc + loc) * n_heads + head
                tl.store(part_lse_ptr + cell, tl.where(has, m_i + tl.log2(l_c), float("-inf")), mask=row_ok)
                tl.store(part_o_ptr + cell[:, None] * D + dd[None, :], acc / l_c[:, None], mask=row_ok[:, None])
                tl.store(part_ts_ptr + 2 * loc, 1.0 / inv_t + tl.zeros_like(l_c), mask=row_ok)
                tl.store(part_ts_ptr + 2 * loc + 1, log_s + tl.zeros_like(l_c), mask=row_ok)
                acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
                m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
                l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
            else:
                acc = acc / l_c[:, None]
                m_i = tl.where(has, (m_i + tl.log2(l_c)) / inv_t + log_s, -1.0e30)
                l_i = tl.where(has, 1.0, 0.0)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    if SPLIT:
        if HAS_REPAIR:
            cell = ((share * 2 + 1) * n_loc + loc) * n_heads + head
        else:
            cell = (share * n_loc + loc) * n_heads + head
        # A share with no visible key weighs nothing in the combine.
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + cell, lse, mask=row_ok)
        tl.store(part_o_ptr + cell[:, None] * D + dd[None, :], o, mask=row_ok[:, None])
    else:
        o_rows = tok.to(tl.int64) * stride_ot + head * D
        tl.store(out_ptr + o_rows[:, None] + dd[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merged(part_o_ptr, part_lse_ptr, loc, hh, h_ok, n_loc, n_heads, n_split, groups, g,
            D: tl.constexpr, BLOCK_H: tl.constexpr):
    """(log2-sum-exp, output) of group g's shares (2^lse_s-weighted); lse -inf where none counts."""
    dd = tl.arange(0, D)
    m = tl.full((BLOCK_H,), -1.0e30, dtype=tl.float32)
    den = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, D), dtype=tl.float32)
    for s in range(n_split):
        cell = ((s * groups + g) * n_loc + loc).to(tl.int64) * n_heads + hh
        lse = tl.load(part_lse_ptr + cell, mask=h_ok, other=float("-inf"))
        o = tl.load(part_o_ptr + cell[:, None] * D + dd[None, :], mask=h_ok[:, None], other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        den = den * alpha + w
        acc = acc * alpha[:, None] + w[:, None] * o
        m = m_new
    safe = tl.where(den > 0.0, den, 1.0)
    return tl.where(den > 0.0, m + tl.log2(safe), float("-inf")), acc / safe[:, None]


@triton.jit
def combine_kernel(
    part_o_ptr, part_lse_ptr, part_ts_ptr, tokens_ptr, out_ptr, n_loc, n_heads, stride_ot, n_split,
    D: tl.constexpr, BLOCK_H: tl.constexpr, REPAIR: tl.constexpr,
):
    """out[tokens[i], h] = sum_s w_s o_s / sum_s w_s with w_s = 2^lse_s: merges the shares of a
    split launch for launch-local token `program_id(0)` and BLOCK_H heads. REPAIR: each share
    wrote its context keys' result (group 0, in the scores / T domain) and the others' (group 1);
    group 0, merged, weighs as one key of logit T * lse + log scale (part_ts: T, log scale)."""
    loc = tl.program_id(0)
    # tokens < 0: a padding index of a fixed-size (graph) launch, which no share wrote
    tok = tl.load(tokens_ptr + loc).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hh < tl.where(tok >= 0, n_heads, 0)
    dd = tl.arange(0, D)
    if REPAIR:
        lse_c, o_c = _merged(part_o_ptr, part_lse_ptr, loc, hh, h_ok, n_loc, n_heads, n_split, 2, 0, D, BLOCK_H)
        lse_o, o_o = _merged(part_o_ptr, part_lse_ptr, loc, hh, h_ok, n_loc, n_heads, n_split, 2, 1, D, BLOCK_H)
        temp = tl.load(part_ts_ptr + 2 * loc, mask=tok >= 0, other=1.0)
        log_s = tl.load(part_ts_ptr + 2 * loc + 1, mask=tok >= 0, other=0.0)
        lam = tl.where(lse_c > float("-inf"), lse_c * temp + log_s, float("-inf"))
        top = tl.maximum(tl.maximum(lam, lse_o), -1.0e30)
        w_c = tl.exp2(lam - top)
        w_o = tl.exp2(lse_o - top)
        den = w_c + w_o
        res = (w_c[:, None] * o_c + w_o[:, None] * o_o) / tl.where(den > 0.0, den, 1.0)[:, None]
    else:
        _, res = _merged(part_o_ptr, part_lse_ptr, loc, hh, h_ok, n_loc, n_heads, n_split, 1, 0, D, BLOCK_H)
    tl.store(out_ptr + tl.maximum(tok, 0) * stride_ot + (hh * D)[:, None] + dd[None, :],
             res.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


@triton.jit
def rotate_keys_kernel(
    k_cache_ptr, k_scale_ptr, out_ptr, slots_ptr, delta_ptr, inv_freq_ptr, count_ptr, n_keys, stride_cs,
    v_cache_ptr, v_scale_ptr, v_out_ptr,
    KVH: tl.constexpr, D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KVH: tl.constexpr,
    COUNTED: tl.constexpr, K_FP8: tl.constexpr, HAS_V: tl.constexpr,
):
    """out[i] = R(delta[i]) k_cache[slots[i]] for every head: the deferred rotation done once per
    layer for a prefill launch. Programs stride over the keys BLOCK_K at a time; COUNTED reads the
    key count from count_ptr (a graph's fixed-size launch), else it is n_keys. Angles are computed
    on [BLOCK_K, 1, HALF] and broadcast over the heads, so each (key, frequency) costs one sin/cos."""
    HALF: tl.constexpr = D // 2
    if COUNTED:
        n_keys = tl.load(count_ptr)
    hh = tl.arange(0, BLOCK_KVH)
    i = tl.arange(0, HALF)
    col = (hh * D)[None, :, None] + i[None, None, :]
    freq = tl.load(inv_freq_ptr + i)[None, None, :]
    for k0 in range(tl.program_id(0) * BLOCK_K, n_keys, tl.num_programs(0) * BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < n_keys
        slot = tl.load(slots_ptr + kk, mask=k_ok, other=0).to(tl.int64)
        ang = tl.load(delta_ptr + kk, mask=k_ok, other=0).to(tl.float32)
        m = k_ok[:, None, None] & (hh < KVH)[None, :, None]
        src = k_cache_ptr + slot[:, None, None] * stride_cs + col
        k1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        k2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        if K_FP8:  # an 8-bit cache: the rows dequantized (exactly) before they turn
            ks = tl.load(k_scale_ptr + slot[:, None, None] * KVH + hh[None, :, None],
                         mask=m, other=0.0).to(tl.float32)
            k1 = k1 * ks
            k2 = k2 * ks
        a = ang[:, None, None] * freq
        c = tl.cos(a)
        sn = tl.sin(a)
        dst = out_ptr + kk.to(tl.int64)[:, None, None] * stride_cs + col
        tl.store(dst, (k1 * c - k2 * sn).to(out_ptr.dtype.element_ty), mask=m)
        tl.store(dst + HALF, (k2 * c + k1 * sn).to(out_ptr.dtype.element_ty), mask=m)
        if HAS_V:  # an 8-bit cache's values, dequantized into the launch's V scratch (no rotation)
            vsrc = v_cache_ptr + slot[:, None, None] * stride_cs + col
            vs = tl.load(v_scale_ptr + slot[:, None, None] * KVH + hh[None, :, None], mask=m, other=0.0)
            vs = vs.to(tl.float32)
            vdst = v_out_ptr + kk.to(tl.int64)[:, None, None] * stride_cs + col
            v1 = tl.load(vsrc, mask=m, other=0.0).to(tl.float32) * vs
            tl.store(vdst, v1.to(v_out_ptr.dtype.element_ty), mask=m)
            v2 = tl.load(vsrc + HALF, mask=m, other=0.0).to(tl.float32) * vs
            tl.store(vdst + HALF, v2.to(v_out_ptr.dtype.element_ty), mask=m)


@triton.jit
def kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    n_tokens, stride_kt, stride_vt, stride_cs,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """Scatter BLOCK_T tokens' K and V rows (W = KVH * D contiguous elements) to their slots; a
    slot < 0 (a padding token of a fixed-size graph step) is not written."""
    tt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ww = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    slot = tl.load(slots_ptr + tt, mask=tt < n_tokens, other=-1).to(tl.int64)
    t_ok = slot >= 0
    m = t_ok[:, None] & (ww[None, :] < W)
    tt64 = tt.to(tl.int64)
    k = tl.load(k_ptr + tt64[:, None] * stride_kt + ww[None, :], mask=m)
    v = tl.load(v_ptr + tt64[:, None] * stride_vt + ww[None, :], mask=m)
    dst = slot[:, None] * stride_cs + ww[None, :]
    tl.store(k_cache_ptr + dst, k, mask=m)
    tl.store(v_cache_ptr + dst, v, mask=m)


@triton.jit
def reposition_kernel(
    k_ptr, v_ptr, jobs_ptr, cos_ptr, sin_ptr,
    stride_layer, stride_block,
    KVH: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Job `program_id(0)`, layer `program_id(1)`: copy the first n slots of block src to block
    dst, K rotated forward by the job's delta (R(d) R(p) k = R(p + d) k) and V as is.

    K is handled as the two halves of every head: each thread loads both halves of the pairs it
    writes, so a job may rotate a block in place without a barrier, and both loads stay 16-byte
    vectors."""
    HALF: tl.constexpr = D // 2
    W: tl.constexpr = KVH * D
    job = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    src = tl.load(jobs_ptr + job * 4).to(tl.int64)
    dst = tl.load(jobs_ptr + job * 4 + 1).to(tl.int64)
    n = tl.load(jobs_ptr + job * 4 + 2)
    rot = tl.load(jobs_ptr + job * 4 + 3)
    ss = tl.arange(0, BLOCK_S)
    src_base = layer * stride_layer + src * stride_block
    dst_base = layer * stride_layer + dst * stride_block

    ww = tl.arange(0, BLOCK_H * 2)
    mv = (ss[:, None] < n) & (ww[None, :] < W)
    off = ss[:, None] * W + ww[None, :]
    tl.store(v_ptr + dst_base + off, tl.load(v_ptr + src_base + off, mask=mv), mask=mv)

    hh = tl.arange(0, BLOCK_H)
    i = hh % HALF
    m = (ss[:, None] < n) & (hh[None, :] < KVH * HALF)
    off1 = ss[:, None] * W + ((hh // HALF) * D + i)[None, :]
    k1 = tl.load(k_ptr + src_base + off1, mask=m)
    k2 = tl.load(k_ptr + src_base + off1 + HALF, mask=m)
    if rot != 0:
        c = tl.load(cos_ptr + job * HALF + i)[None, :]
        sn = tl.load(sin_ptr + job * HALF + i)[None, :]
        a1 = k1.to(tl.float32)
        a2 = k2.to(tl.float32)
        k1 = (a1 * c - a2 * sn).to(k1.dtype)
        k2 = (a2 * c + a1 * sn).to(k1.dtype)
    tl.store(k_ptr + dst_base + off1, k1, mask=m)
    tl.store(k_ptr + dst_base + off1 + HALF, k2, mask=m)
