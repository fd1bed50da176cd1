"""Retrievers pick the fragments a ``Retrieve`` node contributes to its plus.

The built-in retriever is lexical Okapi BM25 over paragraph chunks, in pure Python,
so queries with a corpus work with no model download and give the same fragments
every time (which is what makes their KV cache reusable across requests).
"""
from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .ir import Document, Fragment

DEFAULT_K = 4
DEFAULT_MAX_WORDS = 200

_WORD = re.compile(r"\w+")
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


@runtime_checkable
class Retriever(Protocol):
    def retrieve(self, question: str, corpus: Sequence[Document], k: int) -> tuple[Fragment, ...]:
        """At most ``k`` fragments of ``corpus`` relevant to ``question``."""
        ...


def tokens(text: str) -> list[str]:
    return _WORD.findall(text.casefold())


def chunk(document: Document, max_words: int = DEFAULT_MAX_WORDS) -> tuple[Fragment, ...]:
    """Split a document into paragraph fragments of at most ``max_words`` words.

    Paragraphs (blank-line separated) keep their exact text, so a fragment is
    byte-identical whenever the same document is retrieved again; only paragraphs
    longer than ``max_words`` are cut into word windows.
    """
    if max_words < 1:
        raise ValueError("max_words must be >= 1")
    pieces: list[str] = []
    for paragraph in _PARAGRAPH_BREAK.split(document.text):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        words = paragraph.split()
        if len(words) <= max_words:
            pieces.append(paragraph)
        else:
            pieces.extend(" ".join(words[i:i + max_words]) for i in range(0, len(words), max_words))
    return tuple(Fragment(text, document.name, i) for i, text in enumerate(pieces))


@dataclass(frozen=True)
class BM25Retriever:
    """Okapi BM25 over the chunks of the corpus given with each call."""

    k1: float = 1.2
    b: float = 0.75
    max_words: int = DEFAULT_MAX_WORDS

    def retrieve(self, question: str, corpus: Sequence[Document], k: int) -> tuple[Fragment, ...]:
        if k < 1:
            raise ValueError("k must be >= 1")
        fragments = [f for doc in corpus for f in chunk(doc, self.max_words)]
        bags = [Counter(tokens(f.text)) for f in fragments]
        scores = self._scores(set(tokens(question)), bags)
        # Ties go to the earlier chunk so the choice is deterministic.
        best = sorted((i for i, s in enumerate(scores) if s > 0), key=lambda i: (-scores[i], i))[:k]
        # A plus is unordered, but a canonical (corpus) order keeps the optimized
        # query identical for identical inputs, whatever the ranking.
        return tuple(fragments[i] for i in sorted(best))

    def _scores(self, terms: set[str], bags: list[Counter[str]]) -> list[float]:
        n = len(bags)
        if n == 0 or not terms:
            return [0.0] * n
        lengths = [sum(bag.values()) for bag in bags]
        avg = (sum(lengths) / n) or 1.0
        df = Counter(t for bag in bags for t in bag if t in terms)
        idf = {t: math.log(1.0 + (n - df[t] + 0.5) / (df[t] + 0.5)) for t in df}
        out = []
        for bag, length in zip(bags, lengths):
            norm = self.k1 * (1.0 - self.b + self.b * length / avg)
            out.append(sum(idf[t] * bag[t] * (self.k1 + 1.0) / (bag[t] + norm) for t in idf if bag[t]))
        return out
