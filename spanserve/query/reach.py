"""What the generations of a query read: conversations and reachable messages.

A *conversation* is a ``Cross`` whose last child is a ``Generate`` G and whose other
children spell G's own input (comparing both with nested crosses spliced). It stands
for "G's prompt followed by G's answer": the executor evaluates G once and splices
G's evaluated prompt and its Assistant output in place of the whole cross; the
prefix is never evaluated on its own. Plus distribution (``optimize``) produces these
so an outer call's prompt repeats the inner call's tokens and hits its KV cache.
"""
from __future__ import annotations

from collections import Counter

from .ir import Chat, Cross, Generate, Message, Node, Repeat, Retrieve, children


def spliced(node: Node) -> tuple[Node, ...]:
    """``node`` as a flat sequence: nested crosses are spliced, anything else is one item."""
    if not isinstance(node, Cross):
        return (node,)
    return tuple(item for child in node.children for item in spliced(child))


def conversation_of(node: Node) -> Generate | None:
    """The generation whose conversation ``node`` is, or None (see module docstring)."""
    if not isinstance(node, Cross) or not node.children:
        return None
    last = node.children[-1]
    if not isinstance(last, Generate):
        return None
    prefix = tuple(item for child in node.children[:-1] for item in spliced(child))
    return last if prefix == spliced(last.input) else None


def reachable_messages(node: Node) -> Counter[Message]:
    """Multiset of leaf messages read by the generations of ``node``.

    Precisely, walking from the root:

    * a message counts once each time it is reached *inside the input of a
      generation* (``Generate`` or ``Chat``); messages outside every generation are
      not read by a model and do not count;
    * ``Cross``/``Plus``/``Seq``/``Par`` add up their children, ``Repeat(n, q)``
      counts ``q`` n times, and a generation counts what its input reaches;
    * a conversation (``conversation_of``) counts as its generation alone: its prefix
      is that generation's own prompt shown again, not new data.

    ``Retrieve`` raises ValueError: its messages are unknown until a retriever runs.
    The attention-locality rewrite deliberately copies a generation's instructions
    into every judge, so it grows this multiset; every other rewrite keeps it.
    """
    return _reach(node, read=False)


def _reach(node: Node, read: bool) -> Counter[Message]:
    if isinstance(node, Message):
        return Counter([node]) if read else Counter()
    if isinstance(node, Retrieve):
        raise ValueError("reachable_messages needs Retrieve nodes resolved first (optimize)")
    if isinstance(node, Generate):
        return _reach(node.input, read=True)
    if isinstance(node, Chat):
        return _reach(Cross(node.messages), read=True)
    owner = conversation_of(node)
    if owner is not None:
        return _reach(owner, read)
    total: Counter[Message] = Counter()
    for child in children(node):
        total.update(_reach(child, read))
    times = node.n if isinstance(node, Repeat) else 1
    return Counter({m: c * times for m, c in total.items() if c * times})
