"""Tool calling over HTTP with the openai client (in-process app, a noise model behind SmolLM2's
tokenizer), for each call format with a template written in tool_helpers: calls, tool messages
and the final answer, streamed and not; calls under `required` or a named function on 50 random
schemas; 400s that name the field; tool results reused as plus segments."""
from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import BadRequestError, OpenAI
from starlette.testclient import TestClient

from spanserve.model.loader import load_tokenizer
from spanserve.server.app import create_app
from spanserve.server.context import ServerConfig
from engine_helpers import make_engine
from structured_helpers import build_tiny_smollm2, random_schema
from tool_helpers import TEMPLATES, TOOLS, WEATHER, arguments, reply, schema_of, streamed_reply

FORMATS = sorted(TEMPLATES)
# auto: the parser is recognised in the template; llama3_json's template here has no marker to
# recognise (neither <|python_tag|> nor an ipython role in the text), so it is named.
PARSER_FLAG = {"hermes": "auto", "mistral": "auto", "llama3_json": "llama3_json"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_smollm2(tmp_path_factory.mktemp("tools") / "tiny", load_tokenizer("smollm2"))


@pytest.fixture(scope="module", params=FORMATS)
def served(request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, OpenAI]]:
    fmt = request.param
    template = tmp_path_factory.mktemp(fmt) / "template.jinja"
    template.write_text(TEMPLATES[fmt])
    engine = make_engine(str(model), num_blocks=512, block_size=16)
    config = ServerConfig(served_model_name="tiny", model_source=str(model), chat_template=str(template),
                          tool_call_parser=PARSER_FLAG[fmt])
    app = create_app(engine, config)
    with TestClient(app, raise_server_exceptions=False) as http:
        assert app.state.ctx.chat_setup.parser == fmt
        yield fmt, OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def _first_turn(client: OpenAI, stream: bool, seed: int, **extra: Any) -> tuple[str | None, list[tuple[str, str]], str | None]:
    body: dict[str, Any] = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris, in celsius?"}],
                                tools=TOOLS, max_tokens=160, temperature=1.0, seed=seed, **extra)
    if stream:
        return streamed_reply(client.chat.completions.create(stream=True, **body))
    choice = client.chat.completions.create(**body).choices[0]
    return (*reply(choice.message), choice.finish_reason)


def test_openai_tool_flow(served: tuple[str, OpenAI]) -> None:
    fmt, client = served
    tok = load_tokenizer("smollm2")
    for seed in range(3):
        whole = _first_turn(client, False, seed, tool_choice="required", parallel_tool_calls=False)
        content, calls, reason = whole
        assert reason == "tool_calls" and len(calls) == 1, whole
        name, args = calls[0]
        jsonschema.validate(arguments(args), schema_of(TOOLS, name))
        # The same request streamed: the deltas build the very same reply.
        assert _first_turn(client, True, seed, tool_choice="required", parallel_tool_calls=False) == whole
    # The turn's assistant message and the tool's answer go back; the model answers.
    first = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=160, seed=7)
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    history = [{"role": "user", "content": "Weather in Paris?"}, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}]
    for stream in (False, True):
        body = dict(model="tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=12, seed=1)
        if stream:
            content, calls, reason = streamed_reply(client.chat.completions.create(stream=True, **body))
        else:
            final = client.chat.completions.create(**body)
            (content, calls), reason = reply(final.choices[0].message), final.choices[0].finish_reason
            # The template rendered the tools, the call and the tool's answer: the prompt is
            # exactly its tokens.
            # As vLLM does, the server hands templates a call's arguments as an object, not text.
            as_template = json.loads(json.dumps(history))
            for c in as_template[1]["tool_calls"]:
                c["function"] = {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
            text = tok.apply_chat_template(as_template, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                           chat_template=TEMPLATES[fmt])
            assert "Sunny, 21 degrees." in text
            assert final.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
            assert final.usage.prompt_tokens_details.cached_tokens > 0  # the first turn's prefix
        assert calls == [] and content and reason == "length"


def test_auto_may_answer_in_text(served: tuple[str, OpenAI]) -> None:
    _, client = served
    for stream in (False, True):
        content, calls, reason = _first_turn(client, stream, 11, tool_choice="auto")
        for name, args in calls:
            jsonschema.validate(arguments(args), schema_of(TOOLS, name))
        assert reason == ("tool_calls" if calls else "length") or reason == "length"
        assert content or calls


def _tool(i: int, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": f"tool_{i}", "description": f"random tool {i}", "parameters": schema}}


def test_required_and_named_calls_validate(served: tuple[str, OpenAI]) -> None:
    """50 random schemas over the three formats: each is declared with two others, and called by
    name (even i) or under `required`, one call or parallel ones; every call names a declared tool
    and validates (a noise model makes parallel calls until max_tokens cuts the last one)."""
    fmt, client = served
    rng = random.Random(31)
    schemas = [random_schema(rng) for _ in range(50)]
    mine = [i for i in range(50) if i % len(FORMATS) == FORMATS.index(fmt)]

    def one(i: int) -> tuple[int, Any]:
        declared = [_tool(j % 50, schemas[j % 50]) for j in (i, i + 1, i + 2)]
        choice: Any = {"type": "function", "function": {"name": f"tool_{i}"}} if i % 2 == 0 else "required"
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"Use tool {i}."}],
                                           tools=declared, tool_choice=choice, parallel_tool_calls=i % 4 == 3,
                                           max_tokens=400, seed=i)
        return i, (declared, r.choices[0])

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, mine))
    for i, (declared, choice) in results:
        calls = choice.message.tool_calls or []
        if i % 4 == 3 and choice.finish_reason == "length":
            calls = calls[:-1]
        else:
            assert choice.finish_reason == "tool_calls" and (i % 4 == 3 or len(calls) == 1), (i, choice)
        assert calls, (i, choice)
        for call in calls:
            names = [t["function"]["name"] for t in declared]
            assert call.function.name in names and (i % 2 == 1 or call.function.name == f"tool_{i}")
            jsonschema.validate(arguments(call.function.arguments), schema_of(declared, call.function.name))


