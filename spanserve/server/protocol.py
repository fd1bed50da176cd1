"""OpenAI-compatible request and response bodies.

Requests are validated strictly (JSON types as sent: "1" is not an int, true is not a number)
and unknown fields are refused: a parameter this server would silently ignore could change what
the client believes it asked for. OpenAI fields the engine cannot honour are declared and
accepted only at their neutral value, so common clients that send defaults keep working.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from spanserve.engine.sampling import MAX_LOGPROBS

MAX_N = 16  # choices per request: each one is a full request in the engine
MAX_PROMPTS = 64  # prompts in one batched completions request
MAX_SEGMENTS = 1024  # segments in one span layout or pin request
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what a torch generator accepts

TokenIds = list[Annotated[int, Field(ge=0)]]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None = the served model
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # The prefix cache is shared only between requests with the same salt (tenant isolation).
    cache_salt: str | None = None
    # Recomputation policy for span layouts (extension): none | full | cacheblend | sparseq | sinks.
    policy: str | None = None
    user: str | None = None  # end-user tag: informational only
    # Not implemented by the sampler: accepted only at their neutral values.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="after")
    def _neutral_only(self) -> SamplingRequest:
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise ValueError(f"{name} is not supported by this server; omit it or set it to {neutral}")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server; omit it")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


PromptInput = str | list[str] | TokenIds | list[TokenIds]


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
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported by this server; omit it or set it to false")
        if self.suffix:
            raise ValueError("suffix is not supported by this server; omit it")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported by this server; omit it or set it equal to n")
        if (self.prompt is None) == (self.segments is None):
            raise ValueError("send exactly one of prompt or segments (a span layout)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts: a lone string or token list is a batch of one."""
        p = self.prompt
        if p is None:
            raise ValueError("this request carries segments, not a prompt")
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt is empty; send a string, a list of strings or token ids")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if len(p) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(p)}")
        return list(p)  # type: ignore[arg-type]


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    # Extension: consecutive "plus" messages become standalone span segments (see server/span.py).
    kind: Literal["cross", "plus"] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        return out


class ResponseFormat(_Request):
    type: Literal["text"]


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Literal["none"] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tools are not supported by this server; omit them")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

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


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


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


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
