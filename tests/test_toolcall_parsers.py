"""The tool-call parsers against calls written from known values, and the streaming parser
against the whole-text parser on random chunkings: deltas must concatenate to parse()."""
from __future__ import annotations

import json
import random
from typing import Any

import pytest

from spanserve.toolcall.parsers import PARSERS, Parsed, ParsedCall, get_parser
from spanserve.toolcall.stream import ToolStream

TRICKY = ["plain", "brace } and ] inside", 'quote " and \\ slash', "<tool_call>", "[TOOL_CALLS]", "ünïcödé ✓",
          '{"name": "x"}', "; ", "line\nbreak"]


def _args(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i in range(rng.randint(0, 3)):
        kind = rng.choice(["str", "int", "float", "bool", "null", "list"] + (["obj"] if depth < 2 else []))
        out[f"k{i}"] = {"str": lambda: rng.choice(TRICKY), "int": lambda: rng.randint(-10**6, 10**6),
                        "float": lambda: rng.uniform(-1e3, 1e3), "bool": lambda: rng.random() < 0.5,
                        "null": lambda: None, "list": lambda: [rng.choice(TRICKY), rng.randint(0, 9)],
                        "obj": lambda: _args(rng, depth + 1)}[kind]()
    return out


def _write(fmt: str, content: str, calls: list[tuple[str, dict[str, Any]]], rng: random.Random) -> str:
    """Calls as a model writes them in `fmt`, with random (valid) whitespace around the JSON."""
    ws = lambda: rng.choice(["", " ", "\n"])  # noqa: E731
    key = "parameters" if fmt == "llama3_json" else "arguments"
    objs = [f'{{{ws()}"name":{ws()}{json.dumps(n)},{ws()}"{key}":{ws()}{json.dumps(a)}{ws()}}}' for n, a in calls]
    if fmt == "hermes":
        return content + (ws() if content else "") + "".join(f"<tool_call>\n{o}\n</tool_call>\n" for o in objs)
    if fmt == "mistral":
        return content + (ws() if content else "") + "[TOOL_CALLS][" + ", ".join(objs) + "]"
    return ("<|python_tag|>" if rng.random() < 0.3 else "") + "; ".join(objs)


def _case(fmt: str, seed: int) -> tuple[str, str | None, list[tuple[str, dict[str, Any]]]]:
    rng = random.Random(seed)
    calls = [(rng.choice(["get_weather", "search", "add-2", "x"]), _args(rng)) for _ in range(rng.randint(1, 3))]
    content = "" if fmt == "llama3_json" else rng.choice(["", "Let me check.", "a < b and [c]", "<tool"])
    return _write(fmt, content, calls, rng), content or None, calls


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_parse_reads_back_written_calls(fmt: str) -> None:
    parser = get_parser(fmt)
    for seed in range(200):
        text, content, calls = _case(fmt, seed)
        got = parser.parse(text)
        assert got.content == content, text
        assert [(c.name, json.loads(c.arguments)) for c in got.calls] == calls, text


def _concat(deltas: list[Any]) -> Parsed:
    content = "".join(d.content for d in deltas)
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for d in deltas:
        for c in d.calls:
            if c.name is not None:
                assert c.index not in names, "a call's name is sent once"
                assert c.index == len(names), "calls are opened in order"
                names[c.index] = c.name
            args[c.index] = args.get(c.index, "") + c.arguments
    return Parsed(content or None, tuple(ParsedCall(names[i], args[i]) for i in sorted(names)))


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_stream_deltas_concatenate_to_parse(fmt: str) -> None:
    parser = get_parser(fmt)
    for seed in range(200):
        text, _, _ = _case(fmt, seed)
        rng = random.Random(seed + 10_000)
        # Truncated outputs too: a stream cut by max_tokens must agree with the parse of the cut.
        if seed % 3 == 0:
            text = text[:rng.randint(0, len(text))]
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
        stream, deltas, prev = ToolStream(parser), [], 0
        for cut in [*cuts, len(text)]:
            deltas.append(stream.feed(text[:cut], final=cut == len(text)))
            prev = cut
        assert prev == len(text)
        assert _concat(deltas) == parser.parse(text), text
        assert stream.called == bool(parser.parse(text).calls)


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_every_prefix_answers_a_prefix(fmt: str) -> None:
    parser = get_parser(fmt)
    for seed in range(40):
        text, _, _ = _case(fmt, seed)
        whole = parser.parse(text)
        for n in range(len(text) + 1):
            part = parser.parse(text[:n], final=False)
            assert (whole.content or "").startswith(part.content or ""), (text, n)
            assert len(part.calls) <= len(whole.calls)
            for p, w in zip(part.calls, whole.calls):
                assert p.name == w.name and w.arguments.startswith(p.arguments), (text, n)


def test_text_without_calls_is_content() -> None:
    for fmt in PARSERS:
        parser = get_parser(fmt)
        for text in ["The answer is 4.", "", "  spaced  ", "{not a call}", '{"answer": 1}', "<tool_call", "[TOOL"]:
            assert parser.parse(text) == Parsed(text or None, ()), (fmt, text)


def test_held_back_text_is_released_at_the_end() -> None:
    stream = ToolStream(get_parser("hermes"))
    assert stream.feed("Hi <tool", final=False).content == "Hi"
    assert stream.feed("Hi <tool", final=True).content == " <tool"
    assert not stream.called


def test_llama_waits_for_the_first_key() -> None:
    parser = get_parser("llama3_json")
    assert parser.parse('{"na', final=False) == Parsed(None, ())
    assert parser.parse('{"name": "f"', final=False).calls[0].name == "f"
    assert parser.parse('{"answer": 1', final=False).content == '{"answer": 1'


def test_call_without_arguments_gets_an_empty_object_and_malformed_calls_stop() -> None:
    assert get_parser("hermes").parse('<tool_call>\n{"name": "ping"}\n</tool_call>').calls[0].arguments == "{}"
    bad = get_parser("hermes").parse('<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>')
    assert bad.calls == () and bad.content is not None
    # a call cut by max_tokens keeps what was written
    cut = get_parser("mistral").parse('[TOOL_CALLS][{"name": "f", "arguments": {"q": "ab')
    assert cut.calls[0].name == "f" and cut.calls[0].arguments == '{"q": "ab'


def test_a_long_call_streams_in_few_parses() -> None:
    """A call of 25k characters fed 5 at a time: the deltas still add up to the whole parse, and
    the text is parsed again only as it grows by an eighth (not once per feed)."""
    args = {"text": "word " * 4000, "items": list(range(1000))}
    text = "Sure.<tool_call>\n" + json.dumps({"name": "f", "arguments": args}) + "\n</tool_call>"
    parser = get_parser("hermes")
    stream = ToolStream(parser)
    deltas = [stream.feed(text[:n], final=False) for n in range(5, len(text), 5)]
    deltas.append(stream.feed(text, final=True))
    assert _concat(deltas) == parser.parse(text)
    assert json.loads(parser.parse(text).calls[0].arguments) == args
    assert len(deltas) > 4000 and stream.parses < 1000
