"""Remote tier on Redis (or Valkey: same protocol): content addressed, so any number of servers
share it. Every batch is one pipelined round trip with bounded socket timeouts; a store that
stops, restarts or stalls costs misses (holes), never an error or a hang. After a failure the
tier stays quiet for `retry_s` instead of paying a timeout per request, then tries again (the
client reconnects by itself).

The URL may carry an ACL user and password (`redis://user:password@host:port/db`) and ask for
TLS (`rediss://`, CA file as `?ssl_ca_certs=PATH`); messages show it with the password masked.
Payloads carry a MAC under the store secret: one that fails it is counted (`auth_failures`),
deleted (so the recomputed block is written in its place) and a hole. Writes set a TTL."""
from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import redis as redis_client
import redis.exceptions as redis_exc

from spanserve.cache.tiers.base import Tier
from spanserve.cache.tiers.config import redact_url
from spanserve.cache.tiers.payload import AuthFailure, BadPayload, BlockKV, PayloadCodec

_BATCH = 64  # keys per round trip: bounds the bytes one reply carries


class RedisTier(Tier):
    name = "store"
    remote = True

    def __init__(self, url: str, codec: PayloadCodec, timeout_ms: float = 50.0, retry_s: float = 1.0,
                 ttl_s: int = 0):
        super().__init__()
        if timeout_ms <= 0:
            raise ValueError(f"KV store timeout must be > 0 ms, got {timeout_ms}")
        self.url = redact_url(url)  # the only form of it kept: messages and logs never show the password
        self.codec, self.ttl_s = codec, ttl_s or None
        t = timeout_ms / 1000
        try:
            self.client = redis_client.Redis.from_url(url, socket_timeout=t, socket_connect_timeout=t,
                                                      retry_on_timeout=False)
        except ValueError as e:
            raise ValueError(f"bad KV store URL {self.url!r}: {e}; use redis://[user:password@]host:port/db "
                             "or rediss://...") from e
        try:
            self.client.ping()
        except (redis_exc.AuthenticationError, redis_exc.AuthorizationError, redis_exc.NoPermissionError) as e:
            raise ValueError(f"KV store at {self.url} refused the login ({e}); check the user and password "
                             "in the URL (redis://user:password@host:port/db)") from e
        except redis_client.RedisError as e:
            raise ValueError(f"KV store at {self.url} is unreachable: {e}") from e
        self.prefix = b"spanserve:kv:" + codec.fingerprint.hex().encode() + b":"
        self.retry_s = retry_s
        self._down_until = 0.0

    def _key(self, key: int) -> bytes:
        return self.prefix + f"{key:032x}".encode()

    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self) -> None:
        self._down_until = time.monotonic() + self.retry_s
        self.stats.add(errors=1)

    def contains_many(self, keys: Sequence[int]) -> np.ndarray:
        out = np.zeros(len(keys), bool)
        if not keys or not self._up():
            return out
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._key(k))
            out[:] = [bool(n) for n in pipe.execute()]
        except redis_client.RedisError:
            self._failed()
        return out

    def load_many(self, keys: Sequence[int]) -> list[BlockKV | None]:
        t0 = time.perf_counter()
        out: list[BlockKV | None] = [None] * len(keys)
        bad: list[bytes] = []
        forged = nbytes = 0
        if keys and self._up():
            try:
                for lo in range(0, len(keys), _BATCH):
                    part = keys[lo: lo + _BATCH]
                    for i, data in enumerate(self.client.mget([self._key(k) for k in part])):
                        if data is None:
                            continue
                        try:
                            out[lo + i] = self.codec.decode(data, part[i])
                            nbytes += len(data)
                        except BadPayload as e:
                            forged += isinstance(e, AuthFailure)
                            bad.append(self._key(part[i]))
                if bad:  # gone, so the next write-through of the recomputed block replaces it
                    self.client.delete(*bad)
            except redis_client.RedisError:
                self._failed()
        hits = sum(b is not None for b in out)
        self.stats.loaded(hits, len(keys) - hits, nbytes, time.perf_counter() - t0)
        self.stats.add(bad_payloads=len(bad) - forged, auth_failures=forged)
        return out

    def store_many(self, blocks: Sequence[BlockKV]) -> list[BlockKV]:
        if not blocks or not self._up():
            return []
        nbytes = 0
        try:
            for lo in range(0, len(blocks), _BATCH):
                part = blocks[lo: lo + _BATCH]
                # content addressed: a key already there holds these bytes, so send only new ones
                there = self.contains_many([b.key for b in part])
                pipe = self.client.pipeline(transaction=False)
                for b in (b for b, t in zip(part, there) if not t):
                    data = self.codec.encode(b)
                    nbytes += len(data)
                    pipe.set(self._key(b.key), data, ex=self.ttl_s)
                pipe.execute()
        except redis_client.RedisError:
            self._failed()
        self.stats.add(bytes_in=nbytes)
        return []

    def close(self) -> None:
        self.client.close()
