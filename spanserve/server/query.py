"""POST /v1/query/execute: run a span query (spnl's JSON) on the served model.

The Executor is synchronous: it plans a wave of generations, runs them, splices the results in
and plans the next wave. It runs on a worker thread of its own, and its Runner hands each wave to
the engine client on the event loop and blocks until the wave is done, so queries share the engine
(and its cache) with every other request instead of stopping it.

A query's `model` fields are not checked: spnl clients name their backend there
("ollama/granite3.2:2b", "spnl/..."), and whatever they name, the served model runs it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import Response

from spanserve.engine.client import (EngineClient, EngineDeadError, EngineOverloaded, EngineStepError,
                                           RequestSpec)
from spanserve.engine.outputs import RequestOutput
from spanserve.query import Node, QueryError, parse, to_obj
from spanserve.query.execute import Executor, Job, Outcome
from spanserve.query.optimize import OptimizeError, QueryTooLarge
from spanserve.query.plan import PromptTooLong
from spanserve.query.size import measure
from spanserve.server.auth import namespace_for, tenant_of
from spanserve.server.context import ServingContext, check_policy, usage_of, wait_disconnect
from spanserve.server.errors import APIError, bad_request
from spanserve.server.limits import RequestLimits, check_chars
from spanserve.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                       DeltaMessage, QueryCompletionResponse, QueryOutput, SpanQueryResult, new_id,
                                       now_s)
from spanserve.server.streaming import DONE, SSEResponse, fan_in, sse

DEFAULT_MAX_TOKENS = 256  # per generation that names no max_tokens


class _Cancelled(Exception):
    """The query's client went away; raised inside the executor to stop it between waves."""


class EngineRunner:
    """A query's Runner: called on the query's worker thread, runs each wave on the event loop."""

    def __init__(self, engine: EngineClient, loop: asyncio.AbstractEventLoop, query_id: str, namespace: str,
                 tenant: str = ""):
        self.engine = engine
        self.loop = loop
        self.query_id = query_id
        self.namespace = namespace
        self.tenant = tenant
        self._waves = itertools.count()
        self._lock = threading.Lock()
        self._cancelled = False
        self._inflight: concurrent.futures.Future[list[RequestOutput]] | None = None

    def run(self, jobs: list[Job]) -> list[RequestOutput]:
        wave = next(self._waves)
        specs = [RequestSpec(j.layout, j.params, f"{self.query_id}-{wave}-{k}", self.namespace, j.policy, self.tenant)
                 for k, j in enumerate(jobs)]
        with self._lock:  # checked and registered together, so cancel() cannot slip in between
            if self._cancelled:
                raise _Cancelled()
            fut = asyncio.run_coroutine_threadsafe(self._wave(specs), self.loop)
            self._inflight = fut
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            raise _Cancelled() from None

    def cancel(self) -> None:
        """Thread-safe: stop the wave in flight (its requests are aborted) and any later one."""
        with self._lock:
            self._cancelled = True
            if self._inflight is not None:
                self._inflight.cancel()

    async def _wave(self, specs: list[RequestSpec]) -> list[RequestOutput]:
        streams = await self.engine.add_requests(specs)
        finals: list[RequestOutput | None] = [None] * len(streams)
        # fan_in aborts every unfinished request however this ends (an error, or cancel()).
        async for k, out in fan_in(streams):
            if out.finished:
                finals[k] = out
        done = [f for f in finals if f is not None]
        if len(done) != len(finals):  # streams end finished or raise; this would be an engine bug
            raise EngineStepError("a query generation ended without a final output")
        return done


def parse_query(body: bytes, limits: RequestLimits, max_prompt_chars: int) -> Node:
    """The query, refused before anything runs or expands if it is malformed or too large."""
    try:
        query = parse(body)
    except QueryError as e:
        raise bad_request(f"invalid span query at {e}", param=e.path, code="invalid_query") from e
    except ValueError as e:  # bytes that are not UTF-8/16/32, which json.loads reports outside JSONDecodeError
        raise bad_request(f"invalid span query: {e}", param="$", code="invalid_query") from e
    size = measure(query)
    if size.generations == 0:
        raise bad_request("the query has no generation (g or chat) to run", param="$", code="invalid_query")
    if size.generations > limits.max_query_generations:
        raise bad_request(f"the query asks for {size.generations} generations with its repeats expanded; at most "
                          f"{limits.max_query_generations} per query", param="$", code="query_too_large")
    if size.nodes > limits.max_query_nodes:
        raise bad_request(f"the query has {size.nodes} nodes with its repeats expanded; at most "
                          f"{limits.max_query_nodes} per query: lower the repeat counts", param="$",
                          code="query_too_large")
    check_chars(size.input_chars, max_prompt_chars, "$", "a generation's input")
    return query


def _seed(value: str | None) -> int:
    if value is None:
        return 0
    try:
        seed = int(value)
    except ValueError:
        seed = -1
    if not 0 <= seed < 2**63:
        raise bad_request(f"query parameter seed must be an integer in [0, 2**63), got {value!r}", param="seed")
    return seed


