"""Cache manager: turns a request's layout into units (chains of blocks), looks each unit up
(prefix, perforated, partial-block and segment hits), allocates what misses, builds the tasks
that compute the holes, publishes computed blocks and releases them."""
from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from spanserve.cache import hashing
from spanserve.cache.block_pool import Block, BlockPool
from spanserve.cache.storage import KVStorage
from spanserve.cache.table import Table, truncate
from spanserve.engine.layout import Piece
from spanserve.engine.request import Request, Task
from spanserve.reuse.recompute import RecomputeSpec


class _Plan(NamedTuple):
    """How a unit gets its blocks: block i shares the cached block `shared[i]`, or (None) is a
    fresh one whose first `copy_n` slots are copied from `src`, `copies[i] = (src, copy_n)`
    (src: a cached block holding a prefix of its tokens, or None). Columns rather than one
    object per block: a warm layout is thousands of shared blocks and no copies."""

    shared: list[Block | None]
    copies: dict[int, tuple[Block | None, int]]


_ID = operator.attrgetter("id")


@dataclass
class Unit:
    """A token run of the main table cached as one chain. Plus units are standalone segments
    stored at local positions from `local_start`; the others are the request's own runs, stored at
    their logical positions. The final unit is the one generation extends."""

    seed: int
    start: int
    local_start: int
    plus: bool
    final: bool
    tokens: Sequence[int]
    blocks: list[Block] = field(default_factory=list)
    n_valid: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    fresh: list[int] = field(default_factory=list)  # block indices this request publishes
    todo: list[int] = field(default_factory=list)  # unit-relative positions to compute
    task: Task | None = None  # encode task of a plus unit with holes
    source: "Unit | None" = None  # under a selective policy: the shared segment this run recomputes
    packed: bytes | None = field(default=None, repr=False)  # the tokens as int32 LE, if the piece had them

    @property
    def delta(self) -> int:
        return self.start - self.local_start


def computed_upto(tasks: list[Task]) -> int:
    """Main-row positions before this have KV: todo lists are consumed in order."""
    heads = [t.todo[0] for t in tasks if t.todo]
    return min(heads) if heads else len(tasks[-1].tokens)


