import json
from pathlib import Path

import pytest

from spanserve.query import ir
from spanserve.query.ir import (Chat, Cross, Document, Fragment, Generate, Plus, Repeat, Retrieve,
                                Seq, System, User)
from spanserve.query.wire import MAX_DEPTH, OPERATORS, QueryError, dumps, parse, to_obj

EXAMPLES = Path(__file__).parent / "data" / "spnl_examples"
SUPPORTED = sorted(p for p in EXAMPLES.glob("*.json") if not p.name.endswith(".canonical.json"))
UNSUPPORTED = sorted((EXAMPLES / "unsupported").glob("*.json"))


def test_examples_were_collected():
    assert len(SUPPORTED) >= 10 and len(UNSUPPORTED) >= 2


@pytest.mark.parametrize("path", SUPPORTED, ids=lambda p: p.stem)
def test_spnl_example_round_trips(path):
    text = path.read_text()
    node = parse(text)
    assert parse(dumps(node)) == node
    canonical = path.with_name(path.stem + ".canonical.json")
    expected = json.loads(canonical.read_text() if canonical.exists() else text)
    assert to_obj(node) == expected
    assert json.loads(dumps(node)) == expected
    assert parse(json.loads(text)) == node  # decoded values parse like text


@pytest.mark.parametrize("path", UNSUPPORTED, ids=lambda p: p.stem)
def test_unsupported_spnl_example_is_refused_with_reason(path):
    with pytest.raises(QueryError) as err:
        parse(path.read_text())
    assert "unknown operator 'ask'" in str(err.value)
    assert "client's terminal" in str(err.value)
    assert "supported operators: " + ", ".join(OPERATORS) in str(err.value)


def test_ask_inside_generate_names_its_path():
    with pytest.raises(QueryError) as err:
        parse((EXAMPLES / "unsupported" / "about_ask_file.json").read_text())
    assert err.value.path == "$.g.input.cross[0]"


def test_judge_example_structure():
    node = parse((EXAMPLES / "about_judge_emails.json").read_text())
    inner = ir.g("Generate a fun email", model="ollama/granite3.2:2b", max_tokens=1000, temperature=0.3)
    assert node == ir.g(
        ir.cross(ir.system("You judge emails by scoring them"), ir.plus(ir.repeat(4, inner)),
                 "I am looking for a job at NASA"),
        model="ollama/granite3.2:2b",
    )


def test_dumps_is_compact_like_serde():
    node = parse('{"g": {"model": "m", "input": {"user": "héllo"}, "temperature": 0}}')
    assert dumps(node) == '{"g":{"model":"m","input":{"user":"héllo"},"temperature":0.0}}'
    assert json.loads(dumps(node, indent=2)) == json.loads(dumps(node))


def test_optional_fields_omitted_and_null_accepted():
    node = parse('{"g": {"model": "m", "input": {"user": "x"}, "max_tokens": null}}')
    assert node == Generate("m", User("x"))
    assert to_obj(node) == {"g": {"model": "m", "input": {"user": "x"}}}


EXTENSIONS = [
    {"g": {"model": "m", "input": {"assistant": "a"}, "max_tokens": 5, "temperature": 0.5, "policy": "p"}},
    {"chat": {"model": "m", "messages": [{"system": "s"}, {"user": "u"}], "max_tokens": 3}},
    {"fragment": {"text": "t", "source": "a.txt", "index": 2}},
    {"fragment": {"text": "t"}},
    {"par": [{"seq": []}, {"repeat": {"n": 0, "query": {"user": "u"}}}]},
    {"augment": {"embedding_model": "e", "body": {"user": "q"}, "doc": ["a.txt", {"Text": "hello"}]}},
    {"augment": {"body": {"user": "q"}, "docs": [["a", {"Text": "x"}], ["b", {"Text": "y"}]], "k": 2}},
]


@pytest.mark.parametrize("obj", EXTENSIONS, ids=lambda o: next(iter(o)))
def test_extensions_round_trip(obj):
    node = parse(obj)
    assert to_obj(node) == obj
    assert parse(dumps(node)) == node


def test_spnl_augment_shape_and_older_retrieve_key():
    body = {"embedding_model": "ollama/mxbai-embed-large:335m", "body": {"user": "Hello"},
            "doc": ["path/to/doc.txt", {"Text": "I know all about Hello and stuff"}]}
    expected = Retrieve((Document("path/to/doc.txt", "I know all about Hello and stuff"),), User("Hello"),
                        None, "ollama/mxbai-embed-large:335m")
    assert parse({"augment": body}) == expected
    assert parse({"retrieve": body}) == expected
    assert to_obj(expected) == {"augment": body}


def test_unknown_operator_lists_supported_ones():
    with pytest.raises(QueryError) as err:
        parse('{"g": {"model": "m", "input": {"cross": [{"user": "a"}, {"plus": [{"usr": "b"}]}]}}}')
    e = err.value
    assert isinstance(e, ValueError)
    assert e.path == "$.g.input.cross[1].plus[0]"
    assert str(e).startswith("$.g.input.cross[1].plus[0]: unknown operator 'usr'")
    for op in ("assistant", "augment", "chat", "cross", "fragment", "g", "par", "plus", "repeat",
               "seq", "system", "user"):
        assert op in e.reason


