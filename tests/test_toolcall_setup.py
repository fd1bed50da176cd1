"""Which template and parser a server starts with, and the grammar a tool choice imposes,
checked with xgrammar's matcher on SmolLM2's vocabulary: the calls each format writes are
accepted, undeclared names, invalid arguments and stray text are not."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spanserve.engine.structured import Grammars, parse_response_format
from spanserve.model.loader import load_tokenizer
from spanserve.toolcall.chat_setup import BUILTIN_TEMPLATES, builtin_template, detect_parser, resolve_chat_setup
from spanserve.toolcall.grammar import tool_grammar
from spanserve.toolcall.parsers import get_parser
from spanserve.toolcall.spec import Choice, ToolError, check_history, parse_tool_choice, parse_tools
from tool_helpers import TEMPLATES


def test_shipped_templates_are_recognised() -> None:
    for name in BUILTIN_TEMPLATES:
        assert detect_parser(builtin_template(name)) == name
    assert detect_parser(TEMPLATES["hermes"]) == "hermes" and detect_parser(TEMPLATES["mistral"]) == "mistral"
    assert detect_parser("{{ messages }}") is None


def test_resolve_chat_setup(tmp_path: Path) -> None:
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    off = resolve_chat_setup(plain)
    assert off.parser is None and off.template == plain and "tool calling: off" in off.describe()
    # a parser for a model whose template renders no tools brings the shipped template
    named = resolve_chat_setup(plain, None, "hermes")
    assert named.template == builtin_template("hermes") and "hermes parser" in named.describe()
    auto = resolve_chat_setup(builtin_template("mistral"))
    assert auto.parser == "mistral" and "detected" in auto.describe()
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATES["hermes"])
    from_file = resolve_chat_setup(plain, str(path))
    assert from_file.template == TEMPLATES["hermes"] and from_file.parser == "hermes"
    assert f"file {path}" in from_file.describe()
    inline = resolve_chat_setup(plain, TEMPLATES["mistral"])  # the template itself, as vLLM takes it
    assert inline.template == TEMPLATES["mistral"] and inline.parser == "mistral"
    assert "inline" in inline.describe()
    assert resolve_chat_setup(builtin_template("hermes"), None, "none").parser is None
    with pytest.raises(ValueError, match="neither"):
        resolve_chat_setup(plain, str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="--tool-call-parser"):
        resolve_chat_setup(plain, None, "qwen")


def test_spec_errors_name_their_field() -> None:
    tools = parse_tools([{"type": "function", "function": {"name": "f"}}])
    assert json.loads(tools[0].parameters) == {"type": "object", "properties": {}}
    cases: list[tuple[Any, str]] = [
        (lambda: parse_tools([{"type": "retrieval"}]), "tools.0"),
        (lambda: parse_tools([{"type": "function", "function": {"name": "f"}}] * 2), "tools.1.function.name"),
        (lambda: parse_tools([{"type": "function", "function": {"name": "f", "parameters": []}}]),
         "tools.0.function.parameters"),
        (lambda: parse_tools([{"type": "function", "function": {"name": "f", "description": 3}}]),
         "tools.0.function.description"),
        (lambda: parse_tool_choice("sometimes", tools), "tool_choice"),
        (lambda: parse_tool_choice({"type": "function"}, tools), "tool_choice"),
        (lambda: parse_tool_choice({"type": "function", "function": {"name": "g"}}, tools), "tool_choice.function.name"),
        (lambda: check_history([{"role": "tool", "content": "x"}]), "messages.0.tool_call_id"),
    ]
    for call, param in cases:
        with pytest.raises(ToolError) as e:
            call()
        assert e.value.param == param
    check_history([{"role": "assistant", "tool_calls": [{"id": "a"}]}, {"role": "tool", "tool_call_id": "a"}])


TOOLS = parse_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "ping"}},
])
CALLS = {  # (weather call, ping call, how the format joins two calls)
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
               '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', "{}\n{}"),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', '{"name": "ping", "parameters": {}}',
                    "{}; {}"),
    "mistral": ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', '{"name": "ping", "arguments": {}}',
                "[TOOL_CALLS][{}, {}]"),
}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tok = load_tokenizer("smollm2")
    return Grammars(tok, len(tok), {tok.eos_token_id})


def _accepts(grammars: Grammars, fmt: str, choice: Choice, text: str, parallel: bool = True) -> bool:
    import xgrammar

    spec = tool_grammar(fmt, TOOLS, choice, parallel)
    assert spec is not None
    compiled = grammars.compile(parse_response_format({**spec, "json_separators": [", ", ": "]}))
    m = xgrammar.GrammarMatcher(compiled)
    return bool(m.accept_string(text) and m.accept_token(grammars.tokenizer.eos_token_id) and m.is_terminated())


@pytest.mark.parametrize("fmt", sorted(CALLS))
def test_tool_grammar(grammars: Grammars, fmt: str) -> None:
    weather, ping, join = CALLS[fmt]
    one = join.replace(", {}", "").replace("; {}", "").replace("\n{}", "").format(weather)
    two = join.format(weather, ping)
    required, auto = Choice("required"), Choice("auto")
    assert _accepts(grammars, fmt, required, one) and _accepts(grammars, fmt, required, two)
    assert not _accepts(grammars, fmt, required, two, parallel=False)
    assert not _accepts(grammars, fmt, required, "Sure. " + one)  # nothing but calls
    assert not _accepts(grammars, fmt, required, one.replace("get_weather", "get_time"))  # undeclared
    assert not _accepts(grammars, fmt, required, one.replace('{"city": "Oslo"}', '{"town": "Oslo"}'))  # invalid
    assert not _accepts(grammars, fmt, required, one.replace('"city": ', '"city":  '))  # whitespace is fixed
    assert _accepts(grammars, fmt, Choice("required", "ping"), join.split("{}")[0] + ping + join.split("{}")[-1]
                    if fmt == "mistral" else ping)
    assert not _accepts(grammars, fmt, Choice("required", "ping"), one)
    assert _accepts(grammars, fmt, auto, "The weather is fine.")
    assert _accepts(grammars, fmt, auto, one)
    if fmt != "llama3_json":  # Llama's calls open the output or not at all
        assert _accepts(grammars, fmt, auto, "Let me look. " + one)
    assert tool_grammar(fmt, TOOLS, Choice("none")) is None
    # whatever the grammar accepts, the parser reads back as declared calls
    parsed = get_parser(fmt).parse(two)
    assert [c.name for c in parsed.calls] == ["get_weather", "ping"]
