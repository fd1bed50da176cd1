"""Everything a route needs to turn an API request into engine requests and collect them.

Text is tokenized on a pool of threads with tokenizer copies of their own (server/tokenizers.py),
after its length is checked against the most characters a prompt fitting the context can have
(server/limits.py): nothing a client sends is tokenized before it is bounded.
"""
from __future__ import annotations

import asyncio
import copy
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request as HTTPRequest

from spanserve.engine.client import (
    EngineClient,
    EngineDeadError,
    EngineOverloaded,
    EngineStepError,
    RequestSpec,
    RequestStream,
)
from spanserve.engine.layout import Segment
from spanserve.engine.outputs import RequestOutput
from spanserve.engine.params import SamplingParams
from spanserve.engine.sampling import TokenLogprobs
from spanserve.reuse.policies import resolve_policy
from spanserve.server.auth import namespace_for
from spanserve.server.errors import APIError, bad_request
from spanserve.server.grammars import GrammarPool
from spanserve.server.limits import (RequestLimits, check_chars, check_choices, check_logit_bias, check_schema,
                                     check_stops, chars_per_token, message_chars)
from spanserve.server.metrics import ServerMetrics
from spanserve.server.protocol import (
    SEED_MAX,
    SEED_MIN,
    ChatMessage,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    ReuseCounts,
    SamplingRequest,
    Usage,
)
from spanserve.server.streaming import fan_in
from spanserve.server.pieces import PieceCache
from spanserve.server.tokenizers import TokenizerPool, encode, warmed_copy
from spanserve.toolcall.chat_setup import resolve_chat_setup, template_text

log = logging.getLogger(__name__)

# A prompt as the engine takes it: token ids, or a span layout of token-id segments.
Prompt = list[int] | list[Segment]

# Span queries executing at once; each holds a worker thread while its generations run.
MAX_QUERY_WORKERS = 16


@dataclass
class ServerConfig:
    served_model_name: str
    model_source: str
    # Requests in flight (running + waiting) before new ones get 429; None = unbounded.
    max_pending: int | None = None
    # Unknown request fields: False = ignored with a warning, True = 400 naming the field.
    strict_params: bool = False
    # Bearer key of tenant "default", and a file of `TENANT KEY` lines: with either, every route
    # but /health (and /metrics with metrics_open) needs a key; with auth_all_routes those too.
    api_key: str | None = None
    api_keys_file: str | None = None
    auth_all_routes: bool = False
    metrics_open: bool = False
    # /health answers 503 once requests have waited this long on an engine that finished no step
    step_timeout_s: float = 60.0
    limits: RequestLimits = field(default_factory=RequestLimits)
    # --chat-template (a shipped template's name or a file; None: the model's) and
    # --tool-call-parser (a format, "auto" to recognise it in the template, or "none")
    chat_template: str | None = None
    tool_call_parser: str = "auto"


@dataclass
class Submission:
    """The engine requests behind one API request; stream k is choice k (prompt k // n, sample k % n)."""

    id: str
    streams: list[RequestStream]
    prompt_lens: list[int]
    n: int
    stops: list[str] = field(default_factory=list)

    def abort(self) -> None:
        for s in self.streams:
            s.abort()

    def usage(self, finals: Sequence[RequestOutput]) -> Usage:
        prompt = sum(self.prompt_lens)
        completion = sum(len(o.token_ids) for o in finals)
        # Samples of one prompt share it, so its cached count is reported once, from sample 0.
        return usage_of(finals[0::self.n], prompt, completion)


def usage_of(outputs: Sequence[RequestOutput], prompt: int | None = None, completion: int | None = None) -> Usage:
    """Usage summed over outputs; prompt/completion override the sums (samples sharing a prompt)."""
    if prompt is None:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
    if completion is None:
        completion = sum(len(o.token_ids) for o in outputs)
    reuse = ReuseCounts()
    for o in outputs:
        for kind, n in (o.metrics.get("reuse") or {}).items():
            if kind in ReuseCounts.model_fields:
                setattr(reuse, kind, getattr(reuse, kind) + int(n))
    cached = sum(int(o.metrics.get("cached_tokens", 0)) for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached, reuse=reuse))


