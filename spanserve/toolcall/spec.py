"""What a chat request asks of tools: the declared functions, `tool_choice`, and a history whose
tool messages answer calls that were made. Checked here, before any template or grammar sees
them; every refusal is a ToolError naming the request field at fault."""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A tool definition, tool_choice or tool message the server refuses; `param` is its path."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: str  # JSON Schema of the arguments, as JSON text (frozen; key order is output order)

    @property
    def schema(self) -> dict[str, Any]:
        return dict(json.loads(self.parameters))

    def as_template_dict(self) -> dict[str, Any]:
        """OpenAI's tool object, the shape chat templates take as `tools`."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.schema
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class Choice:
    """none: calls are not parsed; auto: the model decides, calls are constrained once begun;
    required: at least one call (of `name` alone when a function is named), nothing else."""

    mode: Literal["none", "auto", "required"]
    name: str | None = None


def parse_tools(tools: Sequence[Mapping[str, Any]]) -> list[Tool]:
    """Tools as OpenAI sends them: `{"type": "function", "function": {"name", "description",
    "parameters"}}`; the parameters must be a JSON Schema (checked against its metaschema)."""
    out: list[Tool] = []
    for i, t in enumerate(tools):
        fn = t.get("function")
        where = f"tools.{i}.function"
        if t.get("type") != "function" or not isinstance(fn, Mapping):
            raise ToolError(f"tools.{i}: a tool is {{\"type\": \"function\", \"function\": {{...}}}}; "
                            f"only function tools exist here", f"tools.{i}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolError(f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}", f"{where}.name")
        if any(o.name == name for o in out):
            raise ToolError(f"{where}.name: the function {name!r} is declared twice; names must be unique",
                            f"{where}.name")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolError(f"{where}.description must be a string", f"{where}.description")
        params = fn.get("parameters", NO_PARAMETERS)
        _check_schema(params if params is not None else NO_PARAMETERS, f"{where}.parameters")
        out.append(Tool(name, desc, json.dumps(params if params is not None else NO_PARAMETERS)))
    return out


def _check_schema(schema: Any, param: str) -> None:
    import jsonschema

    if not isinstance(schema, Mapping):
        raise ToolError(f"{param} must be a JSON Schema object, got {type(schema).__name__}", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" for p in e.absolute_path)
        raise ToolError(f"{param} is not a valid JSON Schema: {e.message}" + (f" (at {path})" if path else ""),
                        param) from None


def parse_tool_choice(value: Any, tools: Sequence[Tool]) -> Choice:
    """OpenAI's tool_choice: "none" | "auto" | "required" | {"type": "function", "function":
    {"name"}}; without tools only "none" (or nothing) means anything."""
    if value is None:
        return Choice("auto" if tools else "none")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ToolError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {value!r}",
                            "tool_choice")
        if value != "none" and not tools:
            raise ToolError(f"tool_choice {value!r} needs tools; declare them in tools", "tool_choice")
        return Choice(value)  # type: ignore[arg-type]
    fn = value.get("function") if isinstance(value, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(value, Mapping) or value.get("type") != "function" or not isinstance(name, str):
        raise ToolError("tool_choice naming a function is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        "tool_choice")
    if not any(t.name == name for t in tools):
        declared = ", ".join(repr(t.name) for t in tools) or "none"
        raise ToolError(f"tool_choice names the function {name!r}, which tools does not declare "
                        f"(declared: {declared})", "tool_choice.function.name")
    return Choice("required", name)


def check_history(messages: Sequence[Mapping[str, Any]]) -> None:
    """Every tool message answers a call an earlier assistant message made (by its id)."""
    made: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or ():
            made.add(call.get("id", ""))
        if m.get("role") != "tool":
            continue
        cid = m.get("tool_call_id")
        if not isinstance(cid, str):
            raise ToolError(f"messages.{i}: a tool message needs the tool_call_id of the call it answers",
                            f"messages.{i}.tool_call_id")
        if cid not in made:
            raise ToolError(f"messages.{i}.tool_call_id {cid!r} matches no call of an earlier assistant message; "
                            f"send the assistant message with that call in tool_calls first",
                            f"messages.{i}.tool_call_id")
