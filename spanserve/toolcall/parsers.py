"""Reading tool calls out of a model's text, one parser per output format.

Every parser answers the same question about a text that may still be growing: which content
is settled, and which calls (name, arguments so far) does it hold. A call counts once its name
string is complete; its arguments are the raw JSON text of the `arguments` (or `parameters`)
value as far as it has been written, "{}" when the call object closed without one. Content is
the text before the first call, without the whitespace that led up to it, or the whole text
when the output holds no call. `parse(text, final=False)` answers for a prefix: text that might
still turn into a call marker or trailing whitespace is held back, and whatever it returns for
a prefix stays a prefix of its answer for the whole text, which is what streaming relies on.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from spanserve.toolcall.json_scan import Malformed, load, skip_ws, string_end, value_end

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text as written (a prefix of it while the call is being written)


@dataclass(frozen=True)
class Parsed:
    content: str | None
    calls: tuple[ParsedCall, ...]


@dataclass(frozen=True)
class _Start:
    """Where calls begin: `content_end` bounds the settled content, `calls_at` is the index of
    the first call object (None: no call has begun)."""

    content_end: int
    calls_at: int | None


class ToolParser(ABC):
    name: str
    markers: tuple[str, ...]  # the text that opens calls in this format

    def parse(self, text: str, final: bool = True) -> Parsed:
        start = self._start(text, final)
        calls = self._calls(text, start.calls_at, final) if start.calls_at is not None else []
        if calls:
            content = text[:start.content_end].rstrip()
        elif final:
            content = text
        else:
            content = text[:start.content_end].rstrip()
        return Parsed(content or None, tuple(calls))

    @abstractmethod
    def _start(self, text: str, final: bool) -> _Start: ...

    @abstractmethod
    def _next_call(self, text: str, end: int) -> int | None:
        """After a call object that ended at `end`, the index of the next one's '{', if any."""

    def _calls(self, text: str, at: int | None, final: bool) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        while at is not None and at < len(text) and text[at] == "{":
            name, arguments, end = _read_call(text, at)
            if name is not None:
                if arguments is None and (end is not None or final):
                    arguments = "{}"
                calls.append(ParsedCall(name, arguments or ""))
            if end is None:
                break
            at = self._next_call(text, end)
        return calls


def _read_call(text: str, i: int) -> tuple[str | None, str | None, int | None]:
    """The call object at text[i] ('{'): its name once complete, its arguments text so far, and
    its end (None while it is incomplete, or when it stops being JSON)."""
    name: str | None = None
    arguments: str | None = None
    j = skip_ws(text, i + 1)
    try:
        while j < len(text):
            if text[j] == "}":
                return name, arguments, j + 1
            if text[j] == ",":
                j = skip_ws(text, j + 1)
                continue
            if text[j] != '"':
                raise Malformed("a key must come next")
            k = string_end(text, j)
            if k is None:
                break
            key = load(text[j:k])
            k = skip_ws(text, k)
            if k >= len(text):
                break
            if text[k] != ":":
                raise Malformed("':' must follow a key")
            v = skip_ws(text, k + 1)
            if v >= len(text):
                break
            e = value_end(text, v)
            if key in ARGUMENT_KEYS and arguments is None:
                arguments = text[v:] if e is None else text[v:e]
            if e is None:
                break
            if key == "name" and name is None:
                value = load(text[v:e])
                if not isinstance(value, str):
                    raise Malformed("a call's name is a string")
                name = value
            j = skip_ws(text, e)
    except Malformed:
        pass  # what was read before stays; the rest is not a call
    return name, arguments, None


def _held(text: str, marker: str) -> int:
    """How many trailing characters of text could be the beginning of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class _MarkedParser(ToolParser):
    """Calls open with a marker that may appear after some content."""

    marker: str

    def _start(self, text: str, final: bool) -> _Start:
        at = text.find(self.marker)
        if at < 0:
            return _Start(len(text) - (0 if final else _held(text, self.marker)), None)
        return _Start(at, self._first_call(text, at + len(self.marker)))

    @abstractmethod
    def _first_call(self, text: str, after_marker: int) -> int | None: ...


class HermesParser(_MarkedParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one tag per call (Qwen 2.5/3, Hermes)."""

    name = "hermes"
    marker = "<tool_call>"
    markers = (marker,)

    def _first_call(self, text: str, after_marker: int) -> int | None:
        return skip_ws(text, after_marker)

    def _next_call(self, text: str, end: int) -> int | None:
        at = text.find(self.marker, end)
        return None if at < 0 else skip_ws(text, at + len(self.marker))


class MistralParser(_MarkedParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    markers = (marker,)

    def _first_call(self, text: str, after_marker: int) -> int | None:
        j = skip_ws(text, after_marker)
        return skip_ws(text, j + 1) if j < len(text) and text[j] == "[" else None

    def _next_call(self, text: str, end: int) -> int | None:
        j = skip_ws(text, end)
        return skip_ws(text, j + 1) if j < len(text) and text[j] == "," else None


class Llama3JsonParser(ToolParser):
    """Llama 3.1/3.2: the output is `{"name": ..., "parameters": {...}}` calls joined by "; ",
    optionally after `<|python_tag|>`; output that does not open that way is content."""

    name = "llama3_json"
    python_tag = "<|python_tag|>"
    markers = (python_tag, '{"name"')

    def _start(self, text: str, final: bool) -> _Start:
        s = skip_ws(text, 0)
        rest = text[s:]
        if rest.startswith(self.python_tag):
            return _Start(0, skip_ws(text, s + len(self.python_tag)))
        undecided = _Start(0, None) if not final else _Start(len(text), None)
        if not rest or self.python_tag.startswith(rest):
            return undecided
        if rest[0] != "{":
            return _Start(len(text), None)
        j = skip_ws(text, s + 1)
        if j >= len(text):
            return undecided
        if text[j] != '"':
            return _Start(len(text), None)
        k = string_end(text, j)
        if k is None:
            return undecided
        return _Start(0, s) if text[j:k] == '"name"' else _Start(len(text), None)

    def _next_call(self, text: str, end: int) -> int | None:
        j = skip_ws(text, end)
        return skip_ws(text, j + 1) if j < len(text) and text[j] == ";" else None


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}")
    return PARSERS[name]()