def _bad(client: OpenAI, **body: Any) -> dict[str, Any]:
    with pytest.raises(BadRequestError) as e:
        client.chat.completions.create(model="tiny", max_tokens=4, **body)
    return e.value.body  # type: ignore[return-value]


def test_bad_tool_input_names_the_field(served: tuple[str, OpenAI]) -> None:
    _, client = served
    user = [{"role": "user", "content": "hi"}]
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    assert _bad(client, messages=user, tools=[bad_schema])["param"] == "tools.0.function.parameters"
    bad_type = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}
    assert _bad(client, messages=user, tools=[WEATHER, bad_type])["param"] == "tools.1.function.parameters"
    err = _bad(client, messages=user, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err["param"] == "tool_choice.function.name" and "nope" in err["message"]
    orphan = [*user, {"role": "assistant", "content": "ok"},
              {"role": "tool", "tool_call_id": "call_missing", "content": "42"}]
    err = _bad(client, messages=orphan, tools=TOOLS)
    assert err["param"] == "messages.2.tool_call_id" and "call_missing" in err["message"]
    assert _bad(client, messages=user, tools=[{"type": "function", "function": {"name": "bad name"}}])["param"] == \
        "tools.0.function.name"
    assert _bad(client, messages=user, tool_choice="required")["param"] == "tool_choice"
    # 128 tools of 2000 patterned properties each: refused by size before any schema is checked
    # (checking them against the metaschema took 51 s of the event loop)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{1,9}"} for i in range(2000)}}
    err = _bad(client, messages=user, tool_choice="required",
               tools=[{"type": "function", "function": {"name": f"f{k}", "parameters": wide}} for k in range(128)])
    assert err["param"] == "tools" and "bytes of JSON" in err["message"]
    err = _bad(client, messages=user, tools=TOOLS, response_format={"type": "json_object"})
    assert err["param"] == "response_format"
    # nothing leaked: the server still answers
    assert client.chat.completions.create(model="tiny", messages=user, max_tokens=2).choices[0].finish_reason


@pytest.mark.parametrize("served", ["hermes"], indirect=True)
def test_tool_results_as_plus_segments_are_reused(served: tuple[str, OpenAI]) -> None:
    """A document a tool returned, sent as a plus segment, is computed once: another agent whose
    conversation differs reads it again at a new position and reuses its KV."""
    _, client = served
    doc = "Report: " + " ".join(f"item {i} costs {i * 7 % 13} coins;" for i in range(40))

    def turn(question: str, call_id: str, kind: str | None) -> Any:
        tool_msg: dict[str, Any] = {"role": "tool", "tool_call_id": call_id, "content": doc}
        if kind:
            tool_msg["kind"] = kind
        calls = [{"id": call_id, "type": "function",
                  "function": {"name": "search_docs", "arguments": json.dumps({"query": question[:10], "top_k": 1})}}]
        msgs = [{"role": "user", "content": question}, {"role": "assistant", "content": None, "tool_calls": calls},
                tool_msg]
        return client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="none",
                                              max_tokens=2, seed=0).usage

    first = turn("What does item 3 cost, please tell me?", "call_a", "plus")
    again = turn("Which item is the cheapest?", "call_b", "plus")
    reuse = again.prompt_tokens_details.reuse
    assert first.prompt_tokens_details.reuse["segment"] == 0
    assert reuse["segment"] >= len(load_tokenizer("smollm2").encode(doc)), reuse
    plain = turn("Which item is the dearest one?", "call_c", None).prompt_tokens_details.reuse
    assert plain["segment"] == 0  # a plain tool message is only ever a prefix hit


def test_tools_without_a_parser_are_refused(model: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(str(model), num_blocks=64, block_size=16)
    with caplog.at_level(logging.INFO, logger="spanserve.server.context"):
        app = create_app(engine, ServerConfig(served_model_name="tiny", model_source=str(model)))
    with TestClient(app, raise_server_exceptions=False) as http:
        assert "tool calling: off" in caplog.text  # SmolLM2's own template renders no tools
        client = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        user = [{"role": "user", "content": "hi"}]
        err = _bad(client, messages=user, tools=TOOLS)
        assert err["param"] == "tools" and "--tool-call-parser" in err["message"]
        ok = client.chat.completions.create(model="tiny", messages=user, tools=TOOLS, tool_choice="none", max_tokens=2)
        assert ok.choices[0].message.tool_calls is None
