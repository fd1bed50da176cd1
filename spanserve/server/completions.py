"""POST /v1/completions: legacy text completions, batched prompts, n samples, SSE streaming."""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from spanserve.engine.outputs import RequestOutput
from spanserve.engine.sampling import TokenLogprobs
from spanserve.server.context import Prompt, ServingContext, Submission
from spanserve.server.errors import APIError, stream_error_payload
from spanserve.server.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                       new_id, now_s)
from spanserve.server.span import completion_layout
from spanserve.server.streaming import DONE, SSEResponse, TextDelta, fan_in, sse


def _logprobs(ctx: ServingContext, entries: Sequence[TokenLogprobs | None], offset: int) -> CompletionLogprobs:
    """Legacy logprobs for a run of tokens; `offset` is the text offset of the first one."""
    out = CompletionLogprobs()
    for lp in entries:
        if lp is None:
            continue
        tok = ctx.token_text(lp.token_id)
        out.tokens.append(tok)
        out.token_logprobs.append(lp.logprob)
        # The sampled token is always listed, so there can be logprobs + 1 entries (as vLLM does).
        top = {ctx.token_text(t): v for t, v in lp.top.items()}
        top.setdefault(tok, lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(tok)
    return out


async def create_completion(ctx: ServingContext, req: CompletionRequest, http: HTTPRequest) -> Response:
    ctx.check_model(req.model)
    prompts: list[Prompt]
    if req.segments is not None:
        prompts = [await completion_layout(ctx, req.segments)]
    else:
        try:
            batch = req.prompts()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from e
        prompts = [await ctx.encode(p) for p in batch]
    sub = await ctx.submit(new_id("cmpl"), prompts, req, req.max_tokens, req.logprobs)
    model = ctx.config.served_model_name
    if req.stream:
        return SSEResponse(_stream(ctx, req, sub, model), on_close=sub.abort)
    finals = await ctx.collect(sub, http)
    choices = [
        CompletionChoice(index=k, text=o.text, finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                         logprobs=_logprobs(ctx, o.logprobs or [], 0) if req.logprobs is not None else None)
        for k, o in enumerate(finals)
    ]
    resp = CompletionResponse(id=sub.id, created=now_s(), model=model, choices=choices, usage=sub.usage(finals))
    return Response(resp.model_dump_json(), media_type="application/json")


async def _stream(ctx: ServingContext, req: CompletionRequest, sub: Submission, model: str) -> AsyncIterator[bytes]:
    created = now_s()
    deltas = [TextDelta(sub.stops) for _ in sub.streams]
    offsets = [0] * len(sub.streams)
    finals: dict[int, RequestOutput] = {}
    include_usage = req.include_usage_in_stream
    try:
        async for k, out in fan_in(sub.streams):
            d = deltas[k]
            text = d.next(out.text, out.finished)
            logprobs = None
            if req.logprobs is not None:
                logprobs = _logprobs(ctx, (out.logprobs or [])[d.tokens:len(out.token_ids)], offsets[k])
                offsets[k] += sum(len(t) for t in logprobs.tokens)
            d.tokens = len(out.token_ids)
            if out.finished:
                finals[k] = out
            elif not text and not (logprobs and logprobs.tokens):
                continue
            choice = CompletionChoice(index=k, text=text, logprobs=logprobs,
                                      finish_reason=out.finish_reason if out.finished else None,
                                      stop_reason=out.stop_reason if out.finished else None)
            chunk = CompletionResponse(id=sub.id, created=created, model=model, choices=[choice])
            yield sse(chunk.model_dump_json(exclude={"usage"} if not include_usage else None))
        if include_usage:
            ordered = [finals[k] for k in sorted(finals)]
            chunk = CompletionResponse(id=sub.id, created=created, model=model, choices=[], usage=sub.usage(ordered))
            yield sse(chunk.model_dump_json())
    except Exception as e:  # headers are sent: the error can only travel in the stream
        yield sse(stream_error_payload(e))
    yield DONE