def _flag(value: str | None, name: str) -> bool:
    if value is None or value.lower() in ("false", "0", ""):
        return False
    if value.lower() in ("true", "1"):
        return True
    raise bad_request(f"query parameter {name} must be true or false, got {value!r}", param=name)


async def execute_query(ctx: ServingContext, body: bytes, http: HTTPRequest) -> Response:
    stream = _flag(http.query_params.get("stream"), "stream")
    policy = http.query_params.get("policy")
    check_policy(policy)
    seed = _seed(http.query_params.get("seed"))
    query = parse_query(body, ctx.limits, ctx.max_prompt_chars)
    qid = new_id("chatcmpl")
    tenant = tenant_of(http)
    namespace = namespace_for(tenant, http.query_params.get("cache_salt"))
    runner = EngineRunner(ctx.engine, asyncio.get_running_loop(), qid, namespace, tenant or "")
    outcome = await _run(ctx, runner, query, policy, seed, http)
    root = [(p, o) for p, o in outcome.outputs.items() if "in" not in p]
    if not root:
        raise bad_request("the query has no generation outside another generation's input to answer with",
                          param="$", code="invalid_query")
    model = ctx.config.served_model_name
    usage = usage_of([o for _, o in root])
    extra = SpanQueryResult(outputs=[_output(p, o) for p, o in outcome.outputs.items()], query=_closure(outcome))
    if stream:
        return SSEResponse(_chunks(qid, model, root, usage))
    choices = [ChatChoice(index=k, message=AssistantMessage(content=o.text), finish_reason=o.finish_reason,
                          stop_reason=o.stop_reason) for k, (_, o) in enumerate(root)]
    resp = QueryCompletionResponse(id=qid, created=now_s(), model=model, choices=choices, usage=usage,
                                   span_query=extra)
    return Response(resp.model_dump_json(), media_type="application/json")


async def _run(ctx: ServingContext, runner: EngineRunner, query: Node, policy: str | None, seed: int,
               http: HTTPRequest) -> Outcome:
    def execute() -> Outcome:
        with ctx.borrowed_tokenizer() as tok:
            return Executor(runner, tok, policy=policy, seed=seed, max_tokens=DEFAULT_MAX_TOKENS,
                            max_prompt_chars=ctx.max_prompt_chars).execute(query)

    work = asyncio.get_running_loop().run_in_executor(ctx.query_pool, execute)
    gone = asyncio.ensure_future(wait_disconnect(http))
    either: set[asyncio.Future[Any]] = {work, gone}
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            runner.cancel()
            work.add_done_callback(_consume)  # its thread stops at the next wave boundary
    if not work.done():
        raise APIError(499, "client disconnected", code="client_disconnected")
    try:
        return work.result()
    except QueryTooLarge as e:
        raise bad_request(str(e), param="$", code="query_too_large") from e
    except PromptTooLong as e:
        raise bad_request(str(e), param="$", code="context_length_exceeded") from e
    except (QueryError, OptimizeError, ValueError, TypeError) as e:
        # Everything the planner, optimizer, sampler or engine refuses comes from the query.
        raise bad_request(f"the query cannot be executed: {e}", param="$", code="invalid_query") from e
    except EngineOverloaded as e:
        raise APIError(429, str(e), code="server_overloaded") from e
    except EngineStepError as e:
        raise APIError(500, str(e), type="server_error", code="engine_error") from e
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_unavailable") from e


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log "exception was never retrieved"


def _output(path: tuple[Any, ...], o: RequestOutput) -> QueryOutput:
    return QueryOutput(path=list(path), text=o.text, finish_reason=o.finish_reason,
                       prompt_tokens=len(o.prompt_token_ids), completion_tokens=len(o.token_ids),
                       cached_tokens=int(o.metrics.get("cached_tokens", 0)))


def _closure(outcome: Outcome) -> dict[str, Any]:
    try:
        return to_obj(outcome.query)
    except TypeError:  # a node with no wire form: the texts in `outputs` still say everything
        return {}


async def _chunks(qid: str, model: str, root: list[tuple[Any, RequestOutput]], usage: Any) -> AsyncIterator[bytes]:
    created = now_s()

    def chunk(choices: list[ChatChunkChoice], **extra: Any) -> bytes:
        c = ChatCompletionChunk(id=qid, object="chat.completion.chunk", created=created, model=model,
                                choices=choices, **extra)
        return sse(c.model_dump_json(exclude_unset=True))

    def choice(k: int, delta: DeltaMessage, finish: str | None = None) -> ChatChunkChoice:
        return ChatChunkChoice(index=k, delta=delta, logprobs=None, finish_reason=finish)

    # Execution has finished before the first byte: each answer goes out whole, then its finish.
    yield chunk([choice(k, DeltaMessage(role="assistant", content="")) for k in range(len(root))])
    for k, (_, o) in enumerate(root):
        if o.text:
            yield chunk([choice(k, DeltaMessage(content=o.text))])
    yield chunk([choice(k, DeltaMessage(), o.finish_reason or "stop") for k, (_, o) in enumerate(root)])
    yield chunk([], usage=usage)
    yield DONE
