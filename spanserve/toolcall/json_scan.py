"""Where a JSON value ends in text that may still be growing.

A streamed call is read before it is complete, so every answer here is one of three: the value
ends at index `e`, it is still incomplete (None: the text ran out inside it), or the text cannot
be JSON (Malformed). An answer given for a prefix never changes as the text grows, which is what
lets the streaming parser emit a piece of a call and never take it back. Values are delimited,
not validated: a complete call's arguments are passed on as the model wrote them.
"""
from __future__ import annotations

import json
from typing import Any

WHITESPACE = " \t\n\r"
OPEN = "{["
CLOSE = "}]"
SCALAR = frozenset("0123456789+-.eEtrufalsn")


class Malformed(ValueError):
    """The text at this point cannot continue a JSON value."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """text[i] is a quote: the index after the closing quote, None if it has not come yet."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The end of the JSON value starting at text[i]: objects and arrays by bracket depth
    (strings skipped), literals and numbers up to the first character that cannot be theirs."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in OPEN:
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                e = string_end(text, i)
                if e is None:
                    return None
                i = e
                continue
            if c in OPEN:
                depth += 1
            elif c in CLOSE:
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    if c not in SCALAR:
        raise Malformed(f"a JSON value cannot start with {c!r}")
    while i < len(text) and text[i] in SCALAR:
        i += 1
    return None if i == len(text) else i  # a number may go on while the text does


def load(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise Malformed(f"not JSON: {text[:40]!r}") from None
