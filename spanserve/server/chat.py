"""POST /v1/chat/completions: the model's chat template, n samples, SSE streaming."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from spanserve.engine.outputs import RequestOutput
from spanserve.engine.sampling import TokenLogprobs
from spanserve.server.auth import tenant_of
from spanserve.server.context import Prompt, ServingContext, Submission
from spanserve.server.errors import stream_error_payload
from spanserve.server.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                       ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
                                       ChatTokenLogprob, DeltaMessage, TopLogprob, new_id, now_s)
from spanserve.server.span import chat_layout, is_span_chat
from spanserve.server.streaming import DONE, SSEResponse, TextDelta, fan_in, sse
from spanserve.server.tools import ToolDeltas, ToolUse, assistant_message, plan_tools


def _top(ctx: ServingContext, token_id: int, logprob: float) -> TopLogprob:
    text = ctx.token_text(token_id)
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))


def _logprobs(ctx: ServingContext, entries: Sequence[TokenLogprobs | None]) -> ChatLogprobs:
    content = []
    for lp in entries:
        if lp is None:
            continue
        chosen = _top(ctx, lp.token_id, lp.logprob)
        alts = [_top(ctx, t, v) for t, v in lp.top.items()]
        content.append(ChatTokenLogprob(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes,
                                        top_logprobs=alts))
    return ChatLogprobs(content=content)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, http: HTTPRequest) -> Response:
    ctx.check_model(req.model)
    # Off the event loop: checking schemas against their metaschema is Python work.
    use = await asyncio.get_running_loop().run_in_executor(None, plan_tools, req, ctx.chat_setup,
                                                           ctx.limits.max_schema_bytes)
    tools = use.template_tools() if use is not None else None
    prompt: Prompt
    tenant = tenant_of(http)
    if is_span_chat(req.messages):
        prompt = await chat_layout(ctx, req.messages, req.add_generation_prompt, tools, tenant or "")
    else:
        prompt = await ctx.render_chat(req.messages, req.add_generation_prompt, tools, tenant or "")
    if use is not None and use.response_format is not None:
        req = req.model_copy(update={"response_format": use.response_format})
    n_top = (req.top_logprobs or 0) if req.logprobs else None
    sub = await ctx.submit(new_id("chatcmpl"), [prompt], req, req.max_new_tokens, n_top, tenant=tenant)
    model = ctx.config.served_model_name
    if req.stream:
        return SSEResponse(_stream(ctx, req, sub, model, use), on_close=sub.abort)
    finals = await ctx.collect(sub, http)
    choices = []
    for k, o in enumerate(finals):
        message, reason = assistant_message(o.text, o.finish_reason, use)
        choices.append(ChatChoice(index=k, message=message, finish_reason=reason, stop_reason=o.stop_reason,
                                  logprobs=_logprobs(ctx, o.logprobs or []) if req.logprobs else None))
    resp = ChatCompletionResponse(id=sub.id, created=now_s(), model=model, choices=choices,
                                  usage=sub.usage(finals),
                                  prompt_logprobs=ctx.prompt_logprobs(finals[0].prompt_logprobs, req.prompt_logprobs)
                                  if req.prompt_logprobs is not None and finals else None)
    return Response(resp.model_dump_json(), media_type="application/json")


async def _stream(ctx: ServingContext, req: ChatCompletionRequest, sub: Submission,
                  model: str, use: ToolUse | None) -> AsyncIterator[bytes]:
    created = now_s()
    include_usage = req.include_usage_in_stream

    def chunk(choices: list[ChatChunkChoice], **usage: object) -> bytes:
        c = ChatCompletionChunk(id=sub.id, object="chat.completion.chunk", created=created, model=model,
                                choices=choices, **usage)  # type: ignore[arg-type]
        if include_usage and not usage:
            c.usage = None  # marks the field set: every chunk then carries "usage": null, as OpenAI's do
        return sse(c.model_dump_json(exclude_unset=True))

    deltas = [TextDelta(sub.stops) for _ in sub.streams]
    calls = [ToolDeltas.of(use) for _ in sub.streams]
    finals: dict[int, RequestOutput] = {}
    try:
        # Roles first, as OpenAI does, so a client can set up each message before any content.
        yield chunk([ChatChunkChoice(index=k, delta=DeltaMessage(role="assistant", content=""), logprobs=None,
                                     finish_reason=None) for k in range(len(sub.streams))])
        async for k, out in fan_in(sub.streams):
            d, c = deltas[k], calls[k]
            text = d.next(out.text, out.finished)
            logprobs = _logprobs(ctx, (out.logprobs or [])[d.tokens:len(out.token_ids)]) if req.logprobs else None
            d.tokens = len(out.token_ids)
            delta, reason = _delta(text, out, c)
            if out.finished:
                finals[k] = out
            elif delta is None and not (logprobs and logprobs.content):
                continue
            choice = ChatChunkChoice(index=k, delta=delta or DeltaMessage(), logprobs=logprobs, finish_reason=reason)
            if out.finished:
                choice.stop_reason = out.stop_reason
            yield chunk([choice])
        if include_usage:
            yield chunk([], usage=sub.usage([finals[k] for k in sorted(finals)]))
    except Exception as e:  # headers are sent: the error can only travel in the stream
        yield sse(stream_error_payload(e))
    yield DONE


def _delta(text: str, out: RequestOutput, calls: ToolDeltas | None) -> tuple[DeltaMessage | None, str | None]:
    """The chunk's delta (None when it carries nothing) and finish reason, for new text."""
    reason = out.finish_reason if out.finished else None
    if calls is None:
        return (DeltaMessage(content=text) if text else None), reason
    content, tool_calls = calls.feed(text, out.finished)
    delta = DeltaMessage()
    if content:
        delta.content = content
    if tool_calls:
        delta.tool_calls = tool_calls
    return (delta if content or tool_calls else None), calls.finish_reason(reason)
