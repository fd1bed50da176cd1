"""Token ids of a rendered chat, kept piece by piece between its special tokens.

A chat comes back every turn with one more message, and an agent's history holds tens of
thousands of tokens of tool results: encoding all of it again costs 25 ms per 13k tokens on a
CPU core, paid before the engine sees the request, on a pool of two tokenizer threads. A Hugging
Face tokenizer splits text at its added tokens before anything else and encodes the text between
them on its own, so a chat template's output (a special token before each message) encodes as
the concatenation of its pieces' encodings. Pieces are kept per tenant (what one tenant sent is
not timed by another) and the split is trusted only for tokenizers that pass a self-check against
their whole-text encoding at start; for the others every text is encoded whole.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

MIN_PIECE_CHARS = 64  # shorter pieces encode in microseconds: not worth a slot
MAX_KEPT_CHARS = 32 << 20
_PROBES = ("Hello world", " leading space", "\n\nnewlines\n", "x", "tab\tand  two spaces ", "ünïcödé 123")


def _exact_specials(tok: Any) -> dict[str, int] | None:
    """Added tokens matched as they are written, or None when some are not (stripped around,
    normalized first, whole words only): then the split is not the tokenizer's own."""
    decoder = getattr(tok, "added_tokens_decoder", None)
    if not decoder:
        return None
    out = {}
    for token_id, added in decoder.items():
        content = getattr(added, "content", None)
        if not content:
            return None
        if getattr(added, "lstrip", False) or getattr(added, "rstrip", False) or getattr(added, "single_word", False):
            return None
        if getattr(added, "normalized", False) and not getattr(added, "special", False):
            return None
        out[content] = int(token_id)
    return out


class PieceCache:
    def __init__(self, tokenizer: Any, max_chars: int = MAX_KEPT_CHARS):
        self.max_chars = max_chars
        self._kept: OrderedDict[tuple[str, str], list[int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        specials = _exact_specials(tokenizer)
        self._ids = specials or {}
        self._split = (re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
                       if specials else None)
        if self._split is not None and not self._agrees(tokenizer):
            self._split = None

    @property
    def enabled(self) -> bool:
        return self._split is not None

    def _agrees(self, tok: Any) -> bool:
        marks = list(self._ids)[:4]
        for i, a in enumerate(_PROBES):
            for mark in marks:
                text = a + mark + _PROBES[(i + 1) % len(_PROBES)] + mark + mark + a
                if list(tok.encode(text, add_special_tokens=False)) != self._pieces(tok, text, None):
                    return False
        return True

    def encode(self, tok: Any, text: str, tenant: str = "") -> list[int]:
        """tok.encode(text, add_special_tokens=False), from kept pieces where it can."""
        if self._split is None:
            return list(tok.encode(text, add_special_tokens=False))
        return self._pieces(tok, text, tenant)

    def _pieces(self, tok: Any, text: str, tenant: str | None) -> list[int]:
        assert self._split is not None
        out: list[int] = []
        for k, part in enumerate(self._split.split(text)):
            if k % 2:
                out.append(self._ids[part])
            elif part:
                out += self._piece(tok, part, tenant)
        return out

    def _piece(self, tok: Any, part: str, tenant: str | None) -> list[int]:
        if tenant is None or len(part) < MIN_PIECE_CHARS:
            return list(tok.encode(part, add_special_tokens=False))
        key = (tenant, part)
        with self._lock:
            hit = self._kept.get(key)
            if hit is not None:
                self._kept.move_to_end(key)
                return list(hit)
        ids = list(tok.encode(part, add_special_tokens=False))
        if len(part) <= self.max_chars // 4:
            with self._lock:
                if key not in self._kept:
                    self._kept[key] = ids
                    self._chars += len(part)
                    while self._chars > self.max_chars:
                        (_, old), _ = self._kept.popitem(last=False)
                        self._chars -= len(old)
        return list(ids)
