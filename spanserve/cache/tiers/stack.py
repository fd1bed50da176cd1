"""The tiers below the block pool, wired together: write-back of evicted blocks (host memory,
spilling to disk), write-through of standalone segments to the remote store, and the batched
lookup that loads a layout's missing blocks into free pool blocks.

Engine thread: `on_evict` (the pool calls it before a cached block's KV is overwritten),
`write_through`, `lookup`/`start`, `install`, `fill`. Writes are captured (one device-to-host
copy) and handed to a background thread through a bounded queue: when the queue is full they
are dropped and counted, so the step loop never waits for a tier to store anything. Loads run
on a second background thread (`loader.py`) between `start` and `install`; `fill` does all
three steps at once, on the engine thread."""
from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from spanserve.cache.block_pool import Block, BlockPool
from spanserve.cache.tiers.base import Tier
from spanserve.cache.tiers.config import OffloadConfig
from spanserve.cache.tiers.disk import DiskTier
from spanserve.cache.tiers.host import HostTier
from spanserve.cache.tiers.loader import Chain, Loader, LoadJob, Want, load_nearest
from spanserve.cache.tiers.payload import BlockKV, BlockShape, PayloadCodec
from spanserve.worker.storage import KVStorage

log = logging.getLogger("spanserve.tiers")
_PERSIST_BATCH = 64


@dataclass
class _Job:
    dest: str  # "local": host (spilling to disk) or disk; "store": the remote tier
    blocks: list[BlockKV]
    ready: "torch.cuda.Event | None" = None  # the device-to-host copy has landed
    done: threading.Event | None = None  # a flush marker


