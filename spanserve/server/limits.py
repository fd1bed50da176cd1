"""Bounds on what one request may ask of the server, each checked before the work it bounds:
body bytes while they arrive, prompt characters before anything is tokenized, stop strings and
choices before anything is queued, a response format's size and regex repetitions before it is
compiled. Every refusal is a 400 (413 for the body) naming the field; docs/security.md lists
the defaults.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from spanserve.engine.structured import TOO_COMPLEX, ResponseFormatError
from spanserve.server.errors import APIError, bad_request

# SmolLM2's longest token is 81 characters (a newline and 80 spaces; the next are runs of "#",
# "=" and "-" of 64-80). No token covers more characters than its vocabulary entry spells, so a
# prompt of more than max_model_len * 81 characters cannot fit SmolLM2's context. 128 leaves
# room for other vocabularies and for normalizers that drop characters; a tokenizer with a
# longer vocabulary entry raises the bound to that length (`chars_per_token`).
MAX_CHARS_PER_TOKEN = 128


@dataclass(frozen=True)
class RequestLimits:
    """The bounds one server applies (`spanserve serve` exposes those an operator tunes)."""

    max_body_bytes: int = 64 << 20  # 413 beyond it, counted while the body streams in
    # None: max_model_len * chars_per_token(tokenizer), the most any prompt that fits can have
    max_prompt_chars: int | None = None
    max_stop_strings: int = 16  # OpenAI allows 4; every step checks each one
    max_stop_chars: int = 256  # per stop string
    max_stop_token_ids: int | None = None  # None: the vocabulary's size (more ids cannot be distinct)
    max_choices: int = 64  # n x prompts in one completions request: each is a sequence in the engine
    max_logit_bias: int = 1024  # logit_bias entries
    max_schema_bytes: int = 128 << 10  # a response_format schema as compact JSON
    max_pattern_repeat: int = 1000  # the count of one regex repetition, e.g. [a-z]{1,1000}
    max_nested_repeat: int = 100  # the product of the counts of nested ones, e.g. (a{1,10}){1,10}
    grammar_timeout_s: float = 5.0  # a compile running longer is killed: 400 "too complex"
    grammar_workers: int = 2  # compile processes, started on first use
    tokenizer_workers: int = 2  # threads, each with a tokenizer copy of its own
    max_query_nodes: int = 50_000  # a span query's nodes with every repeat expanded
    max_query_generations: int = 1024  # a span query's generations with every repeat expanded

    def check(self) -> RequestLimits:
        for name in ("max_body_bytes", "max_stop_strings", "max_stop_chars", "max_choices", "max_logit_bias",
                     "max_schema_bytes",
                     "max_pattern_repeat", "max_nested_repeat", "grammar_workers", "tokenizer_workers",
                     "max_query_nodes", "max_query_generations"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_stop_token_ids is not None and self.max_stop_token_ids < 1:
            raise ValueError(f"max_stop_token_ids must be >= 1 (or unset), got {self.max_stop_token_ids}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"max_prompt_chars must be >= 1 (or unset), got {self.max_prompt_chars}")
        if not self.grammar_timeout_s > 0:
            raise ValueError(f"grammar_timeout_s must be > 0, got {self.grammar_timeout_s}")
        return self


# ---- bodies ------------------------------------------------------------------------------------
def body_too_large(limit: int) -> APIError:
    return APIError(413, f"request body over {limit} bytes; send less (the limit is the server's "
                         "--max-body-bytes)", code="body_too_large")


async def read_body(http: Request, limit: int) -> bytes:
    """The body, counted while it streams in: a chunked body (no Content-Length) is refused as
    soon as it passes `limit`, never read whole first."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


# ---- prompts -----------------------------------------------------------------------------------
def chars_per_token(tokenizer: Any) -> int:
    """An upper bound on the characters one token of `tokenizer` covers (see MAX_CHARS_PER_TOKEN).
    Byte-level vocabularies spell a byte as one character, so an entry's length bounds its text."""
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    except (AttributeError, TypeError):
        longest = 0
    return max(MAX_CHARS_PER_TOKEN, longest)


def check_chars(chars: int, limit: int, param: str, what: str = "the prompt") -> None:
    """Refuse text that cannot fit the context, before any of it is tokenized."""
    if chars > limit:
        raise bad_request(f"{what} has {chars} characters, more than the {limit} that any prompt fitting this "
                          f"model's context can have; shorten it", param=param, code="context_length_exceeded")


def message_chars(messages: Sequence[Any]) -> int:
    """Characters of chat messages' contents, as the template receives them."""
    return sum(len(m.as_template_dict()["content"]) for m in messages)


