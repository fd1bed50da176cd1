"""Bearer-key access control for the HTTP API, as OpenAI's clients send it.

A pure ASGI middleware rather than a route dependency: it covers every route at once (those
added later too) and never wraps a streaming body. Open paths (by default /health and /metrics,
for load balancers and Prometheus) pass without a key.
"""
from __future__ import annotations

import hmac
import json
from collections.abc import Collection

from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = ("/health", "/metrics")


class BearerAuth:
    def __init__(self, app: ASGIApp, api_key: str, open_paths: Collection[str] = OPEN_PATHS):
        if not api_key:
            raise ValueError("api_key is empty; pass a key or leave access control off")
        self.app = app
        self._key = api_key.encode()
        self.open_paths = frozenset(open_paths)

    def _allowed(self, scope: Scope) -> bool:
        if scope["path"] in self.open_paths:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # constant time: the comparison must not leak how much of a guess was right
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {
            "message": "missing or incorrect API key: send the server's key as 'Authorization: Bearer <key>' "
                       "(api_key= in the OpenAI clients)",
            "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="spanserve"')]})
        await send({"type": "http.response.body", "body": body})
