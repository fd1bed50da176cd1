"""One HTTP request run through an ASGI app in this process, its response streamed back as it is
produced: how a replica serves the single-server API to the gateway without a socket."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class HTTPCall:
    method: str
    path: str
    query: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""


@dataclass
class HTTPHead:
    """The first item of a streamed response; body chunks (bytes) follow."""

    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)


async def run_asgi(app: Any, call: HTTPCall) -> AsyncIterator[HTTPHead | bytes]:
    """Yields the response head, then each body chunk as the app sends it. Closing the
    iterator early (the client went away) tells the app the client disconnected."""
    out: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await out.put(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": call.method.upper(),
        "scheme": "http", "path": call.path, "raw_path": call.path.encode("utf-8"),
        "query_string": call.query.encode("latin-1"), "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in call.headers],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
    }

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)

    task = asyncio.ensure_future(run())
    try:
        while True:
            msg = await out.get()
            if msg is None:
                break
            if msg["type"] == "http.response.start":
                yield HTTPHead(msg["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                               for k, v in msg.get("headers", [])])
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body", False):
                    break
        await task  # surfaces an exception the app raised instead of answering
    finally:
        gone.set()
        if not task.done():  # the reader left early: the app's own cleanup runs on cancellation
            task.cancel()
