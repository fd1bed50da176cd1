"""Local-disk tier: one file per block under <root>/<model fingerprint>/, LRU by file within a
byte budget. Files are written whole then renamed, so a crash leaves no half block under a real
name; a restarted server indexes the directory and finds its blocks again."""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from spanserve.cache.tiers import payload
from spanserve.cache.tiers.base import Tier
from spanserve.cache.tiers.payload import BadPayload, BlockKV, BlockShape

_SUFFIX = ".kv"


class DiskTier(Tier):
    name = "disk"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, shape: BlockShape, fingerprint: bytes):
        super().__init__()
        if capacity_bytes < shape.payload_bytes:
            raise ValueError(f"disk KV tier of {capacity_bytes} bytes cannot hold one block "
                             f"({shape.payload_bytes} bytes)")
        self.dir = Path(root).expanduser() / fingerprint.hex()
        _check_writable(self.dir)
        self.shape, self.fingerprint = shape, fingerprint
        self.capacity = capacity_bytes // shape.payload_bytes
        self._lock = threading.Lock()
        self._files: OrderedDict[int, None] = OrderedDict()  # key -> (present), least recent first
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(_SUFFIX) and entry.is_file():
                try:
                    found.append((entry.stat().st_mtime, int(entry.name[: -len(_SUFFIX)], 16)))
                except ValueError:
                    continue  # not one of ours
        for _, key in sorted(found):
            self._files[key] = None
        self._trim()

    def __len__(self) -> int:
        return len(self._files)

    def _path(self, key: int) -> Path:
        return self.dir / f"{key:032x}{_SUFFIX}"

    def contains_many(self, keys: Sequence[int]) -> np.ndarray:
        with self._lock:
            return np.fromiter((k in self._files for k in keys), bool, len(keys))

    def load_many(self, keys: Sequence[int]) -> list[BlockKV | None]:
        t0 = time.perf_counter()
        out: list[BlockKV | None] = []
        bad = nbytes = 0
        for k in keys:
            with self._lock:
                present = k in self._files
                if present:
                    self._files.move_to_end(k)
            if not present:
                out.append(None)
                continue
            try:
                data = self._path(k).read_bytes()
                block = payload.decode(data, k, self.shape, self.fingerprint)
                nbytes += len(data)
                os.utime(self._path(k))  # the LRU order survives a restart
            except (OSError, BadPayload):
                bad += 1
                self._forget(k)
                block = None
            out.append(block)
        hits = sum(b is not None for b in out)
        self.stats.loaded(hits, len(keys) - hits, nbytes, time.perf_counter() - t0)
        self.stats.add(bad_payloads=bad)
        return out

    def store_many(self, blocks: Sequence[BlockKV]) -> list[BlockKV]:
        nbytes = errors = 0
        for b in blocks:
            with self._lock:
                if b.key in self._files:
                    self._files.move_to_end(b.key)
                    continue
            data = payload.encode(b, self.shape, self.fingerprint)
            path = self._path(b.key)
            tmp = path.with_suffix(f".tmp{threading.get_ident()}")
            try:
                tmp.write_bytes(data)
                os.replace(tmp, path)
            except OSError:
                errors += 1  # disk full or gone: the block is simply not kept
                tmp.unlink(missing_ok=True)
                continue
            nbytes += len(data)
            with self._lock:
                self._files[b.key] = None
            self._trim()
        self.stats.add(bytes_in=nbytes, errors=errors)
        return []

    def clear(self) -> None:
        """Delete every block this tier holds."""
        with self._lock:
            keys = list(self._files)
            self._files.clear()
        for k in keys:
            self._path(k).unlink(missing_ok=True)

    def _trim(self) -> None:
        while True:
            with self._lock:
                if len(self._files) <= self.capacity:
                    return
                key, _ = self._files.popitem(last=False)
            self._path(key).unlink(missing_ok=True)
            self.stats.add(evictions=1)

    def _forget(self, key: int) -> None:
        with self._lock:
            self._files.pop(key, None)
        self._path(key).unlink(missing_ok=True)


def _check_writable(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"KV offload directory {path} is not writable: {e.strerror or e}") from e
