"""API keys and the tenants they belong to.

Keys come from `--api-key` or `$SPANSERVE_API_KEY` (tenant "default") and from a keys file of
`TENANT KEY` lines (`--api-keys-file`), which the server reads again on SIGHUP. A tenant may hold
several keys (to rotate them); a key belongs to one tenant. Keys are compared in constant time
and never logged: errors name the line, never its text.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import re
from pathlib import Path

log = logging.getLogger("spanserve.keys")

DEFAULT_TENANT = "default"  # the tenant of --api-key / $SPANSERVE_API_KEY
TENANT_NAME = re.compile(r"[A-Za-z0-9_.@+-]{1,128}")


def parse_keys(text: str, source: str) -> dict[str, str]:
    """key -> tenant from a keys file's text: one `TENANT KEY` pair per line, blank lines and
    lines starting with # ignored. ValueError naming the line for anything else."""
    keys: dict[str, str] = {}
    line_of: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        if len(fields) != 2:
            what = "a tenant name or a key is missing" if len(fields) == 1 else f"{len(fields)} fields"
            raise ValueError(f"{source} line {n}: expected 'TENANT KEY' (two fields separated by spaces): {what}; "
                             "comments go on lines of their own, starting with #")
        tenant, key = fields
        if not TENANT_NAME.fullmatch(tenant):
            raise ValueError(f"{source} line {n}: the tenant name must be 1 to 128 letters, digits or _.@+- "
                             "characters")
        if key in keys:
            raise ValueError(f"{source} line {n}: this key is also on line {line_of[key]}; give every key once "
                             "(a key belongs to one tenant)")
        keys[key], line_of[key] = tenant, n
    if not keys:
        raise ValueError(f"{source} holds no keys; add 'TENANT KEY' lines (or drop --api-keys-file)")
    return keys


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class KeyRing:
    """The keys the server accepts now. `tenant_of(token)` is the key's tenant, or None."""

    def __init__(self, api_key: str | None = None, keys_file: str | None = None):
        if not api_key and not keys_file:
            raise ValueError("no API key: give --api-key, $SPANSERVE_API_KEY or --api-keys-file, or leave "
                             "access control off")
        self.api_key = api_key or None
        self.path = keys_file
        self._table = self._load()

    @property
    def tenants(self) -> set[str]:
        return {t for _, t in self._table}

    def __len__(self) -> int:
        return len(self._table)

    def _load(self) -> list[tuple[bytes, str]]:
        keys: dict[str, str] = {}
        if self.path is not None:
            try:
                text = Path(self.path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"cannot read the API keys file {self.path}: {e}") from e
            keys = parse_keys(text, self.path)
        if self.api_key is not None:
            if keys.get(self.api_key, DEFAULT_TENANT) != DEFAULT_TENANT:
                raise ValueError(f"the key of --api-key / $SPANSERVE_API_KEY is also in {self.path}, for another "
                                 f"tenant; it belongs to tenant {DEFAULT_TENANT!r}: give it once")
            keys[self.api_key] = DEFAULT_TENANT
        return [(_digest(k.encode()), t) for k, t in keys.items()]

    def reload(self) -> bool:
        """Read the keys file again; a file that is now bad keeps the keys as they were (logged)."""
        try:
            table = self._load()
        except ValueError as e:
            log.error("API keys not reloaded, the current ones stay: %s", e)
            return False
        self._table = table  # one assignment: a request sees the old table or the new one
        log.info("API keys reloaded from %s: %d keys of %d tenants", self.path, len(table), len({t for _, t in table}))
        return True

    def tenant_of(self, token: bytes) -> str | None:
        """The tenant whose key `token` is. Every key is compared, in constant time, so the time
        taken says nothing about how close a guess came or which key matched."""
        digest = _digest(token)
        found = None
        for d, tenant in self._table:
            if hmac.compare_digest(d, digest):
                found = tenant
        return found
