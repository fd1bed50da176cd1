"""Turning per-step engine outputs into a client stream: safe text deltas, fan-in of several
requests, and an SSE response that always releases its requests.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from spanserve.engine.client import RequestStream
from spanserve.engine.outputs import RequestOutput

DONE = b"data: [DONE]\n\n"


# JSON leaves these unescaped, but line readers built on str.splitlines (httpx's aiter_lines among
# them) break lines at them and would cut an event in two. Inside JSON strings, which is the only
# place they can occur, the escaped form means the same.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse(payload: str) -> bytes:
    """One server-sent event carrying a JSON payload."""
    return f"data: {payload.translate(_LINE_BREAKS)}\n\n".encode()


class TextDelta:
    """What may be sent of a request's cumulative text so far.

    Two things in the tail can still change once more tokens arrive, so they are held back until
    the request finishes: the start of a stop string (the engine trims a stop string it finds,
    and text already sent cannot be taken back) and U+FFFD from a multi-byte character whose
    remaining bytes are in the next token.
    """

    def __init__(self, stops: Sequence[str]):
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0  # characters of text already sent
        self.tokens = 0  # token ids already accounted for in sent logprobs

    def next(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            end -= self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent:
            return ""
        delta = text[self.sent:end]
        self.sent = end
        return delta


async def fan_in(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output), in arrival order.

    Cancelling or closing the consumer aborts every stream that has not finished."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    merged: asyncio.Queue[tuple[int, RequestOutput | None] | BaseException] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                merged.put_nowait((i, out))
            merged.put_nowait((i, None))
        except Exception as e:
            merged.put_nowait(e)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            item = await merged.get()
            if isinstance(item, BaseException):
                raise item
            i, got = item
            if got is None:
                remaining -= 1
            else:
                yield i, got
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


class SSEResponse(StreamingResponse):
    """A StreamingResponse that closes its body generator and runs `on_close` whatever ends it.

    Starlette cancels the sender on client disconnect but leaves the generator suspended for the
    garbage collector to close; its engine requests would hold their KV blocks until then."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Any] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._content, "aclose", None)
            if aclose is not None:
                await aclose()
            if self._on_close is not None:
                self._on_close()