class TierStack:
    def __init__(self, config: OffloadConfig, storage: KVStorage, shape: BlockShape, fingerprint: bytes):
        self.config = config
        self.storage = storage
        self.shape = shape
        self.host = HostTier(config.cpu_bytes, shape) if config.cpu_bytes else None
        # payloads on disk and in the store carry a MAC under the secret, or a checksum without one
        codec = PayloadCodec(shape, fingerprint, config.secret)
        self.disk = DiskTier(config.disk_path, config.disk_bytes, codec) if config.disk_path else None
        self.store = None
        if config.store_url:
            from spanserve.cache.tiers.redis import RedisTier

            self.store = RedisTier(config.store_url, codec, config.store_timeout_ms, ttl_s=config.store_ttl_s)
            if not codec.authenticated:
                log.warning("KV store %s is used without a secret (store_insecure): any block written to "
                            "it by anyone who can reach it is trusted", self.store.url)
        # lookup order: nearest first
        self.tiers: list[Tier] = [t for t in (self.host, self.disk, self.store) if t is not None]
        self._cuda = storage.k.device.type == "cuda"
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._queued = 0  # blocks captured and not yet stored
        self._lock = threading.Lock()
        self.dropped = 0  # write-backs dropped because the queue was full
        self.served: Counter[str] = Counter()  # tokens loaded into the pool, per tier
        self._thread = threading.Thread(target=self._run, name="spanserve-kv-writeback", daemon=True)
        self._thread.start()
        self.asynchronous = config.async_loads
        self.loader = Loader(self.tiers)  # loads, off the engine thread (async_loads)

    # ---- writes (engine thread) -----------------------------------------------------------
    def on_evict(self, block: Block) -> None:
        """A cached block is about to be overwritten: keep a copy below."""
        if self.host is not None or self.disk is not None:
            self._enqueue("local", [block])

    def write_through(self, blocks: Sequence[Block]) -> None:
        """Standalone-segment (and pinned) blocks just published: send them to the remote store."""
        if self.store is not None and blocks:
            self._enqueue("store", list(blocks))

    def _enqueue(self, dest: str, blocks: list[Block]) -> None:
        with self._lock:
            if self._queued + len(blocks) > self.config.writeback_blocks:
                self.dropped += len(blocks)
                return
            self._queued += len(blocks)
        kv, ready = self._capture(blocks)
        self._jobs.put(_Job(dest, [_kv_of(b, kv[i]) for i, b in enumerate(blocks)], ready))

    def _capture(self, blocks: Sequence[Block]) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        out = torch.empty((len(blocks), *self.shape.dims), dtype=self.shape.host_dtype, pin_memory=self._cuda)
        self.storage.read_blocks([b.id for b in blocks], out)
        if not self._cuda:
            return out, None
        ready = torch.cuda.Event()
        ready.record()
        return out, ready

    # ---- the write-back thread --------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.done is not None:
                job.done.set()
                continue
            try:
                if job.ready is not None:
                    job.ready.synchronize()
                self._deliver(job)
            except Exception:  # a tier's bug must not end write-back for the process
                log.exception("KV write-back failed; %d blocks not kept", len(job.blocks))
            finally:
                with self._lock:
                    self._queued -= len(job.blocks)

    def _deliver(self, job: _Job) -> None:
        if job.dest == "store":
            assert self.store is not None
            self.store.store_many(job.blocks)
            return
        spill = self.host.store_many(job.blocks) if self.host is not None else job.blocks
        if self.disk is not None and spill:
            self.disk.store_many(spill)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every write queued so far is stored (tests, shutdown)."""
        done = threading.Event()
        self._jobs.put(_Job("local", [], done=done))
        return done.wait(timeout)

    # ---- lookup and load ---------------------------------------------------------------------
    def lookup(self, pool: BlockPool, chains: Sequence[Chain]) -> LoadJob | None:
        """Engine thread. Every block of `chains` ((seed, full-block keys, tokens, partial tail's
        key, extended) per unit) missing from the pool, as a job for the tiers; None when nothing
        is missing or the pool has no room for a single load."""
        want, serves, held = self._missing(pool, chains)
        if want and not any(t.remote for t in self.tiers):
            # local tiers only: their indexes are in memory, so a cold layout starts no load
            # (and does not wait for one); only blocks some tier holds are asked for
            keys = list(want)
            somewhere = np.zeros(len(keys), bool)
            for t in self.tiers:
                somewhere |= t.contains_many(keys)
            want = {k: want[k] for k, there in zip(keys, somewhere) if there}
        if not want:
            return None
        pool.acquire_many(held)  # this layout's own hits are not room for loads
        room = pool.num_free
        pool.release_many(held)
        return LoadJob(list(chains), want, serves, room) if room else None

    def start(self, pool: BlockPool, chains: Sequence[Chain]) -> LoadJob | None:
        """Engine thread: look the layout up and hand its missing blocks to the loader.
        The job is `done` once the tiers answered; `install` it then."""
        job = self.lookup(pool, chains)
        if job is not None:
            self.loader.submit(job)
        return job

    def install(self, pool: BlockPool, job: LoadJob) -> Counter[str]:
        """Engine thread, once `job.done`: what the tiers found goes into free pool blocks and is
        published there, so admission finds it as ordinary hits and computes only the holes.
        A block that reached the pool meanwhile is not loaded again; loads that no longer fit
        in the free blocks are left out. Returns the tokens each tier served (an `extended`
        unit's last block serves all but its last token: generation recomputes it)."""
        assert job.done, "install a load job once the loader is done with it"
        if not job.found or job.dropped:
            return Counter()
        want, _, held = self._missing(pool, job.chains)
        return self._install(pool, [f for f in job.found if f[1].key in want], job.serves, held)

    def fill(self, pool: BlockPool, chains: Sequence[Chain]) -> Counter[str]:
        """Engine thread, synchronously: look up, load and install in one go."""
        want, serves, held = self._missing(pool, chains)
        if not want:
            return Counter()
        pool.acquire_many(held)  # this layout's own hits are not room for loads
        try:
            found = load_nearest(self.tiers, want, pool.num_free)
        finally:
            pool.release_many(held)
        return self._install(pool, found, serves, held)

    def drop(self, job: LoadJob) -> None:
        """The request went away: the loader skips the job if it has not started it."""
        job.dropped = True

    def wait(self, jobs: Sequence[LoadJob], timeout: float) -> bool:
        """Sleep until one of `jobs` is done or `timeout` seconds pass."""
        return self.loader.wait_any(jobs, timeout)

    def _missing(self, pool: BlockPool, chains: Sequence[Chain]
                 ) -> tuple[dict[int, Want], dict[int, int], list[Block]]:
        """The blocks of `chains` the pool lacks (key -> tokens and parent if partial, and the
        tokens each serves), and the pool's hits among them."""
        bs = self.shape.block_size
        want: dict[int, Want] = {}
        serves: dict[int, int] = {}
        held: list[Block] = []
        for seed, keys, tokens, tail_key, extended in chains:
            hits = pool.lookup_chain(keys, tokens, bs)
            blocks = [(k, tuple(tokens[i * bs:(i + 1) * bs]), None, hits[i]) for i, k in enumerate(keys)]
            if tail_key is not None:
                tail = tuple(tokens[len(keys) * bs:])
                blocks.append((tail_key, tail, keys[-1] if keys else seed, pool.lookup(tail_key, tail)))
            for j, (k, toks, parent, hit) in enumerate(blocks):
                if hit is not None:
                    held.append(hit)
                elif k not in want:
                    want[k] = (toks, parent)
                    serves[k] = len(toks) - (extended and j == len(blocks) - 1)
        return want, serves, held

    def _install(self, pool: BlockPool, found: list[tuple[str, BlockKV]], serves: dict[int, int],
                 held: list[Block]) -> Counter[str]:
        loaded: Counter[str] = Counter()
        if not found:
            return loaded
        pool.acquire_many(held)  # this layout's own hits must not be evicted to make room for loads
        try:
            found = found[:pool.num_free]
            blocks_in = [pool.allocate() for _ in found]
            self.storage.write_blocks([b.id for b in blocks_in], [kv.kv for _, kv in found])
            for blk, (_, kv) in zip(blocks_in, found):
                pool.register(blk, kv.key, kv.tokens, parent=kv.parent)
            pool.release_many(blocks_in)
        finally:
            pool.release_many(held)
        for name, kv in found:
            loaded[name] += serves[kv.key]
        self.served.update(loaded)
        return loaded

    # ---- shutdown -----------------------------------------------------------------------------
    def close(self, pool: BlockPool | None = None) -> None:
        """Finish queued writes; with a disk tier, keep what host memory and the pool hold there
        too, so a restarted server finds it. Then close every tier. Idempotent."""
        if not self._thread.is_alive():
            return
        self.loader.close()
        self._jobs.put(None)
        self._thread.join()
        if self.disk is not None:
            if self.host is not None:
                self.disk.store_many(self.host.drain())
            if pool is not None:
                cached = [b for b in pool.blocks if b.key is not None]
                for lo in range(0, len(cached), _PERSIST_BATCH):
                    part = cached[lo: lo + _PERSIST_BATCH]
                    kv, ready = self._capture(part)
                    if ready is not None:
                        ready.synchronize()
                    self.disk.store_many([_kv_of(b, kv[i]) for i, b in enumerate(part)])
        for t in self.tiers:
            t.close()

    def stats(self) -> dict:
        return {"tiers": {t.name: t.stats.snapshot() for t in self.tiers}, "dropped_writebacks": self.dropped,
                "queued_writebacks": self._queued, "served_tokens": dict(self.served)}


def _kv_of(block: Block, kv: torch.Tensor) -> BlockKV:
    assert block.key is not None
    return BlockKV(block.key, block.tokens, kv, block.parent)
