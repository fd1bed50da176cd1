"""Function calling on /v1/chat/completions: a request's tools, checked; the grammar its
tool_choice imposes; the model's output read back as OpenAI tool calls, whole or streamed.

The server's ChatSetup (toolcall/chat_setup.py) says which template describes the tools to the
model and which parser reads its calls; the grammar is written in that parser's format, so a
call made under `required` or a named function always parses, names a declared function and
carries arguments valid against its schema.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spanserve.server.errors import APIError, bad_request
from spanserve.server.messages import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from spanserve.server.protocol import AssistantMessage, ChatCompletionRequest
from spanserve.toolcall.chat_setup import PARSER_NAMES, ChatSetup
from spanserve.toolcall.grammar import tool_grammar
from spanserve.toolcall.parsers import ToolParser, get_parser
from spanserve.toolcall.spec import Choice, Tool, ToolError, check_history, parse_tool_choice, parse_tools
from spanserve.toolcall.stream import StreamDelta, ToolStream

# Arguments are written as json.dumps writes them, which is how templates render them again in
# the next turn: the history then re-tokenizes to the very tokens the model generated.
JSON_SEPARATORS = [", ", ": "]


@dataclass(frozen=True)
class ToolUse:
    tools: list[Tool]
    choice: Choice
    parser: ToolParser | None  # None with tool_choice "none": the output is plain text
    response_format: dict[str, Any] | None  # the grammar of the choice; None: unconstrained

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.as_template_dict() for t in self.tools]


def plan_tools(req: ChatCompletionRequest, setup: ChatSetup, max_schema_bytes: int) -> ToolUse | None:
    """The request's tool use, None without tools; APIError 400 naming the field otherwise.
    Blocking (schemas are checked against their metaschema): call it off the event loop."""
    try:
        check_history([m.as_template_dict() for m in req.messages])
        tools = parse_tools(_tool_dicts(req.tools or [], max_schema_bytes))
        choice = parse_tool_choice(req.tool_choice, tools)
    except ToolError as e:
        raise bad_request(str(e), param=e.param, code="invalid_tools") from None
    if not tools:
        return None
    if choice.mode == "none":
        return ToolUse(tools, choice, None, None)
    if setup.parser is None:
        raise APIError(400, f"tools: this server reads no tool calls ({setup.parser_source}); start it with "
                            f"--tool-call-parser {{{','.join(PARSER_NAMES)}}}, or send tool_choice \"none\"",
                       param="tools", code="tool_calling_off")
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        raise APIError(400, "response_format cannot be combined with tools unless tool_choice is \"none\"; "
                            "describe the answer's shape as a tool instead", param="response_format",
                       code="unsupported_parameter")
    grammar = tool_grammar(setup.parser, tools, choice, parallel=req.parallel_tool_calls is not False)
    if grammar is not None:
        grammar["json_separators"] = JSON_SEPARATORS
    return ToolUse(tools, choice, get_parser(setup.parser), grammar)


def _tool_dicts(tools: Sequence[Any], max_bytes: int) -> list[dict[str, Any]]:
    """The tools, their size bounded before any schema is checked: their schemas all become one
    grammar, which gets response_format's bound on schema size."""
    size = 0
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise ToolError(f"tools.{i} must be an object, got {type(t).__name__}", f"tools.{i}")
        size += len(json.dumps(t, separators=(",", ":")).encode())
        if size > max_bytes:
            raise ToolError(f"tools: the tool definitions pass {max_bytes} bytes of JSON at tools.{i}; "
                            f"declare fewer or smaller tools", "tools")
    return list(tools)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def assistant_message(text: str, finish_reason: str | None, use: ToolUse | None) -> tuple[AssistantMessage, str | None]:
    """The message of one finished choice, and its finish_reason ("tool_calls" when it called)."""
    if use is None or use.parser is None:
        return AssistantMessage(content=text), finish_reason
    parsed = use.parser.parse(text)
    if not parsed.calls:
        return AssistantMessage(content=parsed.content), finish_reason
    calls = [ToolCall(id=call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.calls]
    return (AssistantMessage(content=parsed.content, tool_calls=calls),
            "tool_calls" if finish_reason == "stop" else finish_reason)


@dataclass
class ToolDeltas:
    """One streamed choice's text turned into content and tool-call deltas as it grows."""

    stream: ToolStream
    text: str = ""

    @classmethod
    def of(cls, use: ToolUse | None) -> ToolDeltas | None:
        return cls(ToolStream(use.parser)) if use is not None and use.parser is not None else None

    def feed(self, new_text: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        self.text += new_text
        delta: StreamDelta = self.stream.feed(self.text, final)
        calls = []
        for c in delta.calls:
            if c.name is not None:  # a call's first delta: its id is made here
                calls.append(DeltaToolCall(index=c.index, id=call_id(), type="function",
                                           function=DeltaFunctionCall(name=c.name, arguments=c.arguments)))
            elif c.arguments:
                calls.append(DeltaToolCall(index=c.index, function=DeltaFunctionCall(arguments=c.arguments)))
        return delta.content, calls

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.stream.called and reason == "stop" else reason
