"""What to offload where (`LLM(..., kv_offload=...)`, `--kv-offload-*`, `--kv-store`)."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping
from urllib.parse import parse_qsl, urlencode, urlsplit

from spanserve.model.fingerprint import model_fingerprint
from spanserve.sizes import parse_size

__all__ = ["OffloadConfig", "model_fingerprint"]

SECRET_ENV = "SPANSERVE_KV_SECRET"
MIN_SECRET_CHARS = 16


@dataclass(frozen=True, repr=False)
class OffloadConfig:
    cpu_bytes: int = 0  # host-memory tier (0: none)
    disk_path: str | None = None  # local-disk tier directory (None: none)
    disk_bytes: int = 100 * 2**30
    # remote tier: redis://[user:password@]host:port/db or rediss:// (TLS) (None: none)
    store_url: str | None = None
    store_timeout_ms: float = 50.0  # per batch round trip; a slower store is a miss
    # keys the MAC of every payload in the store and on disk; None: $SPANSERVE_KV_SECRET
    store_secret: str | None = None
    store_insecure: bool = False  # a store without a secret: trust whoever can write to it
    store_ttl_s: int = 7 * 24 * 3600  # store entries expire this long after they are written (0: never)
    writeback_blocks: int = 1024  # queued blocks before new write-backs are dropped
    # loads on a background thread while other requests run (the request waits for them);
    # False: inside admission, on the engine thread
    async_loads: bool = True

    def __post_init__(self) -> None:
        if not self.store_secret:  # "" is no secret, as an empty variable is
            object.__setattr__(self, "store_secret", os.environ.get(SECRET_ENV) or None)
        for name in ("cpu_bytes", "disk_bytes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"kv_offload {name} must be a size >= 0, got {getattr(self, name)!r}")
        if self.store_timeout_ms <= 0:
            raise ValueError(f"kv_offload store_timeout_ms must be > 0, got {self.store_timeout_ms}")
        if not isinstance(self.async_loads, bool):
            raise ValueError(f"kv_offload async_loads must be true or false, got {self.async_loads!r}")
        if self.writeback_blocks < 1:
            raise ValueError(f"kv_offload writeback_blocks must be >= 1, got {self.writeback_blocks}")
        self._check_store()

    def _check_store(self) -> None:
        if not isinstance(self.store_ttl_s, int) or isinstance(self.store_ttl_s, bool) or self.store_ttl_s < 0:
            raise ValueError(f"kv_offload store_ttl_s must be whole seconds >= 0 (0: no expiry), got {self.store_ttl_s!r}")
        if not isinstance(self.store_insecure, bool):
            raise ValueError(f"kv_offload store_insecure must be true or false, got {self.store_insecure!r}")
        if self.store_secret is not None and not isinstance(self.store_secret, str):
            raise ValueError(f"kv_offload store_secret must be a string, got {type(self.store_secret).__name__}")
        if self.store_secret is not None and len(self.store_secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the KV store secret has {len(self.store_secret)} characters; use at least "
                             f"{MIN_SECRET_CHARS} (for example the output of `openssl rand -hex 32`)")
        if self.store_url and self.store_secret is None and not self.store_insecure:
            raise ValueError(
                f"the shared KV store {redact_url(self.store_url)} needs a secret to authenticate the blocks "
                f"in it: set the environment variable {SECRET_ENV} (recommended) or pass --kv-store-secret "
                "(store_secret=...); or pass --kv-store-insecure (store_insecure=True) to use the store "
                "without one, trusting every block anyone who can write to it puts there")

    @property
    def secret(self) -> bytes | None:
        return self.store_secret.encode() if self.store_secret else None

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["store_url"] = self.store_url and redact_url(self.store_url)
        shown["store_secret"] = "<set>" if self.store_secret else None
        return f"OffloadConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

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


def redact_url(url: str) -> str:
    """`url` with its password (in the authority or a `password=` query argument) shown as ***."""
    try:
        parts = urlsplit(url)
        if parts.password is not None:
            host = parts.hostname or ""
            host = f"[{host}]" if ":" in host else host  # an IPv6 literal
            port = f":{parts.port}" if parts.port is not None else ""
            parts = parts._replace(netloc=f"{parts.username or ''}:***@{host}{port}")
        query = parse_qsl(parts.query, keep_blank_values=True)
        if any(k == "password" for k, _ in query):
            parts = parts._replace(query=urlencode([(k, "***" if k == "password" else v) for k, v in query], safe="/*"))
        return f"{parts.scheme}://{parts.netloc}{parts.path}" + (f"?{parts.query}" if parts.query else "")
    except ValueError:  # not parseable as a URL: it may be all secret
        return "<unparseable URL>"
