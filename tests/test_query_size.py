"""measure() against the reference: the tree execution actually builds (execute._expand), walked
node by node."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from spanserve.query import ir
from spanserve.query.execute import _expand
from spanserve.query.ir import Cross, Generate, Message, Node, Par, Plus, Repeat, Seq, children, iter_nodes
from spanserve.query.size import QuerySize, measure

_MESSAGE = st.builds(lambda cls, n: cls("x" * n), st.sampled_from([ir.System, ir.User, ir.Assistant]),
                     st.integers(0, 50))


def _composite(kids: st.SearchStrategy[Node]) -> st.SearchStrategy[Node]:
    items = st.lists(kids, max_size=4).map(tuple)
    return st.one_of(st.builds(Cross, items), st.builds(Plus, items), st.builds(Seq, items), st.builds(Par, items),
                     st.builds(Repeat, st.integers(0, 4), kids), st.builds(Generate, st.just("m"), kids))


QUERIES = st.recursive(_MESSAGE, _composite, max_leaves=20)


def _direct_text(node: Node) -> int:
    """Message text a generation around `node` reads in its prompt (not nested generations' inputs)."""
    if isinstance(node, Message):
        return len(node.text)
    if isinstance(node, Generate):
        return 0
    return sum(_direct_text(c) for c in children(node))


def reference(query: Node) -> QuerySize:
    tree = _expand(query)
    nodes = list(iter_nodes(tree))
    gens = [n for n in nodes if isinstance(n, Generate)]
    return QuerySize(len(nodes), len(gens), max((_direct_text(g.input) for g in gens), default=0))


@settings(max_examples=400, deadline=None)
@given(QUERIES)
def test_measure_is_the_size_of_the_expanded_tree(query: Node) -> None:
    assert measure(query) == reference(query)


def test_huge_and_deep_repeats_are_measured_without_expanding() -> None:
    q: Node = ir.user("abc")
    for _ in range(100):
        q = ir.repeat(1000, q)
    size = measure(ir.g(q))
    assert size.nodes == 1 + sum(1000**k for k in range(101))  # each repeat of a repeat is a par of pars
    assert size.input_chars == 3 * 1000**100 and size.generations == 1
    wide = ir.repeat(10**6, ir.g(ir.cross(ir.repeat(10**6, ir.user("ab")))))
    assert measure(wide).generations == 10**6 and measure(wide).input_chars == 2 * 10**6


def test_shared_subtrees_are_walked_once() -> None:
    q: Node = ir.g(ir.user("a"))
    for i in range(100):  # 2**100 paths: a walk of the unfolded tree would never end
        q = ir.g(ir.cross(ir.user(f"level {i}"), ir.plus(q, q)))
    assert measure(q).generations == 2**101 - 1


def test_a_chat_counts_as_its_generation() -> None:
    msgs = (ir.system("s" * 7), ir.repeat(3, ir.user("u" * 5)))
    chat, gen = measure(ir.Chat(msgs, "m")), measure(ir.g(ir.Cross(msgs)))
    assert (chat.generations, chat.input_chars) == (gen.generations, gen.input_chars) == (1, 22)
