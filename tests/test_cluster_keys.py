"""The gateway's route keys are the keys the replica's engine will cache the request under."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from spanserve.cluster import routing
from spanserve.cluster.keys import KeyMaker
from spanserve.engine.engine import LLMEngine
from spanserve.engine.layout import Segment
from spanserve.model.loader import load_tokenizer
from engine_helpers import make_engine
from tiny_models import make_tiny_model

BS = 8


@pytest.fixture(scope="module")
def engine_and_keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLMEngine, KeyMaker]:
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("keys"))
    engine = make_engine(model=str(path), block_size=BS, num_blocks=64)
    return engine, KeyMaker(load_tokenizer(str(path)), BS)


def _engine_keys(engine: LLMEngine, body: dict, segs: list[Segment] | None = None) -> list[routing.RouteKey]:
    """What a replica does with the body: tokenize each segment, resolve the layout, admit it."""
    if segs is None:
        segs = [Segment(token_ids=engine.encode(s["text"]), kind=s.get("kind", "cross"),
                        anchor=s.get("anchor", "none")) for s in body["segments"]]
    req = engine.add_request(segs, namespace=body.get("cache_salt") or "", policy=body.get("policy"))
    for _ in range(100):  # admitted (a step may pass first, when admission waits on timing): its units
        engine.step()     # carry the cache's own keys
        if req.units:
            break
    plus = [routing.RouteKey(u.keys[-1] if u.tail_key is None else u.tail_key, len(u.tokens))
            for u in req.units if u.plus]
    engine.abort(req.request_id)
    lead = req.pieces[0].tokens if req.pieces[0].kind == "cross" else ()
    return plus + ([routing.prefix_key(lead, body.get("cache_salt") or "", BS)] if lead else [])


@pytest.mark.parametrize("extra", [{}, {"cache_salt": "tenant-a"}])
def test_segment_keys_match_the_engines_cache_units(engine_and_keys: tuple[LLMEngine, KeyMaker],
                                                    extra: dict) -> None:
    engine, km = engine_and_keys
    body = {"segments": [{"text": "the system ."}, {"text": "the cat sat on the mat", "kind": "plus"},
                         {"text": "a dog ran", "kind": "plus", "anchor": "prefix"}, {"text": "who sat ?"}], **extra}
    got = km.keys("/v1/completions", json.dumps(body).encode())
    assert len(got) == 3
    assert got == _engine_keys(engine, body)


def test_full_policy_and_plain_prompts_route_by_their_prefix(engine_and_keys: tuple[LLMEngine, KeyMaker]) -> None:
    engine, km = engine_and_keys
    segs = [{"text": "the cat sat on the mat", "kind": "plus"}, {"text": "who sat ?"}]
    full = km.keys("/v1/completions", json.dumps({"segments": segs, "policy": "full"}).encode())
    whole = engine.encode("the cat sat on the mat") + engine.encode("who sat ?")
    assert full == [routing.prefix_key(whole, "", BS)]
    plain = km.keys("/v1/completions", json.dumps({"prompt": "hello world , the cat"}).encode())
    assert plain == [routing.prefix_key(engine.encode("hello world , the cat"), "", BS)]


def test_unreadable_requests_get_no_keys(engine_and_keys: tuple[LLMEngine, KeyMaker]) -> None:
    _, km = engine_and_keys
    assert km.keys("/v1/completions", b"{not json") == []
    assert km.keys("/v1/completions", b'{"segments": [{"kind": "plus"}]}') == []
    assert km.keys("/v1/query/execute", b'{"g": {}}') == []
    assert km.keys("/v1/chat/completions", b'{"messages": [{"role": "nobody"}]}') == []


def _query(docs: list[str]) -> bytes:
    return json.dumps({"g": {"model": "tiny", "max_tokens": 2, "temperature": 0, "input": {"cross": [
        {"system": "answer ."}, {"plus": [{"user": d} for d in docs]}, {"user": "who sat ?"}]}}}).encode()


def test_span_query_keys_are_where_its_documents_are_cached(engine_and_keys: tuple[LLMEngine, KeyMaker]) -> None:
    from spanserve.query.execute import EngineRunner, Executor
    from spanserve.query.wire import parse

    engine, km = engine_and_keys
    docs = ["the cat sat on the mat .", "a dog ran on the world !"]
    keys = km.keys("/v1/query/execute", _query(docs))
    assert len(keys) == 2
    assert {k.key for k in km.keys("/v1/query/execute", _query(docs[::-1]))} == {k.key for k in keys}
    assert not {k.key for k in keys} & {k.key for k in km.keys("/v1/query/execute", _query(docs), "cache_salt=x")}
    Executor(EngineRunner(engine), engine.tokenizer).execute(parse(_query(docs)))
    for k in keys:  # the engine cached each document's unit under exactly this key
        held = [b for b in engine.pool.blocks if b.key == k.key]
        assert len(held) == 1 and len(held[0].tokens) == (k.tokens - 1) % BS + 1


def test_chat_keys_render_the_tools_as_the_replica_does(engine_and_keys: tuple[LLMEngine, KeyMaker]) -> None:
    """A chat with tools and a tool result sent as a plus segment, under a template the replicas
    were given (--chat-template): the router's keys are the ones the replica caches under."""
    import copy

    from spanserve.query.plan import Planner
    from spanserve.server.protocol import ChatMessage
    from spanserve.server.span import chat_query
    from spanserve.toolcall.spec import parse_tools

    engine, _ = engine_and_keys
    template = ("{% if tools %}{% for t in tools %}{{ t.function.name }} ;{% endfor %}\n{% endif %}"
                "{% for m in messages %}{{ m.role }} : {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant :{% endif %}")
    km = KeyMaker(copy.deepcopy(engine.tokenizer), BS, chat_template=template)
    tools = [{"type": "function", "function": {"name": "find", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "find", "arguments": '{"q": "cat"}'}}
    body = {"tools": tools, "messages": [
        {"role": "system", "content": "answer ."}, {"role": "user", "content": "who sat ?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "the cat sat on the mat .", "kind": "plus"}]}
    got = km.keys("/v1/chat/completions", json.dumps(body).encode())
    tok = copy.deepcopy(engine.tokenizer)
    tok.chat_template = template
    messages = [ChatMessage.model_validate(m) for m in body["messages"]]
    segs = Planner(tok, tools=[t.as_template_dict() for t in parse_tools(tools)]).layout(chat_query(messages))
    assert len(got) == 2 and got == _engine_keys(engine, body, list(segs))
    bare = km.keys("/v1/chat/completions", json.dumps({"messages": body["messages"]}).encode())
    assert bare[0] == got[0] and bare[1] != got[1]  # the same tool result; a prefix without the tools
