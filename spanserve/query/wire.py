"""spnl's JSON wire format for span queries, so spnl clients can send us their queries.

spnl (IBM/spnl, Rust) serialises its ``Query`` enum with serde's default *externally
tagged* representation: every node is an object with exactly one key naming the
operator. The facts this module follows:

* messages are ``{"user": s}``, ``{"system": s}``, ``{"assistant": s}``;
* ``{"cross": [q...]}``, ``{"plus": [q...]}``, ``{"seq": [q...]}``, ``{"par": [q...]}``;
* ``{"g": {"model": s, "input": q, "max_tokens": i, "temperature": f}}`` with the
  last two optional and omitted when unset (``model`` and ``input`` are required);
* ``{"repeat": {"n": i, "query": q}}``;
* with spnl's "rag" feature, ``{"augment": {"embedding_model": s, "body": q,
  "doc": [name, {"Text": s}]}}`` (earlier spnl called it ``retrieve``);
* ``serde_json::to_string`` writes compact JSON in field-declaration order, floats
  always with a fraction ("0.0"), and non-ASCII text unescaped; ``dumps`` does too.

Extensions (spnl has no equivalent): ``policy`` on ``g``; ``{"chat": {...}}``;
``{"fragment": {"text": s, "source": s, "index": i}}``; ``docs`` (several
documents) and ``k`` on ``augment``. A bare JSON array, which spnl's documentation
uses for a list of messages, is read as ``seq`` (what spnl builds from a list).
Client-side spnl operators (``ask``, ``file``, ``print``...) are refused with a reason.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .ir import (Assistant, Chat, Cross, Document, Fragment, Generate, Group, Message, Node, Par,
                 Plus, Repeat, Retrieve, Seq, System, User)

MAX_DEPTH = 128
MAX_REPEAT = 100_000

_GROUP_KEYS: dict[type[Group], str] = {Cross: "cross", Plus: "plus", Seq: "seq", Par: "par"}
_MESSAGE_KEYS: dict[type[Message], str] = {System: "system", User: "user", Assistant: "assistant"}

# Known spnl operators that only make sense on the client (or that we do not run),
# named so their users get a reason rather than a bare "unknown operator".
_CLIENT_SIDE = {
    "ask": "it prompts on the client's terminal; send the answer as a user message",
    "file": "it reads a client-side file; send the text instead",
    "read": "it reads a client-side file; send the text instead",
    "print": "it prints on the client's console",
    "monad": "evaluating a query only for its side effects is not supported",
    "zip": "message interleaving is not supported",
}


class QueryError(ValueError):
    """A malformed query; ``path`` is the JSON path of the offending node."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.reason = message


Body = Any
Parser = Callable[[Body, str, int], Node]


# --- reading --------------------------------------------------------------------


