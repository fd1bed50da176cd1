"""Per-request sampling parameters, validated when made: what a request asks of the sampler,
the stop checks and structured output."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from spanserve.engine.penalties import check_penalties
from spanserve.engine.structured import parse_response_format

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]; 1 = disabled
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0  # [0, 1]; 0 = disabled
    # Seeds a per-request generator: same seed + same prompt -> same tokens,
    # regardless of batch composition.
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Top-n logprobs of each chosen token (0 = only the chosen token's); None = none.
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # OpenAI penalties over the generated tokens: presence subtracts a constant from every token
    # seen, frequency subtracts per occurrence; both in [-2, 2], 0 = off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM / transformers penalty over prompt + generated tokens: positive logits are divided by
    # it, negative ones multiplied; > 0, 1 = off.
    repetition_penalty: float = 1.0
    # Token id -> value added to its logit before sampling, in [-100, 100].
    logit_bias: dict[int, float] | None = None
    # Top-n logprobs of every prompt token after the first (0 = only the token's own); None = none.
    prompt_logprobs: int | None = None
    # OpenAI's response_format object, as sent; interpreted by the structured-output hook.
    response_format: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Accept the loose forms an OpenAI-style request carries.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self._validate()
        parse_response_format(self.response_format)  # raises ResponseFormatError on a bad shape
        check_penalties(self)

    def _validate(self) -> None:
        # Negated comparisons below so NaN fails too.
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(
                f"max_tokens must be an int >= 1, got {self.max_tokens!r}; "
                "it is the maximum number of tokens to generate"
            )
        if not (self.temperature >= 0.0) or math.isinf(self.temperature):
            raise ValueError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}; "
                "use 0 for greedy decoding or 1.0 for the model's distribution"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(
                f"top_p must be in (0, 1], got {self.top_p!r}; "
                "use 1.0 to disable nucleus sampling"
            )
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an int >= -1, got {self.top_k!r}; "
                "use 0 or -1 to disable top-k filtering"
            )
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(
                f"min_p must be in [0, 1], got {self.min_p!r}; "
                "use 0.0 to disable min-p filtering"
            )
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}; "
                "use 0 for only the chosen token's logprob, None for no logprobs"
            )
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs must be an int in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs!r}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str):
                raise ValueError(
                    f"stop must be a string or a list of strings, got {s!r} "
                    f"({type(s).__name__}) at index {i}"
                )
            if not s:
                raise ValueError(
                    f"stop strings must be non-empty, got '' at index {i}; "
                    "remove it (an empty string would stop immediately)"
                )
        for i, t in enumerate(self.stop_token_ids):
            if not _is_int(t) or t < 0:
                raise ValueError(
                    f"stop_token_ids must be non-negative ints, got {t!r} "
                    f"({type(t).__name__}) at index {i}; pass token ids, not strings "
                    "(use stop for strings)"
                )

    @property
    def greedy(self) -> bool:
        # top_k == 1 keeps only the best token, so no randomness is left to use.
        return self.temperature == 0.0 or self.top_k == 1


def _is_int(x: object) -> bool:
    # bool is an int subclass, but True as a token id or count is always a mistake.
    return isinstance(x, int) and not isinstance(x, bool)
