"""POST /v1/completions: legacy text completions, batched prompts, n samples, SSE streaming."""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from spanserve.engine.outputs import RequestOutput
from spanserve.engine.sampling import TokenLogprobs
from spanserve.server.auth import tenant_of
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


def _echo_logprobs(ctx: ServingContext, ids: Sequence[int], entries: Sequence[TokenLogprobs | None] | None,
                   n_top: int) -> CompletionLogprobs:
    """Legacy logprobs of the prompt itself (echo): its first token has none, as in OpenAI's."""
    out = CompletionLogprobs()
    offset = 0
    for i, t in enumerate(ids):
        tok = ctx.token_text(t)
        e = entries[i] if entries is not None else None
        out.tokens.append(tok)
        out.text_offset.append(offset)
        offset += len(tok)
        out.token_logprobs.append(None if e is None else e.logprob)
        if e is None:
            out.top_logprobs.append(None)
            continue
        top = {ctx.token_text(a): v for a, v in list(e.top.items())[:n_top]}
        top.setdefault(tok, e.logprob)
        out.top_logprobs.append(top)
    return out


def _joined(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                              top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


@dataclass
class _Echo:
    """What echo puts before each prompt's completion: its text and (with logprobs) its scores."""

    texts: list[str]
    ids: list[list[int]]

    def logprobs(self, ctx: ServingContext, req: CompletionRequest, p: int, out: RequestOutput) -> CompletionLogprobs:
        return _echo_logprobs(ctx, self.ids[p], out.prompt_logprobs, req.logprobs or 0)


async def _echo_of(ctx: ServingContext, batch: list[str | list[int]], prompts: list[Prompt]) -> _Echo:
    texts = [b if isinstance(b, str) else await ctx.decode(list(b)) for b in batch]
    return _Echo(texts, [list(p) for p in prompts])  # type: ignore[arg-type]


async def create_completion(ctx: ServingContext, req: CompletionRequest, http: HTTPRequest) -> Response:
    ctx.check_model(req.model)
    prompts: list[Prompt]
    echo: _Echo | None = None
    if req.segments is not None:
        prompts = [await completion_layout(ctx, req.segments)]
    else:
        try:
            batch = req.prompts()
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from e
        for p in batch:  # all of them before any is tokenized or copied
            ctx.check_size(p, "prompt")
        prompts = [await ctx.encode(p) for p in batch]
        if req.echo:
            echo = await _echo_of(ctx, batch, prompts)
    # echo with logprobs scores the prompt; max_tokens 0 (echo only) samples one token, dropped
    scored = [v for v in (req.prompt_logprobs, req.logprobs if req.echo else None) if v is not None]
    sub = await ctx.submit(new_id("cmpl"), prompts, req, req.max_tokens or 1, req.logprobs,
                           prompt_logprobs=max(scored) if scored else None, tenant=tenant_of(http))
    model = ctx.config.served_model_name
    if req.stream:
        return SSEResponse(_stream(ctx, req, sub, model, echo), on_close=sub.abort)
    finals = await ctx.collect(sub, http)
    choices = [_choice(ctx, req, k // req.n, k, o, echo) for k, o in enumerate(finals)]
    usage = sub.usage(finals)
    if req.max_tokens == 0:
        usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
    resp = CompletionResponse(id=sub.id, created=now_s(), model=model, choices=choices, usage=usage)
    return Response(resp.model_dump_json(), media_type="application/json")


def _choice(ctx: ServingContext, req: CompletionRequest, p: int, k: int, o: RequestOutput,
            echo: _Echo | None) -> CompletionChoice:
    keep = req.max_tokens != 0
    text = o.text if keep else ""
    logprobs = None
    if req.logprobs is not None:
        start = len(echo.texts[p]) if echo else 0
        logprobs = _logprobs(ctx, (o.logprobs or []) if keep else [], start)
        if echo:
            logprobs = _joined(echo.logprobs(ctx, req, p, o), logprobs)
    return CompletionChoice(index=k, text=(echo.texts[p] if echo else "") + text,
                            finish_reason=o.finish_reason if keep else "length",
                            stop_reason=o.stop_reason if keep else None, logprobs=logprobs,
                            prompt_logprobs=ctx.prompt_logprobs(o.prompt_logprobs, req.prompt_logprobs)
                            if req.prompt_logprobs is not None else None)


async def _stream(ctx: ServingContext, req: CompletionRequest, sub: Submission, model: str,
                  echo: _Echo | None) -> AsyncIterator[bytes]:
    created = now_s()
    deltas = [TextDelta(sub.stops) for _ in sub.streams]
    offsets = [len(echo.texts[k // req.n]) if echo else 0 for k in range(len(sub.streams))]
    echoed = [echo is None] * len(sub.streams)
    keep = req.max_tokens != 0
    finals: dict[int, RequestOutput] = {}
    include_usage = req.include_usage_in_stream
    try:
        async for k, out in fan_in(sub.streams):
            d = deltas[k]
            text = d.next(out.text, out.finished) if keep else ""
            logprobs = None
            if req.logprobs is not None:
                fresh = (out.logprobs or [])[d.tokens:len(out.token_ids)] if keep else []
                logprobs = _logprobs(ctx, fresh, offsets[k])
                offsets[k] += sum(len(t) for t in logprobs.tokens)
            d.tokens = len(out.token_ids)
            if not echoed[k] and echo is not None:  # the prompt goes first, once
                echoed[k] = True
                text = echo.texts[k // req.n] + text
                if logprobs is not None:
                    logprobs = _joined(echo.logprobs(ctx, req, k // req.n, out), logprobs)
            if out.finished:
                finals[k] = out
            elif not text and not (logprobs and logprobs.tokens):
                continue
            choice = CompletionChoice(index=k, text=text, logprobs=logprobs,
                                      finish_reason=(out.finish_reason if keep else "length") if out.finished else None,
                                      stop_reason=out.stop_reason if out.finished and keep else None)
            chunk = CompletionResponse(id=sub.id, created=created, model=model, choices=[choice])
            yield sse(chunk.model_dump_json(exclude={"usage"} if not include_usage else None))
        if include_usage:
            ordered = [finals[k] for k in sorted(finals)]
            usage = sub.usage(ordered)
            if not keep:
                usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
            chunk = CompletionResponse(id=sub.id, created=created, model=model, choices=[], usage=usage)
            yield sse(chunk.model_dump_json())
    except Exception as e:  # headers are sent: the error can only travel in the stream
        yield sse(stream_error_payload(e))
    yield DONE
