"""The gateway's route keys are the keys the replica's engine will cache the request under."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from spanserve.cluster import routing
from spanserve.cluster.keys import KeyMaker, load_tokenizer
from spanserve.engine.engine import LLMEngine
from spanserve.engine.layout import Segment
from engine_helpers import make_engine
from tiny_models import make_tiny_model

BS = 8


@pytest.fixture(scope="module")
def engine_and_keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[LLMEngine, KeyMaker]:
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("keys"))
    engine = make_engine(model=str(path), block_size=BS, num_blocks=64)
    return engine, KeyMaker(load_tokenizer(str(path)), BS)


def _engine_keys(engine: LLMEngine, body: dict) -> list[routing.RouteKey]:
    """What a replica does with the body: tokenize each segment, resolve the layout, admit it."""
    segs = [Segment(token_ids=engine.encode(s["text"]), kind=s.get("kind", "cross"), anchor=s.get("anchor", "none"))
            for s in body["segments"]]
    req = engine.add_request(segs, namespace=body.get("cache_salt") or "", policy=body.get("policy"))
    engine.step()  # admitted: its units carry the cache's own keys
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