# ---- sampling ----------------------------------------------------------------------------------
def check_stops(stops: Sequence[str], stop_token_ids: Sequence[int] | None, limits: RequestLimits,
                vocab_size: int) -> None:
    if len(stops) > limits.max_stop_strings:
        raise bad_request(f"stop has {len(stops)} strings; at most {limits.max_stop_strings} per request",
                          param="stop", code="too_many_stop_strings")
    for i, s in enumerate(stops):
        if len(s) > limits.max_stop_chars:
            raise bad_request(f"stop string {i} has {len(s)} characters; at most {limits.max_stop_chars}",
                              param="stop", code="stop_string_too_long")
    most = limits.max_stop_token_ids or vocab_size
    if stop_token_ids is not None and len(stop_token_ids) > most:
        raise bad_request(f"stop_token_ids has {len(stop_token_ids)} ids; at most {most}",
                          param="stop_token_ids", code="too_many_stop_token_ids")


def check_choices(n: int, prompts: int, limits: RequestLimits) -> None:
    if n * prompts > limits.max_choices:
        raise bad_request(f"{prompts} prompts x n={n} asks for {n * prompts} sequences; at most "
                          f"{limits.max_choices} per request: send fewer prompts or a smaller n, or split the "
                          "request", param="n" if n > 1 else "prompt", code="too_many_choices")


def check_logit_bias(bias: dict[str, float] | None, limits: RequestLimits) -> None:
    if bias is not None and len(bias) > limits.max_logit_bias:
        raise bad_request(f"logit_bias has {len(bias)} entries; at most {limits.max_logit_bias}",
                          param="logit_bias", code="too_many_logit_bias_entries")


# ---- response formats --------------------------------------------------------------------------
def check_schema(response_format: Any, limits: RequestLimits) -> None:
    """Refuse a json_schema response format too large to compile, or whose regex patterns repeat
    more than a grammar can hold (the compiler's time grows with the square of a count, and
    multiplies across nested counts), before it reaches a compiler."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema, where = spec.get("schema") if isinstance(spec, dict) else None, "json_schema.schema"
    elif kind == "structural_tag":  # its JSON Schema regions and regex patterns, all together
        schema, where = response_format.get("format"), "format"
    else:
        return
    if not isinstance(schema, dict):
        return  # the format's own parser says what is wrong with it
    size = len(json.dumps(schema, separators=(",", ":")).encode())
    if size > limits.max_schema_bytes:
        raise _too_complex(f"response_format.{where} is {size} bytes of JSON; at most {limits.max_schema_bytes}")
    for pattern in _patterns(schema):
        single, nested = repeat_bounds(pattern)
        if single > limits.max_pattern_repeat:
            raise _too_complex(f"the pattern {_short(pattern)} repeats {single} times; at most "
                               f"{limits.max_pattern_repeat} (use maxLength for long strings)")
        if nested > limits.max_nested_repeat:
            raise _too_complex(f"the pattern {_short(pattern)} nests counted repetitions to {nested} times; at "
                               f"most {limits.max_nested_repeat}")


def _too_complex(message: str) -> ResponseFormatError:
    return ResponseFormatError(f"response_format is too complex: {message}", code=TOO_COMPLEX)


def _short(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 60 else pattern[:57] + "...")


def _patterns(schema: Any) -> Iterator[str]:
    """Every regex in a JSON Schema: `pattern` values and `patternProperties` keys (walked without
    recursion: a body may nest deeper than Python's stack)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    yield value
                elif key == "patternProperties" and isinstance(value, dict):
                    yield from (k for k in value if isinstance(k, str))
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


_COUNT = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")


def repeat_bounds(pattern: str) -> tuple[int, int]:
    """(the largest count of one counted repetition, the largest product of the counts along a
    chain of nested counted repetitions, 0 without nesting) of a regex. `{m,n}` counts n, `{m}`
    and `{m,}` count m; escapes and character classes are skipped."""
    single = nested = 0
    inside = [1]  # per open group: the largest product of counted repetitions within it
    last: int | None = None  # the product within the atom just read (1: a plain atom)
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i, last = i + 2, 1
        elif c == "[":
            i, last = _class_end(pattern, i), 1
        elif c == "(":
            inside.append(1)
            i, last = i + 1, None
        elif c == ")":
            last = inside.pop() if len(inside) > 1 else 1
            inside[-1] = max(inside[-1], last)
            i += 1
        elif c == "{" and last is not None and (m := _COUNT.match(pattern, i)):
            count = int(m.group(3)) if m.group(3) else int(m.group(1))
            single = max(single, count)
            if last > 1:
                nested = max(nested, count * last)
            inside[-1] = max(inside[-1], count * last)
            i, last = m.end(), None
        else:
            i, last = i + 1, (None if c in "|*+?" else 1)
    return single, nested


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opening at i."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":  # a leading "]" is a literal
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1
