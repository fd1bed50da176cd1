"""The grammar a tool choice imposes, as an xgrammar structural tag (OpenAI's response_format
shape `{"type": "structural_tag", "format": ...}`), written in the output format of each parser.

`required` and a named function: the output is calls and nothing else, each naming a declared
function, its arguments valid against that function's schema. `auto`: text is free until the
format's call opening appears; from there the call is constrained the same way. The JSON inside
arguments may hold at most one whitespace character in a row, so a weak model cannot pad a
call forever; the fixed text around it is written the way the templates render calls.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spanserve.toolcall.spec import Choice, Tool

MAX_WHITESPACE = 1


@dataclass(frozen=True)
class CallShape:
    """How one format writes calls: `begin` (with {name}) + arguments JSON + `end`, calls joined
    by `separator`, the whole list inside `open` ... `close`; `trigger` opens calls in auto mode."""

    begin: str
    end: str
    separator: str
    open: str
    close: str
    trigger: str


SHAPES = {
    "hermes": CallShape('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n", "", "",
                        "<tool_call>"),
    "llama3_json": CallShape('{{"name": {name}, "parameters": ', "}", "; ", "", "", '{"name"'),
    "mistral": CallShape('{{"name": {name}, "arguments": ', "}", ", ", "[TOOL_CALLS][", "]", "[TOOL_CALLS]"),
}


def tool_grammar(parser: str, tools: Sequence[Tool], choice: Choice, parallel: bool = True) -> dict[str, Any] | None:
    """The response_format that enforces `choice` in `parser`'s format; None for "none"."""
    if choice.mode == "none":
        return None
    shape = SHAPES[parser]
    named = [t for t in tools if choice.name is None or t.name == choice.name]
    one = choice.name is not None or not parallel
    calls = {"type": "tags_with_separator", "tags": [_tag(shape, t) for t in named], "separator": shape.separator,
             "at_least_one": True, "stop_after_first": one}
    listed = _wrapped(shape, calls)
    if choice.mode == "required":
        return _structural(listed)
    if shape.trigger.startswith("{"):
        # A bare JSON call (Llama) is a call only at the start of the output: either calls, or
        # text in which the opening never appears.
        free = {"type": "any_text", "excludes": [shape.trigger]}
        return _structural({"type": "or", "elements": [listed, free]})
    if shape.open:
        tags = [{"type": "tag", "begin": shape.open, "content": calls, "end": shape.close}]
    else:
        tags = calls["tags"]
    return _structural({"type": "triggered_tags", "triggers": [shape.trigger], "tags": tags,
                        "at_least_one": False, "stop_after_first": one})


def _tag(shape: CallShape, tool: Tool) -> dict[str, Any]:
    content = {"type": "json_schema", "json_schema": tool.schema, "max_whitespace_cnt": MAX_WHITESPACE}
    return {"type": "tag", "begin": shape.begin.format(name=json.dumps(tool.name)), "content": content,
            "end": shape.end}


def _wrapped(shape: CallShape, calls: dict[str, Any]) -> dict[str, Any]:
    if not shape.open:
        return calls
    return {"type": "sequence", "elements": [{"type": "const_string", "value": shape.open}, calls,
                                             {"type": "const_string", "value": shape.close}]}


def _structural(fmt: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}
