"""OpenAI-compatible request and response bodies.

Requests take every field of OpenAI's chat-completions and completions schemas, plus vLLM's
common extensions and this server's own (span layouts, policies). JSON types are checked as
sent ("1" is not an int, true is not a number). Fields outside the schema are kept aside for the
route to warn about (or refuse under --strict-params: see server/compat.py), which also decides
what the engine cannot honour and refuses it by name.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from spanserve.engine.params import MAX_LOGPROBS
from spanserve.server.messages import ChatMessage, ContentPart, DeltaToolCall, OpenAIBody, ToolCall

__all__ = ["ChatMessage", "ContentPart", "DeltaToolCall", "OpenAIBody", "ToolCall"]

MAX_N = 16  # choices per request: each one is a full request in the engine
MAX_PROMPTS = 64  # prompts in one batched completions request
MAX_SEGMENTS = 1024  # segments in one span layout or pin request
MAX_TOOLS = 128  # functions one chat request may declare (OpenAI's limit)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what a torch generator accepts

# fail_fast: a list stops at its first bad item. Without it a union tries each member on every
# item of a long list and collects an error per item: 30M token ids took 21 s to refuse.
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(fail_fast=True)]
Strings = Annotated[list[str], Field(fail_fast=True)]


class _Request(BaseModel):
    """This server's own request objects (span segments, pins): unknown fields are refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(OpenAIBody):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI pads chunks against side channels: not done here


class SamplingRequest(OpenAIBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None = the served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: str | Strings | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    user: str | None = None  # end-user tag: informational only
    response_format: dict[str, Any] | None = None  # handed to the sampler as sent
    # vLLM extensions
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None  # beyond the vocabulary: all tokens
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # The prefix cache is shared only between requests with the same salt (tenant isolation).
    cache_salt: str | None = None
    # Recomputation policy for span layouts (extension): none | full | cacheblend | sparseq | sinks, and
    # each but full with "+repair" (reuse.policies.POLICY_NAMES).
    policy: str | None = None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


PromptInput = TokenIds | Annotated[list[TokenIds], Field(fail_fast=True)] | str | Strings  # ids first: the cheap match


class _OneSource(_Request):
    text: str | None = None
    token_ids: TokenIds | None = None
    key: str | None = None  # names the segment for pinning and reporting

    @model_validator(mode="after")
    def _exactly_one(self) -> _OneSource:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("a segment needs exactly one of text or token_ids")
        return self


class SpanSegment(_OneSource):
    """One segment of a span layout (extension): `plus` segments stand alone, so their KV is
    reused wherever they appear; `anchor: prefix` encodes a plus segment after the leading
    cross segments instead of at the start, `anchor: sink` after the model's sink prefix (BOS +
    chat template opening), which the prompt must begin with."""

    kind: Literal["cross", "plus"] = "cross"
    anchor: Literal["none", "prefix", "sink"] = "none"


class CompletionRequest(SamplingRequest):
    prompt: PromptInput | None = None
    segments: Annotated[list[SpanSegment], Field(min_length=1, max_length=MAX_SEGMENTS)] | None = None
    # 0 only with echo: score the prompt, generate nothing
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompt_count(self) -> int:
        """Prompts in the batch, without walking it."""
        p = self.prompt
        return 1 if p is None or isinstance(p, str) or (p and isinstance(p[0], int)) else len(p)

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a lone string or token list is a batch of one."""
        p = self.prompt
        if p is None:
            raise ValueError("this request carries segments, not a prompt")
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty; send a string, a list of strings or token ids")
        if isinstance(p[0], int):  # validated lists hold one type: one prompt of token ids
            return [p]  # type: ignore[list-item]
        if len(p) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(p)}")
        return list(p)  # type: ignore[arg-type]


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True  # vLLM extension
    # Function calling (server/tools.py): checked there, rendered by the chat template, enforced
    # by a grammar and parsed from the output by the server's --tool-call-parser
    tools: Annotated[list[Any], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields that change nothing for a text model (server/compat.py says which values are
    # accepted and which are refused)
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    moderation: dict[str, Any] | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class ReuseCounts(BaseModel):
    """How the prompt's KV was obtained, token by token (extension)."""

    prefix: int = 0
    perforated: int = 0
    segment: int = 0
    computed: int = 0
    # of the hits above, tokens loaded from a tier below the pool (kv_offload / --kv-store)
    host: int = 0
    disk: int = 0
    store: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prefix + perforated + segment hits
    reuse: ReuseCounts | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One alternative at one prompt position, in vLLM's prompt_logprobs shape."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# Per prompt token, keyed by token id: the token itself and the top alternatives; [0] is None.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class QueryOutput(BaseModel):
    """One generation of an executed span query; `path` is its place in the prepared tree
    ("in" steps into a generation's input, integers into a group's children)."""

    path: list[str | int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class SpanQueryResult(BaseModel):
    outputs: list[QueryOutput]  # every generation, inner ones included, in execution order
    query: dict[str, Any]  # the evaluated query (its closure) in spnl JSON


class QueryCompletionResponse(ChatCompletionResponse):
    span_query: SpanQueryResult


class PinSegment(_OneSource):
    pass


class PinRequest(_Request):
    segments: Annotated[list[PinSegment], Field(min_length=1, max_length=MAX_SEGMENTS)]
    cache_salt: str | None = None


class PinnedSegment(BaseModel):
    key: str
    tokens: int


class PinResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[PinnedSegment]
    cache_salt: str | None = None


class UnpinResponse(BaseModel):
    key: str
    object: Literal["segment"] = "segment"
    deleted: bool = True


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "spanserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
