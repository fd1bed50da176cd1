"""Rewrite rules for span queries, applied bottom-up until nothing changes.

Each rule is a small function ``rule(node, options) -> Node | None`` that looks at one
node (whose children are already rewritten in this pass) and returns a replacement,
or None when it does not apply. ``rewrite`` runs passes over the whole tree until a
pass changes nothing, and gives up with ``OptimizeError`` after ``MAX_PASSES``.

The rules, in the order they are tried at each node:

1. ``desugar_chat``: ``Chat(ms, ...)`` -> ``Generate(model, Cross(ms), ...)``.
2. ``desugar_retrieve``: ``Retrieve`` -> ``Plus`` of the fragments the retriever picks.
   A retrieve whose question still has to be generated is left for the executor.
3. ``flatten_plus``: a plus inside a plus is spliced into it.
4. ``flatten_cross``: a cross inside a cross is spliced into it, unless it ends with a
   generation (it may be that generation's conversation, see below, whose extent
   must stay visible).
5. ``distribute_plus``: inside the input of a ``g``, each plus child that is a
   generation ``G`` (or ``Repeat(n, G)``) becomes ``Cross(G.input, G)`` (or
   ``Repeat(n, Cross(G.input, G))``).
6. ``split_for_locality`` (only with ``fan_in``): a ``g`` whose input has a plus wider
   than ``fan_in`` becomes a tree of judges (see the function).

How an inner output is represented before execution
---------------------------------------------------
Plus distribution needs "the inner call's output" in the outer call's prompt before
anything has run. The inner ``Generate`` node itself stands for its output, and it is
placed after a copy of its own input: ``Cross(G.input, G)`` is G's *conversation*
(``spanserve.query.reach.conversation_of`` recognises it). The executor evaluates G
once, then splices G's evaluated prompt followed by ``Assistant(<G's answer>)`` in
place of the cross; the copied prefix is never evaluated separately. The outer prompt
thus contains exactly the tokens G's KV cache already holds, so the outer call
reuses that cache instead of prefilling it again. The representation is plain spnl
JSON, so an optimized query still serialises with ``wire.dumps``.

A generation wrapped alone in a cross, ``Cross((G,))``, means its output only; plus
distribution leaves it alone. The locality rewrite relies on that for its judges.
The query is a tree, not a DAG: each level of nested distributed generations copies
its input, so the tree can double in size per level (queries are shallow in practice).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeGuard

from .ir import (Chat, Cross, Fragment, Generate, Node, Par, Plus, Repeat, Retrieve, Seq, children,
                 generates, leaf_messages, with_children)
from .retrieve import DEFAULT_K, BM25Retriever, Retriever
from .size import measure

MAX_PASSES = 64
MAX_NODES = 50_000  # with repeats expanded; each level of nested distributed generations doubles it


class QueryTooLarge(ValueError):
    """The optimized query would be too large to plan or execute."""


class OptimizeError(RuntimeError):
    """The rules kept changing the query; a bug in a rule, never a user error."""


@dataclass(frozen=True)
class Options:
    fan_in: int | None
    retriever: Retriever


Rule = Callable[[Node, Options], "Node | None"]


# --- sugar ----------------------------------------------------------------------


def desugar_chat(node: Node, options: Options) -> Node | None:
    if not isinstance(node, Chat):
        return None
    return Generate(node.model, Cross(node.messages), node.max_tokens, node.temperature, node.policy)


def desugar_retrieve(node: Node, options: Options) -> Node | None:
    # The question's text is the retrieval query; if it has to be generated first,
    # only the executor can retrieve, after running it.
    if not isinstance(node, Retrieve) or generates(node.question):
        return None
    question = "\n".join(m.text for m in leaf_messages(node.question))
    k = node.k if node.k is not None else DEFAULT_K
    found = tuple(options.retriever.retrieve(question, node.corpus, k))
    if not all(isinstance(f, Fragment) for f in found) or len(found) > k:
        raise TypeError(f"retriever {options.retriever!r} must return at most {k} Fragments")
    return Plus(found)


# --- flattening -----------------------------------------------------------------


def flatten_plus(node: Node, options: Options) -> Node | None:
    if not isinstance(node, Plus) or not any(isinstance(c, Plus) for c in node.children):
        return None
    return Plus(tuple(x for c in node.children for x in (c.children if isinstance(c, Plus) else (c,))))


def _spliceable(node: Node) -> TypeGuard[Cross]:
    # Splicing Cross(x, G) into a longer cross would hide where G's conversation
    # starts, turning "G's prompt and answer" into unrelated messages.
    return isinstance(node, Cross) and not (bool(node.children) and isinstance(node.children[-1], Generate))


def flatten_cross(node: Node, options: Options) -> Node | None:
    if not isinstance(node, Cross) or not any(_spliceable(c) for c in node.children):
        return None
    return Cross(tuple(x for c in node.children for x in (c.children if _spliceable(c) else (c,))))


# --- plus distribution ----------------------------------------------------------


def _conversation(child: Node) -> Node | None:
    """The distributed form of a plus child, or None if it is not a bare generation."""
    if isinstance(child, Generate):
        return Cross((child.input, child))
    if isinstance(child, Repeat) and isinstance(child.query, Generate):
        return Repeat(child.n, Cross((child.query.input, child.query)))
    return None


def _distribute(node: Node) -> Node:
    """Distribute every plus reachable from a g's input without entering another g.

    Returns ``node`` itself when nothing changed, so callers can test identity.
    """
    if isinstance(node, Plus):
        kids = tuple(_conversation(c) or _distribute(c) for c in node.children)
    elif isinstance(node, (Cross, Seq, Par, Repeat)):
        # A nested g's input is that g's business; its own rule handles it.
        kids = tuple(_distribute(c) for c in children(node))
    else:
        return node
    if all(new is old for new, old in zip(kids, children(node))):
        return node
    return with_children(node, kids)


def distribute_plus(node: Node, options: Options) -> Node | None:
    if not isinstance(node, Generate):
        return None
    new_input = _distribute(node.input)
    return None if new_input is node.input else replace(node, input=new_input)


# --- attention locality ---------------------------------------------------------


def _width(plus: Plus) -> int:
    # A Repeat(n, q) child stands for n independent items, so it counts n times:
    # otherwise the common "judge n candidates" query would never be split.
    return sum(c.n if isinstance(c, Repeat) else 1 for c in plus.children)


def _wide_plus(node: Node, fan_in: int) -> tuple[Plus, Callable[[Plus], Node]] | None:
    """The first plus wider than fan_in at the top of a g input, and how to rebuild it."""
    if isinstance(node, Plus):
        return (node, lambda p: p) if _width(node) > fan_in else None
    if isinstance(node, (Cross, Seq)):
        kids = node.children
        for i, child in enumerate(kids):
            if isinstance(child, Plus) and _width(child) > fan_in:
                return child, lambda p, i=i: type(node)(kids[:i] + (p,) + kids[i + 1:])
    return None


def _groups(items: Sequence[Node], width: int, fan_in: int) -> list[tuple[Node, ...]]:
    """Split plus items into ceil(width / fan_in) groups of balanced width.

    A Repeat is cut across groups when needed (Repeat(5, q) -> Repeat(2, q),
    Repeat(3, q)): n samples are n samples however they are batched.
    """
    count = -(-width // fan_in)
    base, extra = divmod(width, count)
    sizes = [base + (1 if i < extra else 0) for i in range(count)]
    groups: list[list[Node]] = [[] for _ in sizes]
    at, room = 0, sizes[0]
    for item in items:
        left = item.n if isinstance(item, Repeat) else 1
        if left == 0:
            groups[at].append(item)
        while left:
            if room == 0:
                at, room = at + 1, sizes[at + 1]
            take = min(left, room)
            groups[at].append(Repeat(take, item.query) if isinstance(item, Repeat) else item)
            left, room = left - take, room - take
    return [tuple(g) for g in groups]


def split_for_locality(node: Node, options: Options) -> Node | None:
    """A g attending to a plus of more than fan_in items becomes a tree of judges.

    Each judge is the same call (model, sampling, policy, and the rest of the input,
    e.g. the instructions) over one group of at most fan_in items; the g itself then
    runs over a plus of the judges' outputs. If there are still more than fan_in
    judges, the next pass splits again, so the tree has depth log_fan_in(width).
    Judges are wrapped as ``Cross((judge,))`` (output only) so plus distribution
    does not splice the documents back into the final call's attention.
    """
    if options.fan_in is None or not isinstance(node, Generate):
        return None
    found = _wide_plus(node.input, options.fan_in)
    if found is None:
        return None
    wide, rebuild = found
    judges = tuple(
        Generate(node.model, rebuild(Plus(group)), node.max_tokens, node.temperature, node.policy)
        for group in _groups(wide.children, _width(wide), options.fan_in)
    )
    return replace(node, input=rebuild(Plus(tuple(Cross((j,)) for j in judges))))


# --- driver ---------------------------------------------------------------------

RULES: tuple[Rule, ...] = (
    desugar_chat,
    desugar_retrieve,
    flatten_plus,
    flatten_cross,
    distribute_plus,
    split_for_locality,
)


def _pass(node: Node, rules: Sequence[Rule], options: Options,
          memo: dict[int, tuple[Node, bool]] | None = None) -> tuple[Node, bool]:
    # Rewrites share subtrees (a plus of one generation twice holds one node twice): each shared
    # node is rewritten once per pass, or a pass would walk the expanded tree, exponential in depth.
    memo = {} if memo is None else memo
    hit = memo.get(id(node))
    if hit is not None:
        return hit
    start, changed = node, False
    old_kids = children(node)
    if old_kids:
        results = [_pass(k, rules, options, memo) for k in old_kids]
        if any(c for _, c in results):
            node, changed = with_children(node, tuple(k for k, _ in results)), True
    for rule in rules:
        out = rule(node, options)
        # A rule that returns an equal node would otherwise spin until MAX_PASSES.
        if out is not None and out != node:
            node, changed = out, True
    memo[id(start)] = (node, changed)
    return node, changed


def _check_size(node: Node, limit: int = MAX_NODES) -> None:
    # Rewrites share subtrees, so memory stays small even when the expanded tree is huge; walking
    # it (to plan, run or serialize) would not, and neither would expanding its repeats.
    nodes = measure(node).nodes
    if nodes > limit:
        raise QueryTooLarge(f"the optimized query has {nodes} nodes with its repeats expanded, more than {limit}: "
                            "every repeat multiplies its query, and every level of nested generations inside a "
                            "plus copies the inner inputs; lower the repeat counts or flatten the nesting")


def rewrite(node: Node, rules: Sequence[Rule], options: Options, max_passes: int = MAX_PASSES) -> Node:
    """Apply ``rules`` bottom-up, pass after pass, until a pass changes nothing."""
    for _ in range(max_passes):
        node, changed = _pass(node, rules, options)
        _check_size(node)
        if not changed:
            return node
    raise OptimizeError(f"rewrite rules did not reach a fixed point within {max_passes} passes")


def optimize(node: Node, *, fan_in: int | None = None, retriever: Retriever | None = None) -> Node:
    """The query's fixed point under ``RULES``.

    ``fan_in`` (>= 2) enables the attention-locality rewrite; ``retriever`` resolves
    ``Retrieve`` nodes (default: the built-in lexical BM25 retriever).
    """
    if fan_in is not None and (not isinstance(fan_in, int) or isinstance(fan_in, bool) or fan_in < 2):
        # fan_in 1 would replace n items by n judges forever.
        raise ValueError(f"fan_in must be an int >= 2, or None to disable; got {fan_in!r}")
    return rewrite(node, RULES, Options(fan_in, retriever if retriever is not None else BM25Retriever()))
