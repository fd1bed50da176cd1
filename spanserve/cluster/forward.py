"""What the gateway sends back when a replica cannot answer. (Its own module: Ray Serve ships the
gateway class by value, and module-level helpers beside it do not travel with it.)"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError


async def relay_stream(stream: Any) -> AsyncIterator[bytes]:
    """A streamed body after its head; a replica lost midway ends it with an error event."""
    try:
        async for chunk in stream:
            yield chunk
    except RayActorError as e:
        err = {"error": {"message": f"the replica serving this stream stopped ({type(e).__name__}); retry",
                         "type": "server_error", "param": None, "code": "replica_unavailable"}}
        yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()


def error_response(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=status)
