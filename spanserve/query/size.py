"""How large a span query becomes when it runs, measured before anything is expanded.

A query is small on the wire and large in execution: ``Repeat(n, q)`` is n copies of q, nested
repeats multiply, and a repeat of a message inside a generation's input repeats its text in that
prompt. ``measure`` counts all of it on the unexpanded tree (shared subtrees once, so the walk
costs the tree's own size), so a server can refuse a query before any of it is materialised.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ir import Chat, Generate, Group, Message, Node, Repeat, Retrieve, children


@dataclass(frozen=True)
class QuerySize:
    nodes: int  # nodes once every repeat is expanded (what execution materialises)
    generations: int  # model calls, every repeat expanded
    input_chars: int  # the most message text one generation's input holds, repeats counted


@dataclass(frozen=True)
class _Count:
    nodes: int
    generations: int
    text: int  # message text this node puts into the input of a generation around it
    worst: int  # the largest input text of a generation within this node


def measure(node: Node) -> QuerySize:
    c = _count(node, {})
    return QuerySize(c.nodes, c.generations, c.worst)


def _count(node: Node, memo: dict[int, _Count]) -> _Count:
    hit = memo.get(id(node))
    if hit is not None:
        return hit
    sub = children(node)
    kids = [_count(k, memo) for k in sub]
    # A repeat becomes a par of its copies, except in a group, whose children the copies become.
    nodes = 1 + sum(k.nodes - (isinstance(node, Group) and isinstance(n, Repeat)) for k, n in zip(kids, sub))
    gens = sum(k.generations for k in kids)
    text = sum(k.text for k in kids)
    worst = max((k.worst for k in kids), default=0)
    if isinstance(node, Message):
        text = len(node.text)
    elif isinstance(node, Repeat):
        (q,) = kids
        nodes, gens, text, worst = 1 + node.n * q.nodes, node.n * q.generations, node.n * q.text, \
            (q.worst if node.n else 0)
    elif isinstance(node, (Generate, Chat)):
        # A nested generation reads its own input; the outer one reads its output, whose length
        # is known only once it has run (the planner checks the prompt then).
        gens, worst, text = gens + 1, max(worst, text), 0
    elif isinstance(node, Retrieve):
        nodes += len(node.corpus)  # at most every document comes back as a fragment
        text = 0  # the fragments are chosen at run time (the planner checks the prompt then)
    out = _Count(nodes, gens, text, worst)
    memo[id(node)] = out
    return out
