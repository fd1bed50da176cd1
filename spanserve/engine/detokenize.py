"""Incremental detokenization: a request's text grows by decoding only its newest tokens.

Decoding the whole output after every sampled token costs O(n) per step, O(n^2) per request (a
512-token answer decodes 131k tokens in all). Decoding a short window instead needs care in two
places, which is why the window starts a little before the new tokens:

- a token may end in the middle of a UTF-8 character, which decodes to U+FFFD until the rest
  arrives, so text is only taken once the window no longer ends in one;
- decoders that strip a leading space at the start of a sequence (SentencePiece's "▁") would lose
  it at the window's start, so the window begins at tokens whose text was already taken, and only
  the part past their decoded text is new.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

_REPLACEMENT = "\ufffd"


@dataclass
class IncrementalText:
    """`decode` turns token ids into text; `text` is what the tokens given so far spell, without a
    trailing incomplete character until the last update."""

    decode: Callable[[list[int]], str]
    text: str = ""
    _prefix: int = 0  # tokens [prefix, read) decode to the end of `text`
    _read: int = 0

    def update(self, ids: list[int], final: bool = False) -> str:
        """The text of ids, which extend the ids of the last call; `final` (a finished request)
        keeps a trailing incomplete character as U+FFFD, as a whole decode would."""
        before = self.decode(ids[self._prefix:self._read])
        window = self.decode(ids[self._prefix:])
        if len(window) > len(before) and (final or not window.endswith(_REPLACEMENT)):
            self.text += window[len(before):]
            self._prefix, self._read = self._read, len(ids)
        return self.text


def make_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)` as a function of ids. A fast (Rust)
    tokenizer that adds no clean-up after its backend's decode is called directly: the
    transformers wrapper's argument handling costs about twice the decode itself, and a batch-64
    decode step makes two such calls per request."""
    if tokenizer is None:
        return lambda ids: ""
    backend = getattr(tokenizer, "_tokenizer", None)
    if _is_fast(tokenizer) and backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def _is_fast(tokenizer: Any) -> bool:
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return False
    return isinstance(tokenizer, PreTrainedTokenizerFast)
