"""Bearer-key access control for the HTTP API, as OpenAI's clients send it, and the tenant each
request acts for.

A pure ASGI middleware rather than a route dependency: it covers every route at once (those
added later too) and never wraps a streaming body. It puts the key's tenant in the request's
state (`tenant_of`); routes derive the cache namespace from it (`namespace_for`), so a client
can only ever name partitions of its own tenant's cache. Open paths (by default /health, for load
balancers; /metrics too with --metrics-open) pass without a key and act for no tenant.
"""
from __future__ import annotations

import json
from collections.abc import Collection

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from spanserve.server.keys import KeyRing

OPEN_PATHS = ("/health",)
METRICS_PATH = "/metrics"


def namespace_for(tenant: str | None, cache_salt: str | None) -> str:
    """The engine's cache namespace for a request: its tenant's, partitioned further by the
    client's cache_salt. Length-prefixed, so that no (tenant, salt) pair encodes as another
    (tenant "a" with salt "b:c" is not tenant "a:b" with salt "c"). Without access control
    (tenant None) the salt alone, as it always was."""
    salt = cache_salt or ""
    if tenant is None:
        return salt
    return f"tenant:{len(tenant)}:{tenant}:{salt}"


def tenant_of(http: Request) -> str | None:
    """The tenant the request's key belongs to; None on a server without keys."""
    return getattr(http.state, "tenant", None)


class BearerAuth:
    def __init__(self, app: ASGIApp, keys: KeyRing, open_paths: Collection[str] = OPEN_PATHS):
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)

    def _tenant(self, scope: Scope) -> str | None:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return self.keys.tenant_of(token.strip()) if scheme.lower() == b"bearer" else None
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        tenant = self._tenant(scope)
        if tenant is not None:
            # a new dict: the server's per-request copy of its state is not shared, but this
            # keeps it so whatever the server passes
            scope["state"] = {**scope.get("state", {}), "tenant": tenant}
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {
            "message": "missing or incorrect API key: send your key as 'Authorization: Bearer <key>' "
                       "(api_key= in the OpenAI clients)",
            "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="spanserve"')]})
        await send({"type": "http.response.body", "body": body})
