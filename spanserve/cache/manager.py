"""Cache manager: turns a request's layout into units (chains of blocks, `cache/units.py`), looks
each unit up (`cache/planning.py`: prefix, perforated, partial-block and segment hits; blocks below
the pool through `cache/tier_loads.py`), allocates what misses, builds the tasks that compute the
holes, publishes computed blocks and releases them. It speaks plain data (`cache/claim.py`): an
Admission in, a Holding out."""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from spanserve.attention.plan import Repair
from spanserve.cache import hashing
from spanserve.cache.block_pool import Block, BlockPool
from spanserve.cache.claim import Admission, Task
from spanserve.cache.planning import Plan, all_hit, fresh_plan, place_hits, plan_unit, reuse_kind, touched
from spanserve.cache.table import Table, grown, truncate
from spanserve.cache.tier_loads import load_missing, tier_reuse
from spanserve.cache.tiers.loader import LoadJob
from spanserve.cache.units import Holding, Unit, build_units, follow
from spanserve.cache.units import table as unit_table
from spanserve.reuse.recompute import RecomputeSpec
from spanserve.worker.storage import KVStorage

# the names tests and benchmarks reach for
_Plan, _all_hit, _follow = Plan, all_hit, follow


def computed_upto(tasks: list[Task]) -> int:
    """Main-row positions before this have KV: todo lists are consumed in order."""
    heads = [t.todo[0] for t in tasks if t.todo]
    return min(heads) if heads else len(tasks[-1].tokens)