MALFORMED = [
    ('{"g": {"model": "m", "input": {"cross": [{"user": "a"}, {"plus": [{"user": 3}]}]}}}',
     "$.g.input.cross[1].plus[0].user", "expected a string, got a number"),
    ('{"g": {"input": {"user": "a"}}}', "$.g", "missing field 'model'"),
    ('{"g": {"model": "m"}}', "$.g", "missing field 'input'"),
    ('{"g": {"model": 7, "input": {"user": "a"}}}', "$.g.model", "expected a string"),
    ('{"g": {"model": "m", "input": {"user": "a"}, "max_token": 5}}', "$.g", "unknown field 'max_token'"),
    ('{"g": {"model": "m", "input": {"user": "a"}, "max_tokens": -1}}', "$.g.max_tokens", ">= 0"),
    ('{"g": {"model": "m", "input": {"user": "a"}, "max_tokens": 1.5}}', "$.g.max_tokens", "integer"),
    ('{"g": {"model": "m", "input": {"user": "a"}, "temperature": "hot"}}', "$.g.temperature", "number"),
    ('{"g": {"model": "m", "input": {"user": "a"}, "temperature": true}}', "$.g.temperature", "boolean"),
    ('{"g": {"model": "m", "input": 5}}', "$.g.input", "expected a query object"),
    ('{"g": ["m", {"user": "a"}]}', "$.g", "expected an object, got an array"),
    ('{"cross": {"user": "a"}}', "$.cross", "expected an array of queries, got an object"),
    ('{"plus": [{}]}', "$.plus[0]", "exactly one operator key, got 0"),
    ('{"plus": [{"user": "a", "system": "b"}]}', "$.plus[0]", "exactly one operator key, got 2"),
    ('{"seq": [{"user": "a", "user": "b"}]}', "$.seq[0]", "duplicate key 'user'"),
    ('{"repeat": {"n": -2, "query": {"user": "a"}}}', "$.repeat.n", "between 0 and"),
    ('{"repeat": {"n": 3}}', "$.repeat", "missing field 'query'"),
    ('{"repeat": {"n": 3, "query": {"user": "a"}, "generate": {}}}', "$.repeat", "unknown field 'generate'"),
    ('{"chat": {"model": "m", "messages": {"user": "a"}}}', "$.chat.messages", "array"),
    ('{"fragment": {"text": "t", "index": "1"}}', "$.fragment.index", "integer"),
    ('{"augment": {"body": {"user": "q"}}}', "$.augment", "exactly one of 'doc'"),
    ('{"augment": {"body": {"user": "q"}, "doc": ["a", {"Binary": [1, 2]}]}}',
     "$.augment.doc[1].Binary", "binary documents are not supported"),
    ('{"augment": {"body": {"user": "q"}, "doc": ["a"]}}', "$.augment.doc", "pair"),
    ('{"augment": {"body": {"user": "q"}, "docs": [["a", {"Text": 1}]]}}', "$.augment.docs[0][1].Text",
     "expected a string"),
    ('{"augment": {"body": {"user": "q"}, "doc": ["a", {"Text": "x"}], "k": 0}}', "$.augment.k", ">= 1"),
    ('"hello"', "$", "got a string"),
    ('{"g": {"model": "m", "input": {"user": "a"}', "$", "invalid JSON"),
]


@pytest.mark.parametrize("text,path,fragment", MALFORMED)
def test_malformed_body_names_its_path(text, path, fragment):
    with pytest.raises(QueryError) as err:
        parse(text)
    assert err.value.path == path
    assert str(err.value).startswith(path + ": ")
    assert fragment in err.value.reason


def test_deep_nesting_is_refused_not_crashing():
    text = '{"plus": [' * (MAX_DEPTH + 5) + '{"user": "x"}' + "]}" * (MAX_DEPTH + 5)
    with pytest.raises(QueryError, match="nested deeper"):
        parse(text)


def test_bare_array_is_seq_shorthand():
    assert parse('[{"user": "a"}, {"system": "b"}]') == Seq((User("a"), System("b")))


def test_builders_serialise_to_the_same_json():
    q = ir.g(ir.cross(ir.system("s"), ir.plus(ir.fragment("f", "d", 0), ir.repeat(2, ir.g("u", model="m"))),
                      ir.chat("c", model="m", temperature=1)), model="m", policy="judge")
    assert parse(dumps(q)) == q
    assert isinstance(parse(dumps(q)).input.children[2], Chat)
    assert q.input.children[1] == Plus((Fragment("f", "d", 0), Repeat(2, Generate("m", User("u")))))
    assert Cross((User("a"),)) == parse('{"cross": [{"user": "a"}]}')
