"""Cache manager: per-unit lookup (prefix, perforated, partial-block copies), block allocation
for requests, publication of computed blocks, and release."""
from __future__ import annotations

from dataclasses import dataclass

from spanserve.cache import hashing
from spanserve.cache.block_pool import Block, BlockPool
from spanserve.cache.storage import KVStorage
from spanserve.cache.table import Entry
from spanserve.engine.request import Request, Task


@dataclass
class _Slot:
    """Plan for one block of a unit: share a cached block, or take a fresh one whose first
    `copy_n` slots are copied from `src` (a cached partial or full block of the same chain)."""

    shared: Block | None = None
    src: Block | None = None
    copy_n: int = 0


def computed_upto(task: Task) -> int:
    """Everything before this position has KV (todo is consumed in order)."""
    return task.todo[0] if task.todo else len(task.tokens)


class CacheManager:
    def __init__(self, pool: BlockPool, storage: KVStorage, block_size: int):
        self.pool = pool
        self.storage = storage
        self.block_size = block_size

    # ---- lookup ---------------------------------------------------------------------------
    def _probe_partial(self, parent: int, toks: list[int], longest: int) -> tuple[Block | None, int]:
        """The cached block holding the longest prefix (<= longest tokens) of `toks`: a unit that
        ended inside this block (an earlier turn, a preempted request) left it behind."""
        for j in range(min(longest, len(toks)), 0, -1):
            b = self.pool.lookup(hashing.block_key(parent, toks[:j]), toks[:j])
            if b is not None:
                return b, j
        return None, 0

    def _plan_unit(self, seed: int, tokens: list[int], keys: list[int], last_computed: bool) -> list[_Slot]:
        """Never stops at the first miss: a chained key after a gap still hits (perforated).
        With last_computed the final token is always recomputed (its logits are needed), so the
        block holding it is private: copied, never shared."""
        bs = self.block_size
        n_blocks = -(-len(tokens) // bs)
        plan: list[_Slot] = []
        for i in range(n_blocks):
            toks = tokens[i * bs:(i + 1) * bs]
            parent = keys[i - 1] if i else seed
            final = last_computed and i == n_blocks - 1
            if len(toks) == bs and i < len(keys):
                hit = self.pool.lookup(keys[i], toks)
                if hit is not None and not final:
                    plan.append(_Slot(shared=hit))
                    continue
                if hit is not None:
                    plan.append(_Slot(src=hit, copy_n=bs - 1))
                    continue
            src, j = self._probe_partial(parent, toks, len(toks) - 1 if len(toks) == bs else len(toks))
            plan.append(_Slot(src=src, copy_n=min(j, len(toks) - 1) if final else j))
        return plan

    # ---- admission ------------------------------------------------------------------------
    def admit(self, req: Request) -> bool:
        """Give a waiting request its blocks and tasks. False (and nothing changed) when the pool
        cannot hold it now."""
        bs = self.block_size
        tokens = req.all_token_ids
        seed = hashing.seed(req.namespace)
        keys = hashing.chain_keys(seed, tokens, bs)
        plan = self._plan_unit(seed, tokens, keys, last_computed=True)
        touched = [s.shared or s.src for s in plan if (s.shared or s.src) is not None]
        for b in touched:  # pin hits and copy sources before allocating can evict them
            self.pool.acquire(b)
        n_fresh = sum(1 for s in plan if s.shared is None)
        if self.pool.num_free < n_fresh:
            for b in touched:
                self.pool.release(b)
            return False
        blocks: list[Block] = []
        todo: list[int] = []
        reuse = {"prefix": 0, "perforated": 0, "segment": 0, "computed": 0}
        contiguous = True
        to_publish: list[int] = []
        for i, s in enumerate(plan):
            n_tok = min(bs, len(tokens) - i * bs)
            if s.shared is not None:
                blocks.append(s.shared)
                got = n_tok
            else:
                b = self.pool.allocate()
                if s.src is not None and s.copy_n:
                    self.storage.copy(s.src.id, b.id, s.copy_n)
                blocks.append(b)
                to_publish.append(i)
                got = s.copy_n
                todo.extend(range(i * bs + got, i * bs + n_tok))
            reuse["prefix" if contiguous else "perforated"] += got
            contiguous = contiguous and got == n_tok
        for s in plan:
            if s.src is not None:
                self.pool.release(s.src)
        reuse["computed"] = len(todo)
        entries = [Entry(b.id, 0, min(bs, len(tokens) - i * bs)) for i, b in enumerate(blocks)]
        req.tasks = [Task(tokens=list(tokens), entries=entries, todo=todo, block_size=bs, sample=True)]
        req.held = blocks
        req.chain_keys = keys
        req.to_publish = to_publish
        if req.num_preemptions == 0:  # a resumed request reports how it was first served
            req.reuse = reuse
        return True

    def ensure_capacity(self, req: Request) -> bool:
        """Make room in the main table for every token of the main task (decode growth)."""
        task = req.main
        bs = self.block_size
        have = sum(e.n_valid for e in task.entries)
        need = len(task.tokens) - have
        if need <= 0:
            return True
        entries = list(task.entries)
        last = entries[-1]
        if last.n_valid < bs:
            grow = min(need, bs - last.n_valid)
            entries[-1] = Entry(last.block, last.delta, last.n_valid + grow)
            need -= grow
        n_new = -(-need // bs)
        if self.pool.num_free < n_new:
            if len(entries) != len(task.entries) or entries[-1] != last:
                task.set_entries(entries)
            return False
        for _ in range(n_new):
            b = self.pool.allocate()
            req.held.append(b)
            req.to_publish.append(len(entries))
            entries.append(Entry(b.id, 0, min(bs, need)))
            need -= min(bs, need)
        task.set_entries(entries)
        return True

    # ---- publication and release ----------------------------------------------------------
    def publish(self, req: Request, tail: bool = False) -> None:
        """Offer every fully computed private block of the main table to the index; with `tail`
        (the request is leaving) also the partial last block, keyed by its exact tokens."""
        task = req.main
        bs = self.block_size
        upto = computed_upto(task)
        full = upto // bs
        keys = req.chain_keys
        seed = hashing.seed(req.namespace)
        while len(keys) < full:
            i = len(keys)
            keys.append(hashing.block_key(keys[-1] if keys else seed, task.tokens[i * bs:(i + 1) * bs]))
        pending = []
        for i in req.to_publish:
            if i < full:
                self.pool.register(req.held[i], keys[i], task.tokens[i * bs:(i + 1) * bs])
            elif tail and i == full and upto % bs:
                toks = task.tokens[i * bs:upto]
                self.pool.register(req.held[i], hashing.block_key(keys[i - 1] if i else seed, toks), toks)
            else:
                pending.append(i)
        req.to_publish = pending

    def release(self, req: Request) -> None:
        """Publish what the request computed, then drop its references; its blocks stay cached."""
        if req.tasks:
            self.publish(req, tail=True)
        for b in req.held:
            self.pool.release(b)
        req.held = []
        req.tasks = []
        req.to_publish = []