class ServingContext:
    def __init__(self, engine: EngineClient, config: ServerConfig, metrics: ServerMetrics):
        self.engine = engine
        self.config = config
        self.limits = config.limits.check()
        self.metrics = metrics
        self.max_model_len: int = engine.info.max_model_len
        tok = engine.tokenizer
        self.chat_setup = resolve_chat_setup(template_text(tok), config.chat_template, config.tool_call_parser)
        log.info("%s", self.chat_setup.describe())
        if tok is not None and self.chat_setup.template != template_text(tok):
            tok = copy.deepcopy(tok)  # the engine client's tokenizer is not this context's to change
            tok.chat_template = self.chat_setup.template
        # Read on the event loop only (token texts, the chat template): workers encode with copies.
        self.tokenizer: Any = warmed_copy(tok) if tok is not None else None
        self.tokenizers = TokenizerPool(tok, self.limits.tokenizer_workers) if tok is not None else None
        self.pieces = PieceCache(self.tokenizer) if tok is not None else None
        self.max_prompt_chars = self.limits.max_prompt_chars or self.max_model_len * (
            chars_per_token(tok) if tok is not None else 1)
        info = engine.info
        self.grammars = GrammarPool(tok, info.vocab_size, list(info.eos_token_ids), self.limits) \
            if tok is not None else None
        self.query_pool = ThreadPoolExecutor(max_workers=MAX_QUERY_WORKERS, thread_name_prefix="spanserve-query")

    def close(self) -> None:
        if self.tokenizers is not None:
            self.tokenizers.close()
        if self.grammars is not None:
            self.grammars.close()
        self.query_pool.shutdown(wait=False, cancel_futures=True)

    @contextmanager
    def borrowed_tokenizer(self) -> Iterator[Any]:
        """A tokenizer copy for the calling thread alone (blocking: call off the event loop)."""
        if self.tokenizers is None:
            raise bad_request("this model has no tokenizer; span queries need one", code="no_tokenizer")
        with self.tokenizers.borrow() as tok:
            yield tok

    async def on_tokenizer(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(tokenizer, *args) on a tokenizer worker, with that worker's own copy."""
        if self.tokenizers is None:
            raise bad_request("this model has no tokenizer; send the prompt as token ids", param="prompt")
        return await self.tokenizers.run(fn, *args)

    def check_chars(self, chars: int, param: str, what: str = "the prompt") -> None:
        check_chars(chars, self.max_prompt_chars, param, what)

    def check_size(self, prompt: str | list[int], param: str) -> None:
        """Text longer in characters, or token ids more, than the context can take."""
        if isinstance(prompt, str):
            self.check_chars(len(prompt), param)
        elif len(prompt) >= self.max_model_len:
            self._budget(len(prompt), None)

    def check_sampling(self, req: SamplingRequest, prompts: int) -> None:
        """The request's own bounds (stop strings, logit_bias, choices, the response format's size),
        before any prompt is tokenized or any SamplingParams reads the format."""
        check_stops(_stops(req), req.stop_token_ids, self.limits, self.engine.info.vocab_size)
        check_choices(req.n, prompts, self.limits)
        check_logit_bias(req.logit_bias, self.limits)
        try:
            check_schema(req.response_format, self.limits)
        except ValueError as e:
            raise bad_request(str(e), param="response_format", code=getattr(e, "code", None)) from e

    # ---- model and prompts ----------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.config.served_model_name!r}", param="model", code="model_not_found")

    async def encode(self, prompt: str | list[int], param: str = "prompt", add_special_tokens: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        self.check_chars(len(prompt), param)
        return list(await self.on_tokenizer(encode, prompt, add_special_tokens))

    def encode_pieces(self, tok: Any, text: str, tenant: str) -> list[int]:
        """Rendered chat text to ids on a tokenizer worker, reusing the tenant's earlier pieces."""
        return self.pieces.encode(tok, text, tenant) if self.pieces is not None else encode(tok, text)

    async def decode(self, ids: list[int]) -> str:
        return str(await self.on_tokenizer(lambda tok: tok.decode(ids)))

    async def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                          tools: list[dict[str, Any]] | None = None, tenant: str = "") -> list[int]:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", code="no_chat_template")
        self.check_chars(message_chars(messages), "messages", "the conversation")
        dicts = [m.as_template_dict() for m in messages]

        def render(tok: Any) -> list[int]:
            try:
                text = tok.apply_chat_template(dicts, tools=tools, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
            except Exception as e:  # templates raise on conversations they reject (role order etc.)
                raise bad_request(f"the chat template rejected these messages: {e}", param="messages") from e
            # Tool calls and names reach the template too: bound what it made, not only the contents.
            self.check_chars(len(text), "messages", "the rendered conversation")
            return self.encode_pieces(tok, text, tenant)

        return list(await self.on_tokenizer(render))

    def prompt_logprobs(self, entries: Sequence[TokenLogprobs | None] | None, n_top: int) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs: per prompt token, the token and its n_top best alternatives by id."""
        if entries is None:
            return None
        out: PromptLogprobs = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            alts = {t: PromptLogprob(logprob=v, rank=r + 1, decoded_token=self.token_text(t))
                    for r, (t, v) in enumerate(list(e.top.items())[:n_top])}
            alts[e.token_id] = PromptLogprob(logprob=e.logprob, rank=e.rank, decoded_token=self.token_text(e.token_id))
            out.append(alts)
        return out

    @functools.lru_cache(maxsize=65536)
    def token_text(self, token_id: int) -> str:
        # Read-only use of the tokenizer copy; safe next to the worker's encodes.
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return str(self.tokenizer.decode([token_id]))

    # ---- submission -----------------------------------------------------------------------
    def _budget(self, prompt_len: int, max_tokens: int | None) -> int:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens, but the prompt has "
                              f"{prompt_len} tokens; shorten the prompt", param="prompt",
                              code="context_length_exceeded")
        if max_tokens is None:
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens, but {prompt_len} prompt "
                              f"tokens + max_tokens {max_tokens} exceed it; lower max_tokens",
                              param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def _params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None, sample: int,
                prompt_logprobs: int | None) -> SamplingParams:
        vocab = self.engine.info.vocab_size
        bias = {int(k): v for k, v in (req.logit_bias or {}).items()}  # keys checked by compat.screen
        if any(t >= vocab for t in bias):
            raise bad_request(f"logit_bias names token id {max(bias)}, outside this model's vocabulary of {vocab}",
                              param="logit_bias")
        seed = req.seed
        if seed is not None and sample:
            # Distinct, reproducible streams per choice; wrapped to stay a valid int64 seed.
            seed = (seed + sample - SEED_MIN) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=seed, stop=_stops(req), stop_token_ids=req.stop_token_ids or [],
                ignore_eos=req.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logit_bias=bias or None, prompt_logprobs=prompt_logprobs, response_format=req.response_format,
            )
        except ValueError as e:
            # SamplingParams names the field first in its messages
            raise bad_request(str(e), param=getattr(e, "param", None) or (str(e).split(" ", 1)[0] if str(e)[:1].isalpha() else None)) from e

    async def submit(self, id_: str, prompts: Sequence[Prompt], req: SamplingRequest,
                     max_tokens: int | None, logprobs: int | None,
                     prompt_logprobs: int | None = None, tenant: str | None = None) -> Submission:
        """prompt_logprobs: None = the request's own field. `tenant`: whose key sent it (None
        without access control); the cache namespace is the tenant's, cache_salt within it."""
        namespace = namespace_for(tenant, req.cache_salt)
        if prompt_logprobs is None:
            prompt_logprobs = req.prompt_logprobs
        check_policy(req.policy)
        self.check_sampling(req, len(prompts))
        specs: list[RequestSpec] = []
        lens = [prompt_len(p) for p in prompts]
        for p, ids in enumerate(prompts):
            budget = self._budget(lens[p], max_tokens)
            for j in range(req.n):
                specs.append(RequestSpec(ids, self._params(req, budget, logprobs, j, prompt_logprobs), f"{id_}-{p}-{j}",
                                         namespace=namespace, policy=req.policy, tenant=tenant or ""))
        try:
            streams = await self.engine.add_requests(specs)
        except ValueError as e:  # a schema the grammar compiler refuses names response_format
            raise bad_request(str(e), param=getattr(e, "param", "prompt"), code=getattr(e, "code", None)) from e
        except EngineOverloaded as e:
            raise APIError(429, str(e), code="server_overloaded") from e
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from e
        return Submission(id_, streams, lens, req.n, _stops(req))

    async def collect(self, sub: Submission, http: HTTPRequest) -> list[RequestOutput]:
        """Final outputs in choice order; aborts everything if the client disconnects first."""
        finals: list[RequestOutput | None] = [None] * len(sub.streams)

        async def gather() -> None:
            async for k, out in fan_in(sub.streams):
                if out.finished:
                    finals[k] = out

        work = asyncio.ensure_future(gather())
        gone = asyncio.ensure_future(wait_disconnect(http))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (work, gone):
                t.cancel()
            sub.abort()
        if not work.done() or work.cancelled():
            raise APIError(499, "client disconnected", code="client_disconnected")
        try:
            work.result()
        except EngineStepError as e:
            raise APIError(500, str(e), type="server_error", code="engine_error") from e
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from e
        return [f for f in finals if f is not None]


def prompt_len(prompt: Prompt) -> int:
    return sum(len(s.token_ids or ()) if isinstance(s, Segment) else 1 for s in prompt)


def check_policy(name: str | None, param: str = "policy") -> None:
    if name is not None:
        try:
            resolve_policy(name)
        except ValueError as e:
            raise bad_request(str(e), param=param, code="unknown_policy") from e


def _stops(req: SamplingRequest) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


async def wait_disconnect(http: HTTPRequest) -> None:
    # The body was read in full before this runs, so the next ASGI message is the disconnect.
    while (await http.receive())["type"] != "http.disconnect":
        pass
