"""What to offload where (`LLM(..., kv_offload=...)`, `--kv-offload-*`, `--kv-store`)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from spanserve.model.fingerprint import model_fingerprint
from spanserve.sizes import parse_size

__all__ = ["OffloadConfig", "model_fingerprint"]




@dataclass(frozen=True)
class OffloadConfig:
    cpu_bytes: int = 0  # host-memory tier (0: none)
    disk_path: str | None = None  # local-disk tier directory (None: none)
    disk_bytes: int = 100 * 2**30
    store_url: str | None = None  # remote tier, redis://host:port/db (None: none)
    store_timeout_ms: float = 50.0  # per batch round trip; a slower store is a miss
    writeback_blocks: int = 1024  # queued blocks before new write-backs are dropped
    # loads on a background thread while other requests run (the request waits for them);
    # False: inside admission, on the engine thread
    async_loads: bool = True

    def __post_init__(self) -> None:
        for name in ("cpu_bytes", "disk_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"kv_offload {name} must be a size >= 0, got {getattr(self, name)!r}")
        if self.store_timeout_ms <= 0:
            raise ValueError(f"kv_offload store_timeout_ms must be > 0, got {self.store_timeout_ms}")
        if not isinstance(self.async_loads, bool):
            raise ValueError(f"kv_offload async_loads must be true or false, got {self.async_loads!r}")
        if self.writeback_blocks < 1:
            raise ValueError(f"kv_offload writeback_blocks must be >= 1, got {self.writeback_blocks}")

    @property
    def enabled(self) -> bool:
        return bool(self.cpu_bytes or self.disk_path or self.store_url)

    @classmethod
    def of(cls, value: "OffloadConfig | Mapping[str, Any] | None") -> "OffloadConfig | None":
        """A config from itself, a dict (sizes may be strings like '8GiB'), or None (off)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"kv_offload must be an OffloadConfig or a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown kv_offload settings {sorted(unknown)}; known: {sorted(known)}")
        args = dict(value)
        for name in ("cpu_bytes", "disk_bytes"):
            if isinstance(args.get(name), str):
                args[name] = parse_size(args[name])
        return cls(**args)
