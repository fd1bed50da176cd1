"""Tool calls streamed as OpenAI's deltas: each new piece of text becomes the content and call
pieces that are now settled. The parser's answer for a prefix is a prefix of its answer for the
whole text, so the deltas are differences of successive answers and concatenate to `parse`."""
from __future__ import annotations

from dataclasses import dataclass, field

from spanserve.toolcall.parsers import Parsed, ToolParser

# Each feed parses the whole text again. Up to this length that costs little; beyond it, while a
# call is being written, the text is parsed again only once it has grown by an eighth, so a long
# call costs a few whole-text parses instead of one per token (25k characters fed 5 at a time
# took 4.6 s of the event loop before).
PARSE_EVERY_FEED = 4096


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
    parsed_len: int = 0
    parses: int = 0

    @property
    def called(self) -> bool:
        return bool(self.arguments_sent)

    def feed(self, text: str, final: bool) -> StreamDelta:
        """`text` is the whole output so far; the delta is what it settles beyond earlier feeds."""
        if (not final and self.called and len(text) > PARSE_EVERY_FEED
                and len(text) - self.parsed_len < self.parsed_len // 8):
            return StreamDelta("", ())
        self.parsed_len = len(text)
        self.parses += 1
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
