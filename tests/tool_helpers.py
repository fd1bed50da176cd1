"""Shared pieces of the tool-calling tests: chat templates written here for each call format
(a user's own, passed with --chat-template PATH), tools, and a streamed reply read back the way
agent frameworks read it."""
from __future__ import annotations

import json
from typing import Any

# Not the templates spanserve ships: what a user might write for a model of each family.
TEMPLATES = {
    "hermes": (
        "{%- if tools -%}{{- '<|im_start|>system\\n# Tools\\n<tools>' -}}"
        "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
        "{{- '\\n</tools>\\nCall with <tool_call>\\n{\"name\": ..., \"arguments\": ...}\\n</tool_call><|im_end|>\\n' -}}"
        "{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'tool' -%}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' -}}"
        "{%- elif m.tool_calls -%}{{- '<|im_start|>assistant\\n' -}}"
        "{%- for c in m.tool_calls -%}{{- '<tool_call>\\n' + ({'name': c.function.name, 'arguments': c.function.arguments} | tojson) + '\\n</tool_call>' -}}{%- endfor -%}"
        "{{- '<|im_end|>\\n' -}}"
        "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' -}}{%- endif -%}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"),
    "llama3_json": (
        "{{- bos_token -}}{%- if tools -%}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools (answer with "
        "{\"name\": ..., \"parameters\": ...}):' -}}"
        "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}{{- '<|eot_id|>' -}}{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- set role = 'ipython' if m.role == 'tool' else m.role -%}"
        "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' -}}"
        "{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}{%- if not loop.first -%}{{- '; ' -}}{%- endif -%}"
        "{{- {'name': c.function.name, 'parameters': c.function.arguments} | tojson -}}{%- endfor -%}"
        "{%- else -%}{{- m.content or '' -}}{%- endif -%}{{- '<|eot_id|>' -}}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"),
    "mistral": (
        "{{- bos_token -}}{%- if tools -%}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' -}}{%- endif -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'user' or m.role == 'system' -%}{{- '[INST]' + m.content + '[/INST]' -}}"
        "{%- elif m.role == 'tool' -%}{{- '[TOOL_RESULTS]' + m.content + '[/TOOL_RESULTS]' -}}"
        "{%- elif m.tool_calls -%}{{- '[TOOL_CALLS]' + (m.tool_calls | map(attribute='function') | list | tojson) + eos_token -}}"
        "{%- else -%}{{- (m.content or '') + eos_token -}}{%- endif -%}"
        "{%- endfor -%}"),
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search_docs", "description": "Find documents about a topic",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16},
                                                    "top_k": {"type": "integer", "minimum": 1, "maximum": 5}},
                   "required": ["query", "top_k"]}}}
TOOLS = [WEATHER, SEARCH]


def schema_of(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


def streamed_reply(stream: Any) -> tuple[str | None, list[tuple[str, str]], str | None]:
    """An openai client's chat stream gathered as frameworks do: content, calls (name,
    arguments) by index, the finish reason; every call's first delta brings its id and name."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.function.name and d.type == "function", d
                    calls[d.index] = [d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None, d
                calls[d.index][1] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    return content or None, [(n, a) for n, a in (calls[i] for i in sorted(calls))], reason


def reply(message: Any) -> tuple[str | None, list[tuple[str, str]]]:
    return message.content, [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def arguments(text: str) -> Any:
    return json.loads(text)
