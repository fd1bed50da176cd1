"""Which chat template renders requests and which parser reads tool calls, decided once at start.

`--chat-template` names a template spanserve ships (hermes, llama3_json, mistral), a Jinja file,
or is the template itself (text with `{{` or `{%`, as vLLM takes it); without it the model's own
template is used. `--tool-call-parser` names the output format
of calls; `auto` (the default) recognises it from the template's text. A parser chosen for a
template that renders no tools brings spanserve's template of that format, so that the model is
told which tools exist. `describe()` is the line the server logs.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from spanserve.toolcall.parsers import PARSERS

PARSER_NAMES = tuple(PARSERS)
BUILTIN_TEMPLATES = PARSER_NAMES


def template_text(tok: Any) -> str | None:
    """A tokenizer's chat template; of several named ones, the one for tools, else the default."""
    t = getattr(tok, "chat_template", None) if tok is not None else None
    if isinstance(t, dict):
        t = t.get("tool_use") or t.get("default")
    return t if isinstance(t, str) and t else None


def builtin_template(name: str) -> str:
    return resources.files("spanserve.toolcall").joinpath("templates", f"{name}.jinja").read_text()


def is_inline(flag: str) -> bool:
    return "{{" in flag or "{%" in flag


def read_template(flag: str) -> str:
    """--chat-template: a shipped template's name, the template itself, else a Jinja file's path."""
    if flag in BUILTIN_TEMPLATES:
        return builtin_template(flag)
    if is_inline(flag):
        return flag
    path = Path(flag).expanduser()
    if not path.is_file():
        raise ValueError(f"--chat-template {flag!r} is neither one of {list(BUILTIN_TEMPLATES)}, a Jinja "
                         "template, nor a file")
    return path.read_text()


def _source(flag: str) -> str:
    if flag in BUILTIN_TEMPLATES:
        return f"{flag} (shipped)"
    return "the template given inline" if is_inline(flag) else f"file {flag}"


def detect_parser(template: str) -> str | None:
    """The call format a template writes calls in, judged by the markers it renders."""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and "parameters" in template):
        return "llama3_json"
    return None


@dataclass(frozen=True)
class ChatSetup:
    template: str | None  # what requests are rendered with; None: the model has no template
    parser: str | None  # None: requests with tools get a 400 that says how to start the server
    template_source: str  # for the log: "the model's", "hermes (shipped)", "file PATH"
    parser_source: str  # for the log: "--tool-call-parser", "detected in the chat template", ...

    def describe(self) -> str:
        if self.parser is None:
            return f"chat template: {self.template_source}; tool calling: off ({self.parser_source})"
        return (f"chat template: {self.template_source}; tool calling: {self.parser} parser "
                f"({self.parser_source})")


def resolve_chat_setup(model_template: str | None, template_flag: str | None = None,
                       parser_flag: str | None = "auto") -> ChatSetup:
    parser_flag = parser_flag or "auto"
    if parser_flag not in (*PARSER_NAMES, "auto", "none"):
        raise ValueError(f"--tool-call-parser must be one of {[*PARSER_NAMES, 'auto', 'none']}, got {parser_flag!r}")
    if template_flag is not None:
        template: str | None = read_template(template_flag)
        source = _source(template_flag)
    else:
        template, source = model_template, "the model's" if model_template else "none"
    if parser_flag == "none":
        return ChatSetup(template, None, source, "--tool-call-parser none")
    if parser_flag == "auto":
        parser = detect_parser(template) if template else None
        why = "detected in the chat template" if parser else \
            "no call format recognised in the chat template; choose one with --tool-call-parser"
        return ChatSetup(template, parser, source, why)
    if template_flag is None and (not template or "tools" not in template):
        return ChatSetup(builtin_template(parser_flag), parser_flag, f"{parser_flag} (shipped)",
                         "--tool-call-parser; the model's template renders no tools, so spanserve's is used")
    return ChatSetup(template, parser_flag, source, "--tool-call-parser")