class CacheManager:
    def __init__(self, pool: BlockPool, storage: KVStorage, block_size: int,
                 reposition: str = "deferred", rotary: object = None, tiers: object = None):
        if reposition not in ("deferred", "eager"):
            raise ValueError(f"reposition must be 'deferred' or 'eager', got {reposition!r}")
        self.pool = pool
        self.storage = storage
        self.block_size = block_size
        # eager: a fully hit segment at a new position is copied into private blocks rotated
        # there (SparseX, LMCache, CIDRA); deferred (default): one copy, rotated when read.
        self.reposition = reposition
        self.rotary = rotary
        # cache.tiers.stack.TierStack or None: blocks missing here are looked up below the pool
        self.tiers = tiers

    # ---- loads from the tiers below the pool (asynchronous mode) -----------------------------
    def drop_loads(self, job: LoadJob) -> None:
        """The request waiting on `job` went away: nothing it loads is installed."""
        if self.tiers is not None:
            self.tiers.drop(job)

    def wait_loads(self, jobs: list[LoadJob], timeout: float) -> bool:
        """Sleep until one of `jobs` is done (True) or `timeout` seconds pass."""
        return self.tiers.wait(jobs, timeout) if self.tiers is not None and jobs else False

    # ---- lookup ---------------------------------------------------------------------------
    def _plan_unit(self, seed: int, tokens: Sequence[int], keys: list[int], extended: bool,
                   packed: bytes | None = None, tail_key: int | None = None) -> Plan:
        return plan_unit(self.pool, self.block_size, seed, tokens, keys, extended, packed, tail_key)

    # ---- admission ------------------------------------------------------------------------
    def _units(self, adm: Admission) -> list[Unit]:
        return build_units(adm, self.block_size)

    def admit(self, adm: Admission, loads: LoadJob | None = None) -> Holding | LoadJob | None:
        """Give a waiting request its blocks and tasks. None (and nothing changed) when the pool
        cannot hold it now. With asynchronous tier loads, a request whose missing blocks are
        being asked of the tiers gets that LoadJob back instead: it waits, and once the job is
        done it is admitted again with it (`loads`), finding what was loaded as pool hits."""
        units = self._units(adm)
        loaded = None
        # what the tiers hold becomes ordinary pool hits before planning (unless every position
        # is computed anyway)
        if self.tiers is not None:
            got = Counter() if adm.compute_all else load_missing(self.tiers, self.pool, units, loads)
            if isinstance(got, LoadJob):
                return got
            loaded = got
        plans, sources = self._plans(adm, units)
        held = touched(plans)
        self.pool.acquire_many(held)  # hold hits and copy sources so allocation cannot evict them
        eager = [i for i, (u, plan) in enumerate(zip(units, plans)) if self.reposition == "eager"
                 and u.plus and u.delta and not plan.copies]
        n_fresh = sum(len(plan.copies) for plan in plans)
        n_fresh += sum(len(plans[i].shared) for i in eager)
        if self.pool.num_free < n_fresh:
            self.pool.release_many(held)
            return None
        req = Holding()
        req.reuse = self._place(req, units + sources, plans, recomputed=bool(sources))
        if eager:
            self._reposition_all(req, [units[i] for i in eager])
        if loaded is not None:  # of the hits, tokens loaded from each tier below the pool
            req.reuse.update(tier_reuse(loaded))
        req.units = units
        req.sources = sources
        req.tasks = self._tasks(adm, units, sources)
        return req

    def _plans(self, adm: Admission, units: list[Unit]) -> tuple[list[Plan], list[Unit]]:
        """One plan per unit, then one per shared copy a recomputing policy reads (`sources`,
        returned too); a position the request must compute gets a fresh plan."""
        plans = [self._plan_unit(u.seed, u.tokens, u.keys, u.final, u.packed, u.tail_key) for u in units]
        sources: list[Unit] = []
        if adm.compute_all:
            # every prompt position must be computed: a cached one has KV but no logits to score
            plans = [fresh_plan(len(p.shared)) for p in plans]
        if any(u.source is not None for u in units) and not all_hit(units, plans, self.block_size):
            # The policy recomputes from the shared copies: every run from the first recomputed
            # segment on is produced by one selective forward, into fresh private blocks.
            first = next(i for i, u in enumerate(units) if u.source is not None)
            for i in range(first, len(units)):
                plans[i] = fresh_plan(len(plans[i].shared))
            sources = [u.source for u in units if u.source is not None]
        plans += [self._plan_unit(u.seed, u.tokens, u.keys, False, u.packed, u.tail_key) for u in sources]
        return plans, sources

    def _place(self, req: Holding, units: list[Unit], plans: list[Plan], recomputed: bool) -> dict[str, int]:
        """Hold each unit's hits and allocate its misses, in order, into `req` and the units;
        returns the tokens per reuse kind. With `recomputed`, a recomputed run is counted by its
        source."""
        reuse = {"prefix": 0, "perforated": 0, "segment": 0, "computed": 0}
        contiguous = True
        bs = self.block_size
        copies: list[tuple[int, int, int]] = []
        for u, plan in zip(units, plans):
            done = 0  # blocks of u placed so far; the hits between copies go in bulk
            for i, (src, copy_n) in plan.copies.items():
                reuse[reuse_kind(u, contiguous)] += place_hits(req.held, u, plan.shared, done, i, bs)
                n_tok = min(bs, len(u.tokens) - i * bs)
                b = self.pool.allocate()
                if src is not None:
                    copies.append((src.id, b.id, copy_n))
                    self.pool.release(src)
                u.fresh.append(i)
                u.todo.extend(range(i * bs + copy_n, i * bs + n_tok))
                req.held.append(b)
                u.blocks.append(b)
                u.n_valid.append(n_tok)
                reuse[reuse_kind(u, contiguous)] += copy_n
                contiguous = contiguous and copy_n == n_tok
                done = i + 1
            reuse[reuse_kind(u, contiguous)] += place_hits(req.held, u, plan.shared, done, len(plan.shared), bs)
            if u.source is None or not recomputed:
                reuse["computed"] += len(u.todo)
        # One batch (a judge copies the tail block of each of its candidates). Safe although the
        # sources were released above: nothing writes KV before this runs, and the batch reads
        # every source before writing any destination.
        self.storage.copy_many(copies)
        return reuse

    def _reposition_all(self, req: Holding, units: list[Unit]) -> None:
        """Eager repositioning of fully hit segments placed away from their local positions."""
        dropped: Counter[Block] = Counter()
        for u in units:
            dropped.update(self._reposition(u))
        # each repositioned unit gave up the first holds of its blocks (a segment placed twice
        # holds them twice) and its copies went to the end: one pass instead of list.remove
        kept = []
        for b in req.held:
            if dropped[b]:
                dropped[b] -= 1
            else:
                kept.append(b)
        req.held = kept + [b for u in units for b in u.blocks]

    def _reposition(self, u: Unit) -> list[Block]:
        """Replace a hit segment's shared blocks by private copies rotated to its position;
        returns the shared blocks (the caller swaps them for the copies in the request's holds)."""
        copies = [self.pool.allocate() for _ in u.blocks]
        self.storage.copy_rotated([b.id for b in u.blocks], [b.id for b in copies], u.delta, self.rotary)
        old = u.blocks
        for b in old:
            self.pool.release(b)
        u.blocks, u.local_start = copies, u.start
        return old

    def _tasks(self, adm: Admission, units: list[Unit], sources: list[Unit]) -> list[Task]:
        """Main-row work before the first plus unit, then each plus unit's encoding (it may read
        that prefix as its anchor), then the rest of the main row (it reads the segments)."""
        bs = self.block_size
        entries = self.entries(units)
        # the units are the current pieces, which cover the prompt and then the output in order
        tokens = adm.tokens
        assert len(tokens) == units[-1].start + len(units[-1].tokens)
        first_plus = next((i for i, u in enumerate(units) if u.plus or u.source is not None), len(units))
        before = [u.start + p for u in units[:first_plus] for p in u.todo]
        after = [u.start + p for u in units[first_plus:] if not u.plus for p in u.todo]
        tasks: list[Task] = []
        if first_plus < len(units) and before:
            tasks.append(Task(tokens, entries, before, bs, main=True))
        anchor_entries = entries[: sum(len(u.blocks) for u in units[:first_plus])]
        # a judge over just finished generations encodes each one's last token: a segment's
        # rows are cut from the main table (not rebuilt), its anchor truncated once per length
        starts = dict(zip(map(id, units), itertools.accumulate((len(u.blocks) for u in units), initial=0)))
        heads: dict[int, Table] = {}
        for u in units + sources:
            if u.plus and u.todo:
                a = u.local_start
                if a not in heads:
                    heads[a] = truncate(anchor_entries, a)
                at = starts.get(id(u))
                seg = unit_table([u], local=True) if at is None else entries[at:at + len(u.blocks)]
                table = np.concatenate([heads[a], seg])
                table[len(heads[a]):, 1] = 0  # its own encoding reads it at local positions
                u.task = Task(tokens[:a] + list(u.tokens), table, [a + p for p in u.todo], bs)
                tasks.append(u.task)
        main_todo = after if first_plus < len(units) else before
        spec = None
        if sources:
            reused = [u.start + p for u in units if u.source is not None for p in range(len(u.tokens))]
            src_slots = [b.id * bs + o for u in sources for b, n in zip(u.blocks, u.n_valid) for o in range(n)]
            src_delta = [u.delta for u in sources for _ in u.tokens]
            offsets = [p for u in sources for p in range(len(u.tokens))]
            spec = RecomputeSpec(adm.policy, reused, src_slots, src_delta, offsets)
        tasks.append(Task(tokens, entries, main_todo, bs, sample=not adm.encode_only, main=True, recompute=spec,
                          repair=_repair(adm.policy, units)))
        return tasks

    @staticmethod
    def entries(units: list[Unit]) -> Table:
        return unit_table(units)

    def ensure_capacity(self, req: Holding) -> bool:
        """Room in the final unit for every token of the main task (decode growth)."""
        task = req.main
        u = req.units[-1]
        bs = self.block_size
        # every block of a unit but its last is full: its length without summing (per step, per row)
        nv = u.n_valid
        need = len(task.tokens) - (u.start + (len(nv) - 1) * bs + nv[-1])
        if need <= 0:
            return True
        old = task.entries
        # a decode step inside the last block (15 steps in 16): its slots follow, nothing to allocate
        if (need <= bs - nv[-1] and isinstance(old, np.ndarray) and old[-1, 0] == u.blocks[-1].id
                and old[-1, 2] == nv[-1]):
            task.extend_last(u.blocks[-1].id * bs + nv[-1], need, u.delta)
            nv[-1] += need
            return True
        grow = min(need, bs - u.n_valid[-1])
        n_new = -(-(need - grow) // bs)
        if self.pool.num_free < n_new:
            return False
        n_old, added = len(u.blocks), need
        u.n_valid[-1] += grow
        need -= grow
        for _ in range(n_new):
            b = self.pool.allocate()
            req.held.append(b)
            u.fresh.append(len(u.blocks))
            u.blocks.append(b)
            u.n_valid.append(min(bs, need))
            need -= min(bs, need)
        # the main table is the units' table (admission, then here): copied with the growth
        # rather than rebuilt from every block each decode step, unless it is not that table
        if (isinstance(old, np.ndarray) and n_old and len(old) == sum(len(x.blocks) for x in req.units) - n_new
                and old[-1, 0] == u.blocks[n_old - 1].id and old[-1, 2] + grow == u.n_valid[n_old - 1]):
            if n_new:
                task.extend_entries(grown(old, grow, u.blocks[n_old:], u.delta, u.n_valid[n_old:]), added, owned=True)
            else:  # the last block took the new tokens: grown in place, in the task's own table
                table = task.own_table()
                table[-1, 2] += grow
                task.extend_entries(table, added, owned=True)
        else:
            task.set_entries(self.entries(req.units))
        return True

    # ---- publication and release ----------------------------------------------------------
    def publish(self, req: Holding, tail: bool = False) -> None:
        """Offer every computed block this request owns to the index. A unit's partial last block
        is keyed by its exact tokens once nothing will be appended to it, or with `tail` (the
        request is leaving: its generated text becomes a reusable unit)."""
        main_tasks = [t for t in req.tasks if t.main]
        upto = computed_upto(main_tasks)
        bs = self.block_size
        # Nothing new to offer since the last call (a decode step inside a block, the common case):
        # the row moved within one block of its final unit, every earlier unit was settled at the
        # last call, and no task finished since.
        mark, last, end = (upto, sum(1 for t in req.tasks if t.todo)), req.publish_mark, req.units[-1].start
        if (not tail and last is not None and last[1] == mark[1] and end <= last[0]
                and (last[0] - end) // bs == (upto - end) // bs):
            return
        req.publish_mark = mark
        through: list[Block] = []  # standalone-segment blocks published now, for the remote store
        for u in req.units + req.sources:
            if u.final:
                follow(u, req.main.tokens)
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
                    if self.pool.register(u.blocks[i], u.keys[i], toks) is u.blocks[i] and u.plus:
                        through.append(u.blocks[i])
                elif self.pool.register(u.blocks[i], hashing.block_key(parent, toks), toks,
                                        parent=parent) is u.blocks[i] and u.plus:
                    through.append(u.blocks[i])
            u.fresh = keep
        if through and self.tiers is not None:
            self.tiers.write_through(through)

    def snapshot_prompt_tail(self, req: Holding) -> None:
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

    def _remember_generation(self, u: Unit) -> None:
        """A finished generation is read next as a segment (the judge over it): its chain was
        hashed block by block as it grew and its blocks are ours (registered or hit-checked), so
        both memos learn it now and the reader neither hashes nor compares its tokens."""
        bs = self.block_size
        if len(u.tokens) < 4 * bs:
            return  # short units are cheap to look up anyway
        arr = np.asarray(u.tokens, "<i4")
        hashing.remember_chain(u.seed, arr, bs, u.keys)
        self.pool.remember_chain(u.keys, u.tokens, bs, arr.tobytes(), u.blocks)

    def release(self, req: Holding) -> None:
        """Publish what the request computed, then drop its references; its blocks stay cached."""
        if req.tasks:
            self.publish(req, tail=True)
            u = req.units[-1]
            if len(req.units) == 1 and u.final:
                self._remember_generation(u)
        self.pool.release_many(req.held)
        req.held = []
        req.tasks = []
        req.units = []
        req.sources = []


def _repair(policy: Any, units: list[Unit]) -> Repair | None:
    """The main row's repair: its plus segments (reused or recomputed from a shared copy), read by
    later tokens with the policy's temperature and log scale."""
    if policy is None or not policy.repairs:
        return None
    plus = [(u.start, u.start + len(u.tokens)) for u in units if u.plus or u.source is not None]
    if not plus:
        return None
    starts, ends = (np.array(x, dtype=np.int64) for x in zip(*plus))
    return Repair(starts, ends, float(policy.temperature), float(policy.log_scale))