class CacheManager:
    def __init__(self, pool: BlockPool, storage: KVStorage, block_size: int,
                 reposition: str = "deferred", rotary: object = None):
        if reposition not in ("deferred", "eager"):
            raise ValueError(f"reposition must be 'deferred' or 'eager', got {reposition!r}")
        self.pool = pool
        self.storage = storage
        self.block_size = block_size
        # eager: a fully hit segment at a new position is copied into private blocks rotated
        # there (SparseX, LMCache, CIDRA); deferred (default): one copy, rotated when read.
        self.reposition = reposition
        self.rotary = rotary

    # ---- lookup ---------------------------------------------------------------------------
    def _probe_partial(self, parent: int, toks: Sequence[int], longest: int) -> tuple[Block | None, int]:
        """The cached block holding the longest prefix (<= longest tokens) of `toks`: a unit that
        ended inside this block (an earlier turn, a finished generation) left it behind."""
        best, got = None, 0
        for b in self.pool.partials(parent):
            n = len(b.tokens)
            if got < n <= longest and b.tokens == tuple(toks[:n]):
                best, got = b, n
        return best, got

    def _plan_unit(self, seed: int, tokens: Sequence[int], keys: list[int], extended: bool,
                   packed: bytes | None = None) -> _Plan:
        """Never stops at the first miss: a chained key after a gap still hits (perforated).
        An `extended` unit (generation continues it; its final token's logits are needed) keeps
        its last block private: copied from a hit, never shared."""
        bs = self.block_size
        n_blocks = -(-len(tokens) // bs)
        hits = self.pool.lookup_chain(keys, tokens, bs, packed)  # the full blocks, in one pass
        shared: list[Block | None] = hits + [None] * (n_blocks - len(hits))
        if extended:
            shared[-1] = None
        copies: dict[int, tuple[Block | None, int]] = {}
        # every full block hit (blocks are truthy): only a partial tail can be left to look at
        first = len(hits) if all(hits) else 0
        if extended:
            first = min(first, n_blocks - 1)
        for i in range(first, n_blocks):
            if shared[i] is not None:
                continue
            toks = tokens[i * bs:(i + 1) * bs]
            parent = keys[i - 1] if i else seed
            last = i == n_blocks - 1
            key = keys[i] if len(toks) == bs else hashing.block_key(parent, toks)
            hit = self.pool.lookup(key, toks)
            if hit is not None and not (extended and last):
                shared[i] = hit
                continue
            keep = len(toks) - 1 if (extended and last) else len(toks)
            if hit is not None:
                copies[i] = (hit, keep)
                continue
            copies[i] = self._probe_partial(parent, toks, min(keep, len(toks) - 1))
        return _Plan(shared, copies)

    # ---- admission ------------------------------------------------------------------------
    def _units(self, req: Request, pieces: list[Piece]) -> list[Unit]:
        ns = req.namespace
        plain = hashing.seed(ns)
        units: list[Unit] = []
        link = plain
        prefix = pieces[0].tokens if pieces[0].kind == "cross" else ()
        selective = req.policy is not None and req.policy.selective
        policy_key = req.policy.key if req.policy is not None else "none"
        bs = self.block_size
        for i, p in enumerate(pieces):
            final = i == len(pieces) - 1 and not req.encode_only
            toks = p.tokens
            seg = None
            if p.kind == "plus":
                # anchor none: exactly a plain causal encoding, so finished generations hit it
                seed = plain if p.anchor_len == 0 else hashing.seed(ns, "anchor", prefix[: p.anchor_len])
                seg = Unit(seed, p.start, p.anchor_len, True, final, toks, packed=p.packed)
                seg.keys, digest = _keys(seed, toks, bs, p.packed)
            if seg is not None and not selective:
                u = seg
            else:  # the request's own run; a recomputed segment's KV is request-specific too
                u = Unit(link, p.start, p.start, False, final, toks, source=seg, packed=p.packed)
                u.keys, digest = _keys(link, toks, bs, p.packed)
            # whatever follows depends on this unit's content and place: chain it into the link
            link = hashing.seed(ns, "span", policy_key, link, digest, p.start, p.anchor_len)
            units.append(u)
        return units

    def admit(self, req: Request) -> bool:
        """Give a waiting request its blocks and tasks. False (and nothing changed) when the pool
        cannot hold it now."""
        units = self._units(req, req.current_pieces())
        plans = [self._plan_unit(u.seed, u.tokens, u.keys, u.final, u.packed) for u in units]
        sources: list[Unit] = []
        if any(u.source is not None for u in units) and not _all_hit(units, plans, self.block_size):
            # The policy recomputes from the shared copies: every run from the first recomputed
            # segment on is produced by one selective forward, into fresh private blocks.
            first = next(i for i, u in enumerate(units) if u.source is not None)
            for i in range(first, len(units)):
                n = len(plans[i].shared)
                plans[i] = _Plan([None] * n, dict.fromkeys(range(n), (None, 0)))
            sources = [u.source for u in units if u.source is not None]
        units_all = units + sources
        plans += [self._plan_unit(u.seed, u.tokens, u.keys, False, u.packed) for u in sources]
        touched = _touched(plans)
        self.pool.acquire_many(touched)  # hold hits and copy sources so allocation cannot evict them
        eager = [i for i, (u, plan) in enumerate(zip(units, plans)) if self.reposition == "eager"
                 and u.plus and u.delta and not plan.copies]
        n_fresh = sum(len(plan.copies) for plan in plans)
        n_fresh += sum(len(plans[i].shared) for i in eager)
        if self.pool.num_free < n_fresh:
            self.pool.release_many(touched)
            return False
        req.held = []
        reuse = {"prefix": 0, "perforated": 0, "segment": 0, "computed": 0}
        contiguous = True
        bs = self.block_size
        for u, plan in zip(units_all, plans):
            n_blocks = len(plan.shared)
            if not plan.copies:  # wholly cached: no per-block work
                req.held.extend(plan.shared)  # type: ignore[arg-type]
                u.blocks.extend(plan.shared)  # type: ignore[arg-type]
                u.n_valid.extend([bs] * (n_blocks - 1) + [len(u.tokens) - (n_blocks - 1) * bs])
                reuse["segment" if u.plus else ("prefix" if contiguous else "perforated")] += len(u.tokens)
                continue
            for i, b in enumerate(plan.shared):
                n_tok = min(bs, len(u.tokens) - i * bs)
                if b is not None:
                    got = n_tok
                else:
                    src, copy_n = plan.copies[i]
                    b = self.pool.allocate()
                    if src is not None:
                        self.storage.copy(src.id, b.id, copy_n)
                        self.pool.release(src)
                    u.fresh.append(i)
                    got = copy_n
                    u.todo.extend(range(i * bs + got, i * bs + n_tok))
                req.held.append(b)
                u.blocks.append(b)
                u.n_valid.append(n_tok)
                kind = "segment" if u.plus else ("prefix" if contiguous else "perforated")
                reuse[kind] += got
                contiguous = contiguous and got == n_tok
            if u.source is None or not sources:  # a recomputed run is counted by its source
                reuse["computed"] += len(u.todo)
        for i in eager:
            self._reposition(req, units[i])
        if req.num_preemptions == 0:  # a resumed request reports how it was first served
            req.reuse = reuse
        req.units = units
        req.sources = sources
        req.tasks = self._tasks(req, units, sources)
        return True

    def _reposition(self, req: Request, u: Unit) -> None:
        """Replace a hit segment's shared blocks by private copies rotated to its position."""
        copies = [self.pool.allocate() for _ in u.blocks]
        self.storage.copy_rotated([b.id for b in u.blocks], [b.id for b in copies], u.delta, self.rotary)
        for b in u.blocks:
            req.held.remove(b)
            self.pool.release(b)
        req.held.extend(copies)
        u.blocks, u.local_start = copies, u.start

    def _tasks(self, req: Request, units: list[Unit], sources: list[Unit]) -> list[Task]:
        """Main-row work before the first plus unit, then each plus unit's encoding (it may read
        that prefix as its anchor), then the rest of the main row (it reads the segments)."""
        bs = self.block_size
        entries = self.entries(units)
        # the units are the current pieces, which cover the prompt and then the output in order
        tokens = req.prompt_token_ids + req.output_token_ids
        assert len(tokens) == units[-1].start + len(units[-1].tokens)
        first_plus = next((i for i, u in enumerate(units) if u.plus or u.source is not None), len(units))
        before = [u.start + p for u in units[:first_plus] for p in u.todo]
        after = [u.start + p for u in units[first_plus:] if not u.plus for p in u.todo]
        tasks: list[Task] = []
        if first_plus < len(units) and before:
            tasks.append(Task(tokens, entries, before, bs, main=True))
        anchor_entries = entries[: sum(len(u.blocks) for u in units[:first_plus])]
        for u in units + sources:
            if u.plus and u.todo:
                a = u.local_start
                seg_entries = _table([u], local=True)
                u.task = Task(tokens[:a] + list(u.tokens), np.concatenate([truncate(anchor_entries, a), seg_entries]),
                              [a + p for p in u.todo], bs)
                tasks.append(u.task)
        main_todo = after if first_plus < len(units) else before
        spec = None
        if sources:
            reused = [u.start + p for u in units if u.source is not None for p in range(len(u.tokens))]
            src_slots = [b.id * bs + o for u in sources for b, n in zip(u.blocks, u.n_valid) for o in range(n)]
            src_delta = [u.delta for u in sources for _ in u.tokens]
            spec = RecomputeSpec(req.policy, reused, src_slots, src_delta)
        tasks.append(Task(tokens, entries, main_todo, bs, sample=not req.encode_only, main=True, recompute=spec))
        return tasks

    @staticmethod
    def entries(units: list[Unit]) -> Table:
        return _table(units)

    def ensure_capacity(self, req: Request) -> bool:
        """Room in the final unit for every token of the main task (decode growth)."""
        task = req.main
        u = req.units[-1]
        bs = self.block_size
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
        task.set_entries(self.entries(req.units))
        return True

    # ---- publication and release ----------------------------------------------------------
    def publish(self, req: Request, tail: bool = False) -> None:
        """Offer every computed block this request owns to the index. A unit's partial last block
        is keyed by its exact tokens once nothing will be appended to it, or with `tail` (the
        request is leaving: its generated text becomes a reusable unit)."""
        main_tasks = [t for t in req.tasks if t.main]
        upto = computed_upto(main_tasks)
        bs = self.block_size
        for u in req.units + req.sources:
            if u.final:
                u.tokens = req.main.tokens[u.start:]
            if u.plus:
                done_upto = len(u.tokens) if (u.task is None or not u.task.todo) else 0
            else:
                done_upto = max(0, min(upto - u.start, len(u.tokens)))
            while (len(u.keys) + 1) * bs <= done_upto:  # generated tokens filled another block
                j = len(u.keys)
                u.keys.append(hashing.block_key(u.keys[-1] if u.keys else u.seed, u.tokens[j * bs:(j + 1) * bs]))
            keep: list[int] = []
            for i in u.fresh:
                n = min(bs, done_upto - i * bs)
                whole = n == u.n_valid[i] and (not u.final or n == bs)
                if n <= 0 or not (whole or (tail and u.final)):
                    keep.append(i)
                    continue
                toks = u.tokens[i * bs:i * bs + n]
                parent = u.keys[i - 1] if i else u.seed
                if n == bs:
                    self.pool.register(u.blocks[i], u.keys[i], toks)
                else:
                    self.pool.register(u.blocks[i], hashing.block_key(parent, toks), toks, parent=parent)
            u.fresh = keep

    def snapshot_prompt_tail(self, req: Request) -> None:
        """Called once the prompt is fully computed, before generation writes into its last
        block: cache a copy of that partial block under its exact tokens, so the same prompt
        again (a retry, n > 1, a judge asked twice) finds all of it. One block copy per request."""
        u = req.units[-1] if req.units else None
        if u is None or not u.final or self.pool.num_free < 2:
            return
        bs = self.block_size
        n_prompt = len(req.main.tokens) - u.start
        i, n = (n_prompt - 1) // bs, (n_prompt - 1) % bs + 1
        if n == bs:
            return  # a full block is published under its full key anyway
        toks = u.tokens[i * bs:i * bs + n]
        key = hashing.block_key(u.keys[i - 1] if i else u.seed, toks)
        if self.pool.lookup(key, toks) is not None:
            return
        b = self.pool.allocate()
        self.storage.copy(u.blocks[i].id, b.id, n)
        self.pool.register(b, key, toks, parent=u.keys[i - 1] if i else u.seed)
        self.pool.release(b)

    def release(self, req: Request) -> None:
        """Publish what the request computed, then drop its references; its blocks stay cached."""
        if req.tasks:
            self.publish(req, tail=True)
        self.pool.release_many(req.held)
        req.held = []
        req.tasks = []
        req.units = []
        req.sources = []


def _keys(seed: int, tokens: Sequence[int], bs: int, packed: bytes | None = None) -> tuple[list[int], int]:
    """Full-block chain keys and the digest of the whole unit (its partial tail included)."""
    arr = tokens if packed is None else np.frombuffer(packed, "<i4")  # no second conversion
    keys = hashing.chain_keys(seed, arr, bs, include_partial=True)
    full = keys if len(tokens) % bs == 0 else keys[:-1]
    return full, keys[-1]


def _touched(plans: list[_Plan]) -> list[Block]:
    """The cached blocks a request reads: each shared block, or else its copy source, in order."""
    out: list[Block] = []
    for plan in plans:
        if not plan.copies:
            out += plan.shared  # type: ignore[arg-type]
            continue
        for i, b in enumerate(plan.shared):
            src = b if b is not None else plan.copies[i][0]
            if src is not None:
                out.append(src)
    return out


def _table(units: list[Unit], local: bool = False) -> Table:
    """The units' entries as columns, built in bulk (~6k blocks for a warm 90k-token layout).
    `local`: delta 0, how a plus unit's own encoding task reads it."""
    n = sum(len(u.blocks) for u in units)
    table = np.empty((n, 3), np.int64)
    table[:, 0] = np.fromiter(map(_ID, itertools.chain.from_iterable(u.blocks for u in units)), np.int64, n)
    table[:, 1] = 0 if local else np.repeat([u.delta for u in units], [len(u.blocks) for u in units])
    table[:, 2] = np.fromiter(itertools.chain.from_iterable(u.n_valid for u in units), np.int64, n)
    return table


def _all_hit(units: list[Unit], plans: list[_Plan], bs: int) -> bool:
    """The whole request chain is cached: only the final token is left to compute."""
    for u, plan in zip(units, plans):
        last = len(plan.shared) - 1
        for i, (_, copy_n) in plan.copies.items():
            if not (u.final and i == last and copy_n == min(bs, len(u.tokens) - i * bs) - 1):
                return False
    return True
