"""Span-query IR: an immutable expression tree describing one or more LLM calls.

Leaves are messages. ``Generate`` ("g") asks a model to continue the messages of its
input. ``Cross`` orders its children (their tokens attend to each other); ``Plus``
marks children whose order does not matter and that need not attend to each other,
which is what lets the engine reuse their KV cache wherever they appear. ``Seq`` and
``Par`` sequence or parallelise independent work; ``Repeat(n, q)`` is n independent
evaluations of ``q``.

``Chat``, ``Retrieve`` and ``Fragment`` are sugar that ``optimize`` removes or
resolves: a chat is a ``g`` over a cross of its messages, a retrieve is a plus of the
fragments a retriever picks from a corpus for a question.

Equal subtrees are *not* shared computations: two equal ``Generate`` nodes sample twice,
exactly like ``Repeat(2, g)``. The one exception is a conversation (see
``spanserve.query.reach.conversation_of``).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import ClassVar, Union


@dataclass(frozen=True)
class Node:
    """Base class of every query node."""


def _require(ok: bool, message: str, error: type[Exception] = TypeError) -> None:
    # Plain TypeError/ValueError for nodes built wrongly in Python; the wire layer
    # reports its own path-carrying errors before it ever constructs a node.
    if not ok:
        raise error(message)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _as_nodes(owner: str, items: Iterable[object]) -> tuple[Node, ...]:
    out = tuple(items)
    for i, item in enumerate(out):
        _require(isinstance(item, Node), f"{owner}[{i}] must be a Node, got {type(item).__name__}")
    return out


def _check_sampling(owner: str, max_tokens: object, temperature: object, policy: object) -> None:
    _require(max_tokens is None or _is_int(max_tokens), f"{owner}.max_tokens must be an int or None")
    _require(max_tokens is None or max_tokens >= 0, f"{owner}.max_tokens must be >= 0", ValueError)
    _require(
        temperature is None or (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)),
        f"{owner}.temperature must be a number or None",
    )
    _require(policy is None or isinstance(policy, str), f"{owner}.policy must be a str or None")


def _float_temperature(node: Generate | Chat) -> None:
    # spnl stores temperature as f32 and always writes it with a fraction ("0.0"), so
    # an int from Python would otherwise serialise differently from the same query
    # parsed off the wire.
    if isinstance(node.temperature, int):
        object.__setattr__(node, "temperature", float(node.temperature))


# --- messages -------------------------------------------------------------------


@dataclass(frozen=True)
class Message(Node):
    """A leaf: text with a chat role."""

    text: str
    role: ClassVar[str] = ""

    def __post_init__(self) -> None:
        _require(isinstance(self.text, str), f"{type(self).__name__}.text must be a str")


@dataclass(frozen=True)
class System(Message):
    role: ClassVar[str] = "system"


@dataclass(frozen=True)
class User(Message):
    role: ClassVar[str] = "user"


@dataclass(frozen=True)
class Assistant(Message):
    role: ClassVar[str] = "assistant"


@dataclass(frozen=True)
class Fragment(Message):
    """A piece of a document, sent with the user role.

    It is kept apart from ``User`` so the planner knows the text came from a corpus
    (``source`` names the document, ``index`` the chunk within it) and is therefore
    likely to recur across requests.
    """

    source: str = ""
    index: int | None = None
    role: ClassVar[str] = "user"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(isinstance(self.source, str), "Fragment.source must be a str")
        _require(self.index is None or _is_int(self.index), "Fragment.index must be an int or None")


# --- operators ------------------------------------------------------------------


@dataclass(frozen=True)
class Generate(Node):
    """``g``: ask ``model`` to continue the messages that ``input`` evaluates to."""

    model: str
    input: Node
    max_tokens: int | None = None
    temperature: float | None = None
    policy: str | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.model, str), "Generate.model must be a str")
        _require(isinstance(self.input, Node), "Generate.input must be a Node")
        _check_sampling("Generate", self.max_tokens, self.temperature, self.policy)
        _float_temperature(self)


@dataclass(frozen=True)
class Group(Node):
    """Base of the n-ary operators; ``children`` is always a tuple."""

    children: tuple[Node, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "children", _as_nodes(type(self).__name__, self.children))


@dataclass(frozen=True)
class Cross(Group):
    """Ordered, mutually attending children (a conversation)."""


@dataclass(frozen=True)
class Plus(Group):
    """Children whose order does not matter and that need not attend to each other."""


@dataclass(frozen=True)
class Seq(Group):
    """Evaluate children one after another."""


@dataclass(frozen=True)
class Par(Group):
    """Evaluate children concurrently."""


@dataclass(frozen=True)
class Repeat(Node):
    """``n`` independent evaluations of ``query`` (n samples when it generates)."""

    n: int
    query: Node

    def __post_init__(self) -> None:
        _require(_is_int(self.n), "Repeat.n must be an int")
        _require(self.n >= 0, "Repeat.n must be >= 0", ValueError)
        _require(isinstance(self.query, Node), "Repeat.query must be a Node")


# --- sugar ----------------------------------------------------------------------


@dataclass(frozen=True)
class Chat(Node):
    """Sugar for ``Generate(model, Cross(messages), ...)``."""

    messages: tuple[Node, ...]
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    policy: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", _as_nodes("Chat.messages", self.messages))
        _require(isinstance(self.model, str), "Chat.model must be a str")
        _check_sampling("Chat", self.max_tokens, self.temperature, self.policy)
        _float_temperature(self)


@dataclass(frozen=True)
class Document:
    """A named text in a retrieval corpus (not a node: it is never sent as-is)."""

    name: str
    text: str

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and isinstance(self.text, str),
                 "Document name and text must be str")


@dataclass(frozen=True)
class Retrieve(Node):
    """Sugar for a plus of the fragments of ``corpus`` most relevant to ``question``.

    ``question`` is a node (as in spnl, whose field is ``body``); its message texts
    form the retrieval query. ``k`` caps the fragments (None: the retriever's
    default). ``embedding_model`` is carried for spnl compatibility; the built-in
    lexical retriever ignores it.
    """

    corpus: tuple[Document, ...]
    question: Node
    k: int | None = None
    embedding_model: str = ""

    def __post_init__(self) -> None:
        docs = tuple(self.corpus)
        _require(all(isinstance(d, Document) for d in docs), "Retrieve.corpus must hold Documents")
        object.__setattr__(self, "corpus", docs)
        _require(isinstance(self.question, Node), "Retrieve.question must be a Node")
        _require(self.k is None or _is_int(self.k), "Retrieve.k must be an int or None")
        _require(self.k is None or self.k >= 1, "Retrieve.k must be >= 1", ValueError)
        _require(isinstance(self.embedding_model, str), "Retrieve.embedding_model must be a str")


# --- generic traversal ----------------------------------------------------------


def children(node: Node) -> tuple[Node, ...]:
    """The direct sub-nodes of ``node``, in order."""
    if isinstance(node, Group):
        return node.children
    if isinstance(node, Generate):
        return (node.input,)
    if isinstance(node, Repeat):
        return (node.query,)
    if isinstance(node, Chat):
        return node.messages
    if isinstance(node, Retrieve):
        return (node.question,)
    return ()


def with_children(node: Node, kids: tuple[Node, ...]) -> Node:
    """``node`` with its direct sub-nodes replaced (same arity as ``children``)."""
    if isinstance(node, Group):
        return type(node)(kids)
    if isinstance(node, Generate):
        return replace(node, input=kids[0])
    if isinstance(node, Repeat):
        return replace(node, query=kids[0])
    if isinstance(node, Chat):
        return replace(node, messages=kids)
    if isinstance(node, Retrieve):
        return replace(node, question=kids[0])
    return node


def iter_nodes(node: Node) -> Iterator[Node]:
    """Pre-order walk over every node, generation inputs included."""
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        stack.extend(reversed(children(current)))


def leaf_messages(node: Node) -> Iterator[Message]:
    """Every message leaf in document order (a literal walk: no multiplicities)."""
    return (n for n in iter_nodes(node) if isinstance(n, Message))


def generates(node: Node) -> bool:
    """True if evaluating ``node`` may call a model or a retriever."""
    return any(isinstance(n, (Generate, Chat, Retrieve)) for n in iter_nodes(node))


# --- Python builder -------------------------------------------------------------

NodeLike = Union[Node, str]


def as_node(x: NodeLike) -> Node:
    """A bare string means a user message, as in spnl."""
    if isinstance(x, str):
        return User(x)
    _require(isinstance(x, Node), f"expected a Node or str, got {type(x).__name__}")
    return x


def system(text: str) -> System:
    return System(text)


def user(text: str) -> User:
    return User(text)


def assistant(text: str) -> Assistant:
    return Assistant(text)


def fragment(text: str, source: str = "", index: int | None = None) -> Fragment:
    return Fragment(text, source, index)


def g(input: NodeLike, model: str = "", max_tokens: int | None = None,
      temperature: float | None = None, policy: str | None = None) -> Generate:
    return Generate(model, as_node(input), max_tokens, temperature, policy)


def cross(*xs: NodeLike) -> Cross:
    return Cross(tuple(as_node(x) for x in xs))


def plus(*xs: NodeLike) -> Plus:
    return Plus(tuple(as_node(x) for x in xs))


def seq(*xs: NodeLike) -> Seq:
    return Seq(tuple(as_node(x) for x in xs))


def par(*xs: NodeLike) -> Par:
    return Par(tuple(as_node(x) for x in xs))


def repeat(n: int, q: NodeLike) -> Repeat:
    return Repeat(n, as_node(q))


def chat(*messages: NodeLike, model: str = "", max_tokens: int | None = None,
         temperature: float | None = None, policy: str | None = None) -> Chat:
    return Chat(tuple(as_node(m) for m in messages), model, max_tokens, temperature, policy)


def document(name: str, text: str) -> Document:
    return Document(name, text)


def retrieve(corpus: Iterable[Document | tuple[str, str] | str], question: NodeLike,
             k: int | None = None, embedding_model: str = "") -> Retrieve:
    """``corpus`` items may be Documents, (name, text) pairs, or bare texts (named doc<i>)."""
    docs = []
    for i, item in enumerate(corpus):
        if isinstance(item, Document):
            docs.append(item)
        elif isinstance(item, str):
            docs.append(Document(f"doc{i}", item))
        else:
            name, text = item
            docs.append(Document(name, text))
    return Retrieve(tuple(docs), as_node(question), k, embedding_model)
