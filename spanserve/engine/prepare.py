"""A request checked and put in the form the engine queues: its token ids, its layout resolved to
pieces, its policy. The same checks run wherever a request is made ready: in the engine for the
Python API, in the API server before a request crosses to the engine core, so that nothing
unchecked reaches the core and a bad request fails before anything of it was queued."""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from spanserve.cache.claim import Piece
from spanserve.engine.layout import Segment, checked_many, checked_tokens, resolve
from spanserve.engine.params import SamplingParams
from spanserve.reuse.policies import Policy


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the model's vocabulary, the context the engine serves,
    and the anchor of anchor="sink" segments."""

    vocab_size: int
    max_model_len: int
    sink_prefix: tuple[int, ...] = ()


@dataclass
class Prepared:
    """A checked request: what the engine queues (`LLMEngine.add_prepared`). `grammar`: its
    compiled response format, if any (an xgrammar CompiledGrammar, or its JSON across processes).
    `tenant`: who sent it (the API server's tenant, from its key; "" for the Python API): the
    scheduler admits tenants' requests in turn, and a pin counts against its tenant's quota."""

    request_id: str
    token_ids: list[int]
    pieces: list[Piece]
    params: SamplingParams
    namespace: str = ""
    policy: Any = "none"  # a policy name (a Policy object, within one process)
    encode_only: bool = False
    grammar: Any = None
    arrival_time: float | None = field(default=None)
    tenant: str = ""


def check_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """Token ids as a list of ints, each in the vocabulary (vectorized: layouts are long)."""
    return list(checked_tokens(ids, vocab_size, pack=False)[0])


def check_params(params: SamplingParams, vocab_size: int) -> None:
    bad = [t for t in params.logit_bias or () if t >= vocab_size]
    if bad:
        raise ValueError(f"logit_bias names token id {bad[0]}, outside this model's vocabulary of {vocab_size}")


def check_prompt(prompt: "str | Sequence[int] | Sequence[Segment]", params: SamplingParams, policy: Policy,
                 limits: Limits, encode: Callable[[str], list[int]],
                 encode_only: bool = False) -> tuple[list[int], list[Piece]]:
    """(token ids, pieces) of a prompt (text, token ids or a span layout), or ValueError saying
    what is wrong with it and how to fix it. `encode` tokenizes text."""
    check_params(params, limits.vocab_size)
    pieces: list[Piece] = []
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], Segment):
        pieces = resolve(prompt, encode, policy.name, require_tail=not encode_only,
                         check=functools.partial(checked_tokens, vocab_size=limits.vocab_size),
                         check_all=functools.partial(checked_many, vocab_size=limits.vocab_size),
                         sink=limits.sink_prefix)
        ids = list(itertools.chain.from_iterable(p.tokens for p in pieces))
    elif isinstance(prompt, str):
        ids = encode(prompt)
    else:
        ids = check_ids(prompt, limits.vocab_size)
    if not ids:
        raise ValueError("prompt is empty; send at least one token")
    if pieces and params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs needs a plain prompt; a span layout's standalone segments are "
                         "encoded on their own, so its positions have no single causal reading to score")
    if len(ids) >= limits.max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens but the model's context here is {limits.max_model_len}; "
                         "shorten the prompt (or raise kv_cache_memory / max_model_len)")
    return ids, pieces
