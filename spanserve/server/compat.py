"""What the server does with each OpenAI request field it does not simply pass to the engine.

Three outcomes, decided here once for both routes:
- ignored: fields that change nothing for this server (billing, storage, routing, hints for
  OpenAI's own caches, reasoning knobs for a model without reasoning): accepted, logged at debug;
- unknown: fields outside OpenAI's schema and the extensions this server knows: ignored with a
  warning (as vLLM does), or a 400 naming the field under --strict-params;
- refused: what the server cannot honour (audio, web search, legacy functions, ...): a 400 whose `param`
  names the field and whose message says why and what to send instead.
"""
from __future__ import annotations

import logging
import re
from typing import Any

from pydantic import BaseModel

from spanserve.engine.penalties import MAX_BIAS
from spanserve.server.errors import APIError
from spanserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest

log = logging.getLogger(__name__)

IGNORED = ("user", "metadata", "store", "service_tier", "reasoning_effort", "verbosity", "prediction",
           "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "safety_identifier",
           "modalities", "function_call", "best_of")
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")
# Roles whose messages OpenAI's schema requires content of (an assistant's may be a tool call).
CONTENT_REQUIRED = ("system", "developer", "user", "tool")
_TOKEN_ID = re.compile(r"[0-9]+")


def refused(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


def unknown_fields(obj: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every field outside the schema, nested objects and lists included."""
    out: list[str] = []
    if isinstance(obj, BaseModel):
        out += [prefix + k for k in (obj.model_extra or {})]
        for name in type(obj).model_fields:
            out += unknown_fields(getattr(obj, name), f"{prefix}{name}.")
    elif isinstance(obj, list) and obj and isinstance(obj[0], BaseModel):  # lists are of one type: a long
        for i, item in enumerate(obj):                                     # list of ids is not walked
            out += unknown_fields(item, f"{prefix}{i}.")
    return out


def screen_unknown(req: BaseModel, strict: bool, route: str) -> None:
    """Warn about fields outside the schema, or refuse the first one when strict."""
    unknown = unknown_fields(req)
    if unknown and strict:
        raise APIError(400, f"unknown parameter {unknown[0]!r}: this server runs with --strict-params; remove it",
                       param=unknown[0], code="unknown_parameter")
    if unknown:
        log.warning("%s: ignoring parameters outside the OpenAI schema: %s", route, ", ".join(unknown))


def screen(req: SamplingRequest, strict: bool, route: str) -> None:
    """Log or refuse what the request asks that the engine will not do; raises APIError."""
    screen_unknown(req, strict, route)
    ignored = [f for f in IGNORED if f in req.model_fields_set and getattr(req, f, None) is not None]
    if ignored:
        log.debug("%s: accepted and ignored: %s", route, ", ".join(ignored))
    _check_common(req)
    if isinstance(req, ChatCompletionRequest):
        _check_chat(req)
    elif isinstance(req, CompletionRequest):
        _check_completion(req)


def _check_common(req: SamplingRequest) -> None:
    for key, value in (req.logit_bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise APIError(400, f"logit_bias: keys are token ids written as decimal strings, got {key!r}",
                           param="logit_bias", code="invalid_value")
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise APIError(400, f"logit_bias: values are in [-100, 100], got {value!r} for token {key}",
                           param="logit_bias", code="invalid_value")
    fmt = req.response_format
    if fmt is not None and fmt.get("type") not in RESPONSE_FORMATS:
        raise APIError(400, f"response_format.type must be one of {list(RESPONSE_FORMATS)}, got {fmt.get('type')!r}",
                       param="response_format.type", code="invalid_value")
    if req.prompt_logprobs is not None and req.stream:
        raise refused("prompt_logprobs", "not available with stream; request it without streaming")


def _check_chat(req: ChatCompletionRequest) -> None:
    if req.functions:
        raise refused("functions", "the legacy functions field is not served; declare the functions in tools")
    if req.function_call not in (None, "none", "auto"):
        raise refused("function_call", "the legacy function_call field is not served; name the function in "
                                       "tool_choice")
    if req.audio is not None or "audio" in (req.modalities or ()):
        raise refused("audio" if req.audio is not None else "modalities",
                      "this server generates text only; omit audio and ask for modalities [\"text\"]")
    if any(m != "text" for m in req.modalities or ()):
        raise refused("modalities", f"unknown modality in {req.modalities}; this server generates \"text\"")
    if req.web_search_options is not None:
        raise refused("web_search_options", "this server has no web search; omit web_search_options")
    if req.moderation is not None:
        raise refused("moderation", "this server runs no moderation model; omit moderation and moderate "
                                    "inputs and outputs on the client")
    for i, m in enumerate(req.messages):
        if m.role in CONTENT_REQUIRED and (m.content is None or m.content == []):
            raise APIError(400, f"messages.{i}.content: a {m.role} message needs content (a string or a "
                                f"non-empty list of text parts)", param=f"messages.{i}.content",
                           code="missing_required_parameter")
        bad = m.unsupported()
        if bad is not None:
            raise refused(f"messages.{i}.{bad[0]}", bad[1])
        if m.role == "function" and m.name is None:
            raise APIError(400, f"messages.{i}: a function message needs a name", param=f"messages.{i}.name")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    if req.prompt_logprobs is not None and any(m.kind == "plus" for m in req.messages):
        raise refused("prompt_logprobs", "not available for span layouts (plus messages): their standalone "
                                         "segments have no single causal reading to score")


def _check_completion(req: CompletionRequest) -> None:
    if (req.prompt is None) == (req.segments is None):
        raise APIError(400, "send exactly one of prompt or segments (a span layout)", param="prompt")
    if req.suffix:
        raise refused("suffix", "fill-in-the-middle is not supported by this server; omit suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise refused("best_of", "ranking extra samples is not supported by this server; omit best_of or set "
                                 "it equal to n")
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens must be >= 1; 0 is accepted only with echo (to score the prompt)",
                       param="max_tokens")
    if req.segments is not None and req.echo:
        raise refused("echo", "not available for span layouts; send a prompt")
    if req.segments is not None and req.prompt_logprobs is not None:
        raise refused("prompt_logprobs", "not available for span layouts: their standalone segments have no "
                                         "single causal reading to score")
