"""Planner: a generation's (evaluated) input becomes an engine span layout.

Each message is rendered by the model's chat template on its own, so a message's tokens are the
same wherever it appears (a requirement for reusing it at another position); a plus child
becomes a plus segment; an evaluated inner generation contributes its exact prompt and output
token ids, which are what its finished request left in the cache."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spanserve.engine.layout import Segment

from .ir import Cross, Group, Message, Node, Par, Plus, Seq


@dataclass(frozen=True)
class Done(Node):
    """An executed inner generation, standing for its whole conversation."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    text: str
    input: Node  # the evaluated input, for the closure


@dataclass(frozen=True)
class Turn(Message):
    """A chat message with more than a role and text (tool calls, a tool result's call id, a
    name), as the chat template takes it: planned from an API request's history, never parsed
    from a span query."""

    fields: str = "{}"  # the template's message dict, as JSON (a frozen node holds no dict)

    def template_dict(self) -> dict[str, Any]:
        return dict(json.loads(self.fields))


_PROBE = {"role": "system", "content": "-"}


class PromptTooLong(ValueError):
    """A generation's input has more text than any prompt fitting the model's context."""


class Planner:
    def __init__(self, tokenizer: Any, anchor: str = "none", max_chars: int | None = None,
                 tools: list[dict[str, Any]] | None = None, encode: Callable[[str], list[int]] | None = None):
        """max_chars: the most message text one layout may hold, checked before any is
        tokenized (None: unbounded; the engine still refuses a prompt longer than its context).
        tools: OpenAI tool objects the template describes to the model. encode: how text becomes
        ids (default: the tokenizer's encode without special tokens; the server keeps pieces)."""
        if anchor not in ("none", "prefix"):
            raise ValueError(f"anchor must be 'none' or 'prefix', got {anchor!r}")
        self.tok = tokenizer
        self.anchor = anchor
        self.max_chars = max_chars
        self.tools = tools or None
        self._encoder = encode
        self.templated = bool(getattr(tokenizer, "chat_template", None))

    def _render(self, msgs: list[dict[str, Any]], gen: bool = False) -> str:
        return self.tok.apply_chat_template(msgs, tools=self.tools, tokenize=False, add_generation_prompt=gen)

    def turn(self, m: Message) -> str:
        """A message's text as the template renders it anywhere but first: the template's
        output for [probe, m] minus its output for [probe]."""
        if not self.templated:
            return f"{m.role}: {m.text}\n"
        probe = self._render([_PROBE])
        both = self._render([_PROBE, _dict(m)])
        if not both.startswith(probe):
            raise ValueError(f"the chat template renders a {m.role} message by changing what comes before it, "
                             "so it cannot be a segment of its own")
        return both[len(probe):]

    def preamble(self, first: Message) -> tuple[str, bool]:
        """What the template puts before a leading message (a default system prompt, the tools),
        and whether that text holds the message itself: a template that merges the tools into
        the system message renders it as no later turn would."""
        if not self.templated:
            return "", False
        whole = self._render([_dict(first)])
        turn = self.turn(first)
        if whole.endswith(turn):
            return whole[: len(whole) - len(turn)], False
        return whole, True

    def generation_prompt(self) -> str:
        if not self.templated:
            return "assistant:"
        return self._render([_PROBE], gen=True)[len(self._render([_PROBE])):]

    def _encode(self, text: str) -> list[int]:
        if self._encoder is not None:
            return self._encoder(text)
        return list(self.tok.encode(text, add_special_tokens=False))

    def _tokens(self, parts: list[Node]) -> list[int]:
        out: list[int] = []
        for p in parts:
            out += list(p.prompt_ids) + list(p.output_ids) if isinstance(p, Done) else self._encode(self.turn(p))
        return out

    def layout(self, input: Node, generation_prompt: bool = True) -> list[Segment]:
        items = _items(input, "cross")
        if not items:
            raise ValueError("a generation's input has no messages")
        chars = sum(len(p.text) for _, parts in items for p in parts if isinstance(p, Message))
        if self.max_chars is not None and chars > self.max_chars:
            raise PromptTooLong(f"a generation's input has {chars} characters of messages, more than the "
                                f"{self.max_chars} that any prompt fitting the model's context can have")
        segs: list[Segment] = []
        first = items[0][1][0]
        if isinstance(first, Message):
            pre, absorbed = self.preamble(first)
            if absorbed:
                if items[0][0] == "plus":
                    raise ValueError("the chat template renders the first message together with the tools; "
                                     "send it as an ordinary (cross) message")
                items[0] = (items[0][0], items[0][1][1:])
            if pre:
                segs.append(Segment(token_ids=self._encode(pre)))
        for kind, parts in items:
            ids = self._tokens(parts)
            if not ids:
                continue
            if kind == "plus":
                anchor = "none" if any(isinstance(p, Done) for p in parts) or not segs else self.anchor
                segs.append(Segment(token_ids=ids, kind="plus", anchor=anchor))
            else:
                segs.append(Segment(token_ids=ids))
        gen = self._encode(self.generation_prompt()) if generation_prompt else []
        if gen:  # a template may add nothing (the engine refuses a layout whose tail is a plus segment)
            segs.append(Segment(token_ids=gen))
        return segs


def _dict(m: Message) -> dict[str, Any]:
    return m.template_dict() if isinstance(m, Turn) else {"role": m.role, "content": m.text}


def _items(node: Node, kind: str) -> list[tuple[str, list[Node]]]:
    """Flatten an input into (kind, parts) runs: a plus child is one standalone unit."""
    if isinstance(node, (Message, Done)):
        return [(kind, [node])]
    if isinstance(node, (Plus, Par)):
        out = []
        for c in node.children:
            parts = [p for _, ps in _items(c, "cross") for p in ps]
            if parts:
                out.append(("plus", parts))
        return out
    if isinstance(node, (Cross, Seq)):
        return [it for c in node.children for it in _items(c, kind)]
    if isinstance(node, Group):
        return [it for c in node.children for it in _items(c, kind)]
    raise ValueError(f"cannot plan a {type(node).__name__} inside a generation's input; "
                     "it must be evaluated first")
