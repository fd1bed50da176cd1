"""The judge-admission fast paths against plain ones on random inputs: seeds hashed through the
exact-type shortcut, chains hashed from known keys, and whole admissions (the memos a finished
generation seeds on release, tail keys, bulk runs of hits, one-pass eager reposition, segment
tables cut from the main one, decode tables grown in place of rebuilt) against the per-block code
they replaced, on judges over just finished generations. The pool's and the token checks' fast
paths are in test_admission_fast.py."""
from __future__ import annotations

import enum
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_admission_fast import admit, reference_plan  # noqa: E402  (block by block, partials scanned)

from spanserve.cache import hashing
from spanserve.cache.block_pool import BlockPool
from spanserve.cache.claim import Piece, Task
from spanserve.cache.manager import CacheManager, _all_hit, _Plan
from spanserve.cache.units import Holding
from spanserve.engine.params import SamplingParams
from spanserve.engine.request import Request
from spanserve.reuse.policies import resolve_policy
from spanserve.reuse.recompute import RecomputeSpec

VOCAB = 40


def _packed(toks) -> bytes:
    return np.asarray(toks, dtype="<i4").tobytes()


# ---- hashing -----------------------------------------------------------------------------------
def plain_encode(part) -> bytes:
    """_encode_part as it was, one isinstance chain for every part."""
    if isinstance(part, (bytes, bytearray, memoryview)):
        tag, payload = b"b", bytes(part)
    elif isinstance(part, str):
        tag, payload = b"s", part.encode("utf-8")
    elif isinstance(part, (int, np.integer)):
        n = int(part)
        tag, payload = b"i", n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    else:
        tag, payload = b"t", np.asarray(part, dtype="<i4").tobytes()
    return tag + len(payload).to_bytes(8, "little") + payload


class Str(str):
    pass


class Flag(enum.IntEnum):
    A = 7


PARTS = st.one_of(st.integers(-2**130, 2**130), st.text(max_size=8), st.binary(max_size=8), st.booleans(),
                  st.integers(-5, 5).map(np.int64), st.just(Flag.A), st.text(max_size=4).map(Str),
                  st.lists(st.integers(0, 2**31 - 1), max_size=6))


@given(st.text(max_size=6), st.lists(PARTS, max_size=7))
@settings(max_examples=300, deadline=None)
def test_seed_matches_plain_encoding(ns, parts):
    want = hashing._h(b"S" + plain_encode(ns) + b"".join(plain_encode(p) for p in parts))
    assert hashing.seed(ns, *parts) == want


def plain_chain(seed: int, tokens, bs: int, include_partial: bool) -> list[int]:
    end = len(tokens) if include_partial else len(tokens) - len(tokens) % bs
    keys, parent = [], seed
    for s in range(0, end, bs):
        parent = hashing.block_key(parent, list(tokens[s:s + bs]))
        keys.append(parent)
    return keys


@given(st.lists(st.integers(0, VOCAB - 1), max_size=90), st.integers(1, 6), st.booleans(), st.data())
@settings(max_examples=200, deadline=None)
def test_chain_keys_from_known_keys(tokens, bs, partial, data):
    seed = hashing.seed("k", bs)
    want = plain_chain(seed, tokens, bs, partial)
    full = plain_chain(seed, tokens, bs, False)
    known = full[:data.draw(st.integers(0, len(full)))]
    hashing._MEMO.clear()
    assert hashing.chain_keys(seed, tokens, bs, partial, known=known) == want
    hashing._MEMO.clear()
    hashing.remember_chain(seed, tokens, bs, known)
    # what a segment reading these tokens asks for, answered from the memo if it was filled
    assert hashing.chain_keys(seed, np.asarray(tokens, "<i4"), bs, include_partial=True) == \
        plain_chain(seed, tokens, bs, True)


# ---- whole admissions: fast manager against the per-block one ------------------------------------
class _Storage:
    def __init__(self) -> None:
        self.log: list[tuple] = []

    def copy(self, src: int, dst: int, n: int) -> None:
        self.log.append(("copy", src, dst, n))

    def copy_many(self, jobs) -> None:
        for job in jobs:
            self.copy(*job)

    def copy_rotated(self, src, dst, delta, rotary) -> None:
        self.log.append(("rotated", list(src), list(dst), delta))


