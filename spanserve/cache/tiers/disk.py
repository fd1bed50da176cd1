"""Local-disk tier: one file per block under <root>/<model fingerprint>/, LRU by file within a
byte budget; a restarted server indexes the directory and finds its blocks again.

The files hold prompts' tokens and KV, and another local user must neither read nor plant them:
both directories belong to this user with mode 0700 (created so, or refused); a block is written
to a fresh temporary file (0600, exclusive create, no symlink followed) and renamed into place,
so a crash leaves no half block under a real name and a link planted at the name is replaced,
never written through; a read follows no symlink and takes only a regular file of exactly one
payload's size. At start-up only regular files named as this tier names them, of that size,
are indexed. Payloads carry a MAC when a secret is configured, a checksum otherwise."""
from __future__ import annotations

import logging
import os
import re
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from spanserve.cache.tiers.base import Tier
from spanserve.cache.tiers.payload import AuthFailure, BadPayload, BlockKV, PayloadCodec

log = logging.getLogger("spanserve.tiers")
_NAME = re.compile(r"[0-9a-f]{32}\.kv")  # f"{key:032x}.kv", exactly what _path writes
_TMP_PREFIX = ".tmp-"
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a planted FIFO cannot hang a read


class DiskTier(Tier):
    name = "disk"

    def __init__(self, root: str | os.PathLike, capacity_bytes: int, codec: PayloadCodec):
        super().__init__()
        self.size = codec.shape.payload_bytes
        if capacity_bytes < self.size:
            raise ValueError(f"disk KV tier of {capacity_bytes} bytes cannot hold one block ({self.size} bytes)")
        root = Path(root).expanduser()
        self.dir = root / codec.fingerprint.hex()
        for d in (root, self.dir):
            _private_dir(d)
        _check_writable(self.dir)
        self.codec = codec
        self.capacity = capacity_bytes // self.size
        self._lock = threading.Lock()
        self._files: OrderedDict[int, None] = OrderedDict()  # key -> (present), least recent first
        self.ignored = self._index()  # directory entries that are not this tier's block files
        self._trim()

    def __len__(self) -> int:
        return len(self._files)

    def _path(self, key: int) -> Path:
        return self.dir / f"{key:032x}.kv"

    def _index(self) -> int:
        found, ignored = [], 0
        with os.scandir(self.dir) as entries:
            for entry in entries:
                st = self._block_file(entry)
                if st is None:
                    ignored += 1
                else:
                    found.append((st.st_mtime, int(entry.name[:32], 16)))
        for _, key in sorted(found):
            self._files[key] = None
        if ignored:
            log.warning("disk KV tier %s: ignored %d entries that are not block files of this tier "
                        "(other names, symlinks, other sizes, temporary files)", self.dir, ignored)
        return ignored

    def _block_file(self, entry: os.DirEntry) -> os.stat_result | None:
        """The entry's stat if it is a block file as this tier writes them, else None."""
        try:
            if _NAME.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                return st if st.st_size == self.size else None
        except OSError:  # gone meanwhile (another process sharing the directory trimmed it)
            pass
        return None

    def contains_many(self, keys: Sequence[int]) -> np.ndarray:
        with self._lock:
            return np.fromiter((k in self._files for k in keys), bool, len(keys))

    def load_many(self, keys: Sequence[int]) -> list[BlockKV | None]:
        t0 = time.perf_counter()
        out: list[BlockKV | None] = []
        bad = forged = nbytes = 0
        for k in keys:
            with self._lock:
                present = k in self._files
                if present:
                    self._files.move_to_end(k)
            if not present:
                out.append(None)
                continue
            try:
                block = self.codec.decode(self._read(k), k)
                nbytes += self.size
            except (OSError, BadPayload) as e:
                forged += isinstance(e, AuthFailure)
                bad += not isinstance(e, AuthFailure)
                self._forget(k)
                block = None
            out.append(block)
        hits = sum(b is not None for b in out)
        self.stats.loaded(hits, len(keys) - hits, nbytes, time.perf_counter() - t0)
        self.stats.add(bad_payloads=bad, auth_failures=forged)
        return out

    def _read(self, key: int) -> bytearray:
        fd = os.open(self._path(key), _READ_FLAGS)  # a symlink at the name: ELOOP, a miss
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != self.size:
                raise BadPayload(f"not a regular file of {self.size} bytes")
            data = bytearray(self.size)
            view, got = memoryview(data), 0
            while got < self.size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    raise BadPayload("file shrank while read")
                got += n
            os.utime(fd)  # the LRU order survives a restart
            return data
        finally:
            os.close(fd)

    def store_many(self, blocks: Sequence[BlockKV]) -> list[BlockKV]:
        nbytes = errors = 0
        for b in blocks:
            with self._lock:
                if b.key in self._files:
                    self._files.move_to_end(b.key)
                    continue
            try:
                self._write(b.key, self.codec.encode(b))
            except OSError:
                errors += 1  # disk full or gone: the block is simply not kept
                continue
            nbytes += self.size
            with self._lock:
                self._files[b.key] = None
            self._trim()
        self.stats.add(bytes_in=nbytes, errors=errors)
        return []

    def _write(self, key: int, data: bytearray) -> None:
        # mkstemp: a fresh name, O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=self.dir)
        try:
            with open(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))  # renames over a link at the name; never writes through it
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

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


def _private_dir(path: Path) -> None:
    """Create `path` with mode 0700, or accept it only if it is this user's and closed to others."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as e:
        raise ValueError(f"KV offload directory {path} is not writable: {e.strerror or e}") from e
    try:
        st = path.stat()  # a symlink to a directory of one's own is fine: the directory is what is checked
    except OSError as e:
        raise ValueError(f"KV offload directory {path} cannot be read: {e.strerror or e}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"KV offload directory {path} is not a directory: give a directory path")
    if st.st_uid != os.geteuid():
        raise ValueError(f"KV offload directory {path} belongs to user id {st.st_uid}, not to this user "
                         f"({os.geteuid()}): give a path of your own (it is created with mode 0700)")
    if st.st_mode & 0o077:
        raise ValueError(f"KV offload directory {path} has mode {stat.S_IMODE(st.st_mode):04o}, open to other "
                         f"users, and its files hold prompts' tokens: run `chmod 700 {path}` or give a new "
                         "path (it is created with mode 0700)")


def _check_writable(path: Path) -> None:
    try:
        fd, probe = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"KV offload directory {path} is not writable: {e.strerror or e}") from e