class _Duplicated(dict):
    """A JSON object that repeated a key; serde refuses those, so do we."""

    duplicates: tuple[str, ...] = ()


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    seen: list[str] = []
    for key, value in pairs:
        if key in out:
            seen.append(key)
        out[key] = value
    if not seen:
        return out
    dup = _Duplicated(out)
    dup.duplicates = tuple(seen)
    return dup


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _object(body: Body, path: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise QueryError(path, f"expected an object, got {_kind(body)}")
    if isinstance(body, _Duplicated):
        raise QueryError(path, f"duplicate key {body.duplicates[0]!r}")
    return body


def _fields(body: Body, path: str, required: tuple[str, ...], optional: tuple[str, ...]) -> dict[str, Any]:
    obj = _object(body, path)
    allowed = required + optional
    for key in obj:
        if key not in allowed:
            raise QueryError(path, f"unknown field {key!r}; expected fields: {', '.join(allowed)}")
    for key in required:
        if key not in obj:
            raise QueryError(path, f"missing field {key!r}")
    return obj


def _string(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise QueryError(path, f"expected a string, got {_kind(value)}")
    return value


def _int(value: Any, path: str, minimum: int, maximum: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise QueryError(path, f"expected an integer, got {_kind(value)}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise QueryError(path, f"expected an integer {bound}, got {value}")
    return value


def _opt(obj: dict[str, Any], key: str, path: str, read: Callable[[Any, str], Any]) -> Any:
    value = obj.get(key)
    return None if value is None else read(value, f"{path}.{key}")


def _number(value: Any, path: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise QueryError(path, f"expected a number, got {_kind(value)}")
    return float(value)


def _array(body: Body, path: str) -> list[Any]:
    if not isinstance(body, list):
        raise QueryError(path, f"expected an array of queries, got {_kind(body)}")
    return body


def _node(obj: Any, path: str, depth: int) -> Node:
    if depth > MAX_DEPTH:
        raise QueryError(path, f"query nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, list):
        return Seq(tuple(_node(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(obj)))
    if not isinstance(obj, dict):
        raise QueryError(path, f"expected a query object such as {{\"user\": \"...\"}}, got {_kind(obj)}")
    obj = _object(obj, path)
    if len(obj) != 1:
        keys = ", ".join(repr(k) for k in obj) or "none"
        raise QueryError(path, f"a query object needs exactly one operator key, got {len(obj)} ({keys}); "
                               f"supported operators: {', '.join(OPERATORS)}")
    ((key, body),) = obj.items()
    parser = _PARSERS.get(key)
    if parser is None:
        why = f" ({_CLIENT_SIDE[key]})" if key in _CLIENT_SIDE else ""
        raise QueryError(path, f"unknown operator {key!r}{why}; supported operators: {', '.join(OPERATORS)}")
    return parser(body, f"{path}.{key}", depth + 1)


def _message(cls: type[Message]) -> Parser:
    def parse(body: Body, path: str, depth: int) -> Node:
        return cls(_string(body, path))
    return parse


def _group(cls: type[Group]) -> Parser:
    def parse(body: Body, path: str, depth: int) -> Node:
        return cls(tuple(_node(x, f"{path}[{i}]", depth) for i, x in enumerate(_array(body, path))))
    return parse


def _sampling(obj: dict[str, Any], path: str) -> dict[str, Any]:
    return {
        "max_tokens": _opt(obj, "max_tokens", path, lambda v, p: _int(v, p, 0)),
        "temperature": _opt(obj, "temperature", path, _number),
        "policy": _opt(obj, "policy", path, _string),
    }


def _generate(body: Body, path: str, depth: int) -> Node:
    obj = _fields(body, path, ("model", "input"), ("max_tokens", "temperature", "policy"))
    return Generate(_string(obj["model"], f"{path}.model"), _node(obj["input"], f"{path}.input", depth),
                    **_sampling(obj, path))


def _repeat(body: Body, path: str, depth: int) -> Node:
    obj = _fields(body, path, ("n", "query"), ())
    return Repeat(_int(obj["n"], f"{path}.n", 0, MAX_REPEAT), _node(obj["query"], f"{path}.query", depth))


def _chat(body: Body, path: str, depth: int) -> Node:
    obj = _fields(body, path, ("model", "messages"), ("max_tokens", "temperature", "policy"))
    mpath = f"{path}.messages"
    messages = tuple(_node(x, f"{mpath}[{i}]", depth) for i, x in enumerate(_array(obj["messages"], mpath)))
    return Chat(messages, _string(obj["model"], f"{path}.model"), **_sampling(obj, path))


def _fragment(body: Body, path: str, depth: int) -> Node:
    obj = _fields(body, path, ("text",), ("source", "index"))
    source = _opt(obj, "source", path, _string)
    return Fragment(_string(obj["text"], f"{path}.text"), source or "",
                    _opt(obj, "index", path, lambda v, p: _int(v, p, 0)))


def _document(value: Any, path: str) -> Document:
    if not (isinstance(value, list) and len(value) == 2):
        raise QueryError(path, f'expected a [name, {{"Text": "..."}}] pair, got {_kind(value)}')
    name = _string(value[0], f"{path}[0]")
    content = _object(value[1], f"{path}[1]")
    if set(content) == {"Binary"}:
        raise QueryError(f"{path}[1].Binary", "binary documents are not supported; send their text as "
                                              '{"Text": "..."}')
    if set(content) != {"Text"}:
        raise QueryError(f"{path}[1]", f'expected {{"Text": "..."}}, got keys {sorted(content)}')
    return Document(name, _string(content["Text"], f"{path}[1].Text"))


def _augment(body: Body, path: str, depth: int) -> Node:
    obj = _fields(body, path, ("body",), ("embedding_model", "doc", "docs", "k"))
    if ("doc" in obj) == ("docs" in obj):
        raise QueryError(path, "expected exactly one of 'doc' (one document) or 'docs' (a list of them)")
    if "doc" in obj:
        corpus = (_document(obj["doc"], f"{path}.doc"),)
    else:
        docs = obj["docs"]
        if not isinstance(docs, list):
            raise QueryError(f"{path}.docs", f"expected an array of documents, got {_kind(docs)}")
        corpus = tuple(_document(d, f"{path}.docs[{i}]") for i, d in enumerate(docs))
    return Retrieve(corpus, _node(obj["body"], f"{path}.body", depth),
                    _opt(obj, "k", path, lambda v, p: _int(v, p, 1)),
                    _opt(obj, "embedding_model", path, _string) or "")


_PARSERS: dict[str, Parser] = {
    "system": _message(System),
    "user": _message(User),
    "assistant": _message(Assistant),
    "fragment": _fragment,
    "cross": _group(Cross),
    "plus": _group(Plus),
    "seq": _group(Seq),
    "par": _group(Par),
    "g": _generate,
    "repeat": _repeat,
    "chat": _chat,
    "augment": _augment,
    "retrieve": _augment,
}

OPERATORS: tuple[str, ...] = tuple(sorted(_PARSERS))


def parse(source: str | bytes | bytearray | dict[str, Any] | list[Any]) -> Node:
    """Parse a span query from JSON text or from an already-decoded JSON value."""
    if isinstance(source, (str, bytes, bytearray)):
        try:
            source = json.loads(source, object_pairs_hook=_pairs)
        except json.JSONDecodeError as e:
            raise QueryError("$", f"invalid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
        except RecursionError:
            raise QueryError("$", f"query nested deeper than {MAX_DEPTH} levels") from None
    return _node(source, "$", 0)


# --- writing --------------------------------------------------------------------


def _sampling_obj(node: Generate | Chat) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("max_tokens", "temperature", "policy"):
        value = getattr(node, key)
        if value is not None:
            out[key] = value
    return out


def _document_obj(doc: Document) -> list[Any]:
    return [doc.name, {"Text": doc.text}]


def to_obj(node: Node) -> dict[str, Any]:
    """The JSON value spnl would write for ``node`` (extensions only when used)."""
    if isinstance(node, Fragment):
        body: dict[str, Any] = {"text": node.text}
        if node.source:
            body["source"] = node.source
        if node.index is not None:
            body["index"] = node.index
        return {"fragment": body}
    if isinstance(node, Message):
        return {_MESSAGE_KEYS[type(node)]: node.text}
    if isinstance(node, Group):
        return {_GROUP_KEYS[type(node)]: [to_obj(c) for c in node.children]}
    if isinstance(node, Generate):
        return {"g": {"model": node.model, "input": to_obj(node.input), **_sampling_obj(node)}}
    if isinstance(node, Repeat):
        return {"repeat": {"n": node.n, "query": to_obj(node.query)}}
    if isinstance(node, Chat):
        return {"chat": {"model": node.model, "messages": [to_obj(m) for m in node.messages],
                         **_sampling_obj(node)}}
    if isinstance(node, Retrieve):
        body = {"embedding_model": node.embedding_model} if node.embedding_model else {}
        body["body"] = to_obj(node.question)
        if len(node.corpus) == 1:
            body["doc"] = _document_obj(node.corpus[0])
        else:
            body["docs"] = [_document_obj(d) for d in node.corpus]
        if node.k is not None:
            body["k"] = node.k
        return {"augment": body}
    raise TypeError(f"cannot serialise {type(node).__name__}")


def dumps(node: Node, *, indent: int | None = None) -> str:
    """JSON text for ``node``; compact (as serde_json writes it) unless ``indent`` is given."""
    separators = (",", ":") if indent is None else (",", ": ")
    return json.dumps(to_obj(node), ensure_ascii=False, indent=indent, separators=separators)
