"""POST /tokenize and /detokenize, in vLLM's shapes.

/tokenize takes `{"model", "prompt"}` or `{"model", "messages"}` (rendered by the chat template,
exactly as /v1/chat/completions renders them) and answers `{"tokens", "count", "max_model_len"}`;
/detokenize takes `{"model", "tokens"}` and answers `{"prompt"}`. By default the tokens are the
ones the completion routes would feed the model: no special tokens are added to a prompt.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from spanserve.server.context import ServingContext
from spanserve.server.errors import bad_request
from spanserve.server.messages import ChatMessage, OpenAIBody
from spanserve.server.protocol import TokenIds


class TokenizeRequest(OpenAIBody):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBody):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(ctx: ServingContext, req: TokenizeRequest) -> TokenizeResponse:
    ctx.check_model(req.model)
    if req.messages is not None:
        ids = await ctx.render_chat(req.messages, req.add_generation_prompt)
    elif ctx.tokenizer is None or req.prompt is None:
        raise bad_request("this model has no tokenizer", param="prompt", code="no_tokenizer")
    else:
        ids = await ctx.encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
    strs = [ctx.token_text(t) for t in ids] if req.return_token_strs else None
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=ctx.max_model_len, token_strs=strs)


async def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(req.model)
    if ctx.tokenizer is None:
        raise bad_request("this model has no tokenizer", param="tokens", code="no_tokenizer")
    vocab = ctx.engine.info.vocab_size
    bad = [t for t in req.tokens if t >= vocab]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside this model's vocabulary of {vocab}", param="tokens")
    return DetokenizeResponse(prompt=await ctx.decode(list(req.tokens)))