def plain_entries(units) -> np.ndarray:
    return np.array([(b.id, u.delta, n) for u in units for b, n in zip(u.blocks, u.n_valid)], np.int64).reshape(-1, 3)


class PlainManager(CacheManager):
    """Admission, tasks, decode growth and release block by block, as before the fast paths:
    chains hashed per block, tails rehashed, partials scanned, no memos seeded on release."""

    def _units(self, adm):
        units = super()._units(adm)
        for u in units + [u.source for u in units if u.source is not None]:
            assert u.keys == plain_chain(u.seed, u.tokens, self.block_size, False)  # the memo's answer
            u.tail_key = None
        return units

    def _plan_unit(self, seed, tokens, keys, extended, packed=None, tail_key=None):
        return reference_plan(self, seed, tokens, keys, extended)

    def admit(self, adm):
        units = self._units(adm)
        plans = [self._plan_unit(u.seed, u.tokens, u.keys, u.final) for u in units]
        sources = []
        if any(u.source is not None for u in units) and not _all_hit(units, plans, self.block_size):
            first = next(i for i, u in enumerate(units) if u.source is not None)
            for i in range(first, len(units)):
                n = len(plans[i].shared)
                plans[i] = _Plan([None] * n, dict.fromkeys(range(n), (None, 0)))
            sources = [u.source for u in units if u.source is not None]
        plans += [self._plan_unit(u.seed, u.tokens, u.keys, False) for u in sources]
        touched = [b if b is not None else plan.copies[i][0] for plan in plans for i, b in enumerate(plan.shared)]
        touched = [b for b in touched if b is not None]
        for b in touched:
            self.pool.acquire(b)
        eager = [i for i, (u, plan) in enumerate(zip(units, plans)) if self.reposition == "eager"
                 and u.plus and u.delta and not plan.copies]
        n_fresh = sum(len(plan.copies) for plan in plans) + sum(len(plans[i].shared) for i in eager)
        if self.pool.num_free < n_fresh:
            for b in touched:
                self.pool.release(b)
            return None
        req = Holding()
        reuse = {"prefix": 0, "perforated": 0, "segment": 0, "computed": 0}
        contiguous, bs = True, self.block_size
        for u, plan in zip(units + sources, plans):
            for i, b in enumerate(plan.shared):
                n_tok = min(bs, len(u.tokens) - i * bs)
                got = n_tok
                if b is None:
                    src, got = plan.copies[i]
                    b = self.pool.allocate()
                    if src is not None:
                        self.storage.copy(src.id, b.id, got)
                        self.pool.release(src)
                    u.fresh.append(i)
                    u.todo.extend(range(i * bs + got, i * bs + n_tok))
                req.held.append(b)
                u.blocks.append(b)
                u.n_valid.append(n_tok)
                reuse["segment" if u.plus else ("prefix" if contiguous else "perforated")] += got
                contiguous = contiguous and got == n_tok
            if u.source is None or not sources:
                reuse["computed"] += len(u.todo)
        for i in eager:
            u = units[i]
            copies = [self.pool.allocate() for _ in u.blocks]
            self.storage.copy_rotated([b.id for b in u.blocks], [b.id for b in copies], u.delta, self.rotary)
            for b in u.blocks:
                req.held.remove(b)
                self.pool.release(b)
            req.held.extend(copies)
            u.blocks, u.local_start = copies, u.start
        req.reuse = reuse
        req.units, req.sources = units, sources
        req.tasks = self._plain_tasks(adm, units, sources)
        return req

    def _plain_tasks(self, req, units, sources):
        bs = self.block_size
        entries = plain_entries(units)
        tokens = req.tokens
        first_plus = next((i for i, u in enumerate(units) if u.plus or u.source is not None), len(units))
        before = [u.start + p for u in units[:first_plus] for p in u.todo]
        after = [u.start + p for u in units[first_plus:] if not u.plus for p in u.todo]
        tasks = [Task(tokens, entries, before, bs, main=True)] if first_plus < len(units) and before else []
        anchor = [tuple(r) for r in entries[: sum(len(u.blocks) for u in units[:first_plus])].tolist()]
        for u in units + sources:
            if u.plus and u.todo:
                head, left = [], u.local_start
                for b, d, n in anchor:
                    if left <= 0:
                        break
                    head.append((b, d, min(n, left)))
                    left -= n
                rows = head + [(b.id, 0, n) for b, n in zip(u.blocks, u.n_valid)]
                u.task = Task(tokens[:u.local_start] + list(u.tokens), np.array(rows, np.int64).reshape(-1, 3),
                              [u.local_start + p for p in u.todo], bs)
                tasks.append(u.task)
        spec = None
        if sources:
            spec = RecomputeSpec(req.policy, [u.start + p for u in units if u.source is not None for p in range(len(u.tokens))],
                                 [b.id * bs + o for u in sources for b, n in zip(u.blocks, u.n_valid) for o in range(n)],
                                 [u.delta for u in sources for _ in u.tokens])
        main_todo = after if first_plus < len(units) else before
        tasks.append(Task(tokens, entries, main_todo, bs, sample=not req.encode_only, main=True, recompute=spec))
        return tasks

    def ensure_capacity(self, req):
        task, u, bs = req.main, req.units[-1], self.block_size
        need = len(task.tokens) - (u.start + sum(u.n_valid))
        if need <= 0:
            return True
        grow = min(need, bs - u.n_valid[-1])
        n_new = -(-(need - grow) // bs)
        if self.pool.num_free < n_new:
            return False
        u.n_valid[-1] += grow
        need -= grow
        for _ in range(n_new):
            b = self.pool.allocate()
            req.held.append(b)
            u.fresh.append(len(u.blocks))
            u.blocks.append(b)
            u.n_valid.append(min(bs, need))
            need -= min(bs, need)
        task.set_entries(plain_entries(req.units))
        return True

    def release(self, req):
        if req.tasks:
            self.publish(req, tail=True)
        self.pool.release_many(req.held)
        req.held, req.tasks, req.units, req.sources = [], [], [], []


def _snap(m: CacheManager, req: Request | None = None) -> tuple:
    pool = m.pool
    state = ([b.ref_cnt for b in pool.blocks], [b.id for b in pool.free_blocks()],
             sorted((k, b.id) for k, b in pool._index.items()), list(m.storage.log))
    if req is None:
        return state
    tasks = [(list(t.tokens), list(t.todo), np.asarray(t.entries).tolist(), t.sample, t.main, None if t.recompute is None
              else (t.recompute.reused, t.recompute.src_slots, t.recompute.src_delta)) for t in req.tasks]
    units = [(u.keys, [b.id for b in u.blocks], u.n_valid, u.todo, u.fresh, u.start, u.local_start)
             for u in req.units + req.sources]
    return state, tasks, units, [b.id for b in req.held], dict(req.reuse)


def _step(m: CacheManager, req: Request, tok: int, first: bool) -> None:
    """One engine step of a running request: its todo computed, one token sampled."""
    for t in req.tasks:
        t.todo.clear()
    if first:
        m.snapshot_prompt_tail(req.kv)
    req.output_token_ids.append(tok)
    req.main.tokens.append(tok)
    req.main.todo.append(len(req.main.tokens) - 1)


def generation_wave(m: CacheManager, rng: random.Random, step: int, prompts: list[list[int]], rand,
                    trace: list, convs: list[list[int]]) -> None:
    """Generations (several sharing a prompt) stepped together until each reaches its length,
    finishing with its last token uncomputed; finished conversations are appended to convs."""
    live = []
    for j in range(rng.randrange(1, 5)):
        p = rng.choice(prompts) if rng.random() < 0.7 else rand(2, 14)
        req = Request(f"g{step}.{j}", p, SamplingParams(),
                      pieces=[Piece("cross", tuple(p), 0, packed=_packed(p) if rng.random() < 0.7 else None)])
        if admit(m, req):
            live.append((req, rng.randrange(1, 30)))
            trace.append(_snap(m, req))
    for k in range(30):
        for req, n in list(live):
            if k and not m.ensure_capacity(req.kv):
                m.release(req.kv)
                live.remove((req, n))
                continue
            _step(m, req, rng.randrange(VOCAB), k == 0)
            if len(req.output_token_ids) < n:
                m.publish(req.kv)
                continue
            m.release(req.kv)
            live.remove((req, n))
            convs.append(req.prompt_token_ids + req.output_token_ids)
    trace.append(_snap(m))


def judge_request(rng: random.Random, step: int, heads: list[list[int]], chosen: list[list[int]],
                  convs: list[list[int]], rand) -> tuple[Request, list[list[int]]]:
    """A judge: an optional cross head, conversations as plus segments (new ones, or the last
    judge's reordered; some edited, some anchored on the head), a question; policy none or
    cacheblend. Returns it and the conversations it chose."""
    pieces = [Piece("cross", tuple(h), 0, packed=_packed(h)) for h in [rng.choice(heads)] if rng.random() < 0.8]
    pos = sum(len(p.tokens) for p in pieces)
    if not chosen or rng.random() < 0.5:  # else: the last judge's conversations, reordered
        chosen = [rng.choice(convs) for _ in range(rng.randrange(1, 5))]
    rng.shuffle(chosen)
    for c in [list(c) for c in chosen]:
        if rng.random() < 0.15:
            c[rng.randrange(len(c))] = rng.randrange(VOCAB)  # an edited copy: perforated
        a = pieces[0].end if pieces and pieces[0].kind == "cross" and rng.random() < 0.2 else 0
        pieces.append(Piece("plus", tuple(c), pos, a, packed=_packed(c)))
        pos += len(c)
    q = rand(1, 9)
    pieces.append(Piece("cross", tuple(q), pos, packed=_packed(q)))
    pol = resolve_policy(rng.choice(["none", "none", "cacheblend"]))
    return Request(f"j{step}", [t for p in pieces for t in p.tokens], SamplingParams(), pieces=pieces, policy=pol), chosen


def run_judge(m: CacheManager, rng: random.Random, req: Request, trace: list, stats: dict) -> None:
    """Admit a judge; mostly compute it and take a few decode steps, sometimes preempt it."""
    if not admit(m, req):
        trace.append(_snap(m))
        return
    stats["tail_encodes"] += sum(1 for u in req.units if u.plus and u.todo)
    trace.append(_snap(m, req))
    if rng.random() < 0.8:  # computed, then a few decode steps (the table grows)
        for k in range(rng.randrange(6)):
            if k and not m.ensure_capacity(req.kv):
                break
            _step(m, req, rng.randrange(VOCAB), k == 0)
            m.publish(req.kv)
            trace.append(_snap(m, req))
        if rng.random() < 0.3:  # preempted, admitted again with its output
            m.release(req.kv)
            req.num_preemptions += 1
            trace.append(_snap(m, req) if admit(m, req) else _snap(m))
    m.release(req.kv)
    trace.append(_snap(m))


def scenario(m: CacheManager, seed: int, stats: dict) -> list:
    """Waves of generations (several sharing a prompt, stepped together, finishing with their
    last token uncomputed), then judges over their conversations: the state after each move."""
    rng = random.Random(seed)
    trace: list = []
    convs: list[list[int]] = []
    chosen: list[list[int]] = []
    rand = lambda lo, hi: [rng.randrange(VOCAB) for _ in range(rng.randrange(lo, hi))]  # noqa: E731
    prompts, heads = [rand(2, 14) for _ in range(3)], [rand(1, 7) for _ in range(2)]
    for step in range(14):
        if step % 3 == 0 or not convs:
            generation_wave(m, rng, step, prompts, rand, trace, convs)
            continue
        req, chosen = judge_request(rng, step, heads, chosen, convs, rand)
        run_judge(m, rng, req, trace, stats)
    stats["rotated"] += sum(1 for e in m.storage.log if e[0] == "rotated")
    return trace


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("reposition", ["deferred", "eager"])
def test_admission_matches_plain(seed, reposition):
    rng = random.Random(seed)
    bs, n_blocks = rng.choice([2, 4]), rng.randrange(80, 240)
    stats = {"tail_encodes": 0, "rotated": 0}
    hashing._MEMO.clear()
    got = scenario(CacheManager(BlockPool(n_blocks), _Storage(), bs, reposition), seed, stats)
    want = scenario(PlainManager(BlockPool(n_blocks), _Storage(), bs, reposition), seed, dict(stats))
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"move {i}"
    # the paths this is about were taken: judges encoding a generation's last token, and
    # (eager) fully cached segments rotated to their new place
    assert stats["tail_encodes"] > 0 and (reposition == "deferred" or stats["rotated"] > 0), stats
