"""The driver's KV storage logs its block operations (copy on write, eager repositioning) so that
every worker replays them on its own heads, in order, before the next step reads the blocks."""
from __future__ import annotations

from typing import Any

from spanserve.worker.storage import KVStorage

Op = tuple[str, tuple[Any, ...]]


class RecordingStorage(KVStorage):
    """KVStorage that also keeps a log of its block operations until `drain`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._log: list[Op] = []
        self._inner = False  # copy_many of one job calls copy: log it once

    def copy_rotated(self, src: list[int], dst: list[int], delta: int, rotary: Any) -> None:
        super().copy_rotated(src, dst, delta, rotary)
        self._log.append(("copy_rotated", (list(src), list(dst), int(delta))))

    def copy(self, src: int, dst: int, n: int) -> None:
        super().copy(src, dst, n)
        if not self._inner:
            self._log.append(("copy", (int(src), int(dst), int(n))))

    def copy_many(self, jobs: list[tuple[int, int, int]]) -> None:
        self._inner = True
        try:
            super().copy_many(jobs)
        finally:
            self._inner = False
        if jobs:
            self._log.append(("copy_many", ([tuple(map(int, j)) for j in jobs],)))

    def drain(self) -> list[Op]:
        log, self._log = self._log, []
        return log


def replay(storage: KVStorage, ops: list[Op], rotary: Any) -> None:
    for name, args in ops:
        if name == "copy_rotated":
            storage.copy_rotated(*args, rotary)
        elif name == "copy":
            storage.copy(*args)
        elif name == "copy_many":
            storage.copy_many(*args)
        else:
            raise ValueError(f"unknown storage operation {name!r}")
