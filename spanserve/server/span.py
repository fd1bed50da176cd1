"""Span extensions of the OpenAI routes: `segments` layouts on /v1/completions, `"kind": "plus"`
messages on /v1/chat/completions, and pinned segments (POST/DELETE /v1/segments).

Text is tokenized here, on the tokenizer worker, and handed to the engine as token-id segments:
the server then knows every segment's length for the context budget before anything is queued,
and the engine sees exactly the tokens a client would get from a plain prompt of that text.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from spanserve.engine.client import EngineDeadError, EngineOverloaded
from spanserve.engine.layout import Segment
from spanserve.query.ir import Assistant, Cross, Message, Node, Plus, System, User
from spanserve.query.plan import Planner, PromptTooLong, Turn
from spanserve.server.auth import namespace_for
from spanserve.server.context import ServingContext
from spanserve.server.errors import APIError, bad_request
from spanserve.server.limits import message_chars
from spanserve.server.protocol import (ChatMessage, PinnedSegment, PinRequest, PinResponse, PinSegment,
                                       SpanSegment, UnpinResponse)

_ROLES: dict[str, type[Message]] = {"system": System, "user": User, "assistant": Assistant}


def is_span_chat(messages: Sequence[ChatMessage]) -> bool:
    return any(m.kind == "plus" for m in messages)


def _check_text(ctx: ServingContext, segments: Sequence[SpanSegment | PinSegment]) -> None:
    ctx.check_chars(sum(len(s.text) for s in segments if s.text is not None), "segments", "the segments' text")


async def completion_layout(ctx: ServingContext, segments: Sequence[SpanSegment]) -> list[Segment]:
    _check_text(ctx, segments)
    out: list[Segment] = []
    for i, s in enumerate(segments):
        ids = await ctx.encode(s.text if s.text is not None else list(s.token_ids or []), f"segments.{i}")
        if not ids:
            raise bad_request(f"segment {i} is empty; drop it or give it text", param=f"segments.{i}")
        try:
            out.append(Segment(token_ids=ids, kind=s.kind, anchor=s.anchor, key=s.key))
        except ValueError as e:  # e.g. an anchor on a cross segment
            raise bad_request(f"segment {i}: {e}", param=f"segments.{i}") from e
    return out


def _message_node(i: int, m: ChatMessage) -> Message:
    fields = m.as_template_dict()
    cls = _ROLES.get(m.role)
    if cls is not None and set(fields) == {"role", "content"}:
        return cls(str(fields["content"]))
    if m.role not in (*_ROLES, "tool"):
        raise bad_request(f"messages.{i}: role {m.role!r} cannot be used in a chat with plus messages; "
                          f"use one of {sorted((*_ROLES, 'tool'))}", param=f"messages.{i}.role")
    # tool results, calls and names reach the template whole
    return Turn(str(fields["content"]), json.dumps(fields))


def chat_query(messages: Sequence[ChatMessage]) -> Node:
    """The conversation as a span-query input: each run of consecutive plus messages is a Plus,
    so every one of them becomes a standalone segment rendered by the template on its own."""
    items: list[Node] = []
    run: list[Node] = []
    for i, m in enumerate(messages):
        node = _message_node(i, m)
        if m.kind == "plus":
            run.append(node)
            continue
        if run:
            items.append(Plus(tuple(run)))
            run = []
        items.append(node)
    if run:
        items.append(Plus(tuple(run)))
    return Cross(tuple(items))


async def chat_layout(ctx: ServingContext, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                      tools: list[dict[str, Any]] | None = None, tenant: str = "") -> list[Segment]:
    """The conversation as a span layout: each plus message (a document a tool returned, say)
    a standalone segment, rendered by the template on its own."""
    tok = ctx.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", code="no_chat_template")
    ctx.check_chars(message_chars(messages), "messages", "the conversation")
    query = chat_query(messages)

    def plan(tok: Any) -> list[Segment]:
        try:
            planner = Planner(tok, max_chars=ctx.max_prompt_chars, tools=tools,
                              encode=lambda text: ctx.encode_pieces(tok, text, tenant))
            return planner.layout(query, add_generation_prompt)
        except PromptTooLong as e:
            raise bad_request(str(e), param="messages", code="context_length_exceeded") from e
        except Exception as e:  # templates raise on conversations they reject (role order etc.)
            raise bad_request(f"the chat template rejected these messages: {e}", param="messages") from e

    return list(await ctx.on_tokenizer(plan))


# ---------------------------------------------------------------------------- pinning


async def pin_segments(ctx: ServingContext, req: PinRequest, tenant: str | None = None) -> PinResponse:
    """Pin for `tenant` (None without access control): in its namespace, counted against its quota."""
    namespace = namespace_for(tenant, req.cache_salt)
    segs: list[Segment] = []
    keys: list[str] = []
    _check_text(ctx, req.segments)
    for i, s in enumerate(req.segments):
        ids = await ctx.encode(s.text if s.text is not None else list(s.token_ids or []), f"segments.{i}")
        if not ids:
            raise bad_request(f"segment {i} is empty; drop it or give it text", param=f"segments.{i}")
        # Named explicitly, as the engine would name it (its text), so the answer can say which
        # key to DELETE even for token-id segments.
        key = s.key if s.key is not None else s.text if s.text is not None else await _decoded(ctx, ids)
        if key in keys:
            raise bad_request(f"segment {i} repeats the key {key!r} of segment {keys.index(key)}",
                              param=f"segments.{i}.key")
        keys.append(key)
        segs.append(Segment(token_ids=ids, kind="plus", key=key))
    if sum(len(s.token_ids or ()) for s in segs) >= ctx.max_model_len:
        raise bad_request(f"these segments hold more than the model's {ctx.max_model_len}-token context; "
                          "pin them in smaller requests", param="segments", code="context_length_exceeded")
    try:
        stream = await ctx.engine.pin(segs, namespace, tenant=tenant or "")
    except ValueError as e:  # out-of-range token ids
        raise _pin_refused(e) from e
    except EngineOverloaded as e:
        raise APIError(429, str(e), code="server_overloaded") from e
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_unavailable") from e
    final = None
    try:
        async for out in stream:
            final = out
    except ValueError as e:  # the engine core refused it: over the pin budget or the tenant's quota
        raise _pin_refused(e) from e
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_unavailable") from e
    finally:
        stream.abort()
    if final is None or final.finish_reason != "stop":
        # The engine fails a request it can never admit (e.g. the pool is held by pins).
        raise bad_request("the segments could not be encoded: the KV pool has no room for them; "
                          "unpin something or pin fewer", param="segments", code="pin_failed")
    return PinResponse(data=[PinnedSegment(key=k, tokens=len(s.token_ids or ())) for k, s in zip(keys, segs)],
                       cache_salt=req.cache_salt)


def _pin_refused(e: ValueError) -> APIError:
    text = str(e)
    code = "pin_budget_exceeded" if "pin budget" in text else "pin_quota_exceeded" if "pin quota" in text else None
    return bad_request(text, param="segments", code=code)


async def _decoded(ctx: ServingContext, ids: list[int]) -> str:
    if ctx.tokenizer is None:
        raise bad_request("this model has no tokenizer: give token-id segments a key", param="segments")
    return str(await ctx.on_tokenizer(lambda tok: tok.decode(ids, skip_special_tokens=True)))


async def unpin_segment(ctx: ServingContext, key: str, cache_salt: str | None,
                        tenant: str | None = None) -> UnpinResponse:
    """Unpin `key` in the tenant's namespace: another tenant's pin is not there, so it gets the
    404 a key never pinned gets."""
    try:
        found = await ctx.engine.call("unpin", key, namespace_for(tenant, cache_salt))
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_unavailable") from e
    if not found:
        salt = f" with cache_salt {cache_salt!r}" if cache_salt else ""
        raise APIError(404, f"no segment is pinned under the key {key!r}{salt}", param="key",
                       code="segment_not_found")
    return UnpinResponse(key=key)
