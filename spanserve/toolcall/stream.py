"""Tool calls streamed as OpenAI's deltas: each new piece of text becomes the content and call
pieces that are now settled. The parser's answer for a prefix is a prefix of its answer for the
whole text, so the deltas are differences of successive answers and concatenate to `parse`."""
from __future__ import annotations

from dataclasses import dataclass, field

from spanserve.toolcall.parsers import Parsed, ToolParser


@dataclass(frozen=True)
class CallDelta:
    index: int
    name: str | None  # set on a call's first delta only
    arguments: str


@dataclass(frozen=True)
class StreamDelta:
    content: str
    calls: tuple[CallDelta, ...]


@dataclass
class ToolStream:
    parser: ToolParser
    content_sent: int = 0
    arguments_sent: list[int] = field(default_factory=list)

    @property
    def called(self) -> bool:
        return bool(self.arguments_sent)

    def feed(self, text: str, final: bool) -> StreamDelta:
        """`text` is the whole output so far; the delta is what it settles beyond earlier feeds."""
        now: Parsed = self.parser.parse(text, final)
        content = (now.content or "")[self.content_sent:]
        self.content_sent += len(content)
        deltas = []
        for i, call in enumerate(now.calls):
            if i == len(self.arguments_sent):
                self.arguments_sent.append(len(call.arguments))
                deltas.append(CallDelta(i, call.name, call.arguments))
            elif len(call.arguments) > self.arguments_sent[i]:
                deltas.append(CallDelta(i, None, call.arguments[self.arguments_sent[i]:]))
                self.arguments_sent[i] = len(call.arguments)
        return StreamDelta(content, tuple(deltas))
