import importlib
from pathlib import Path

import pytest
from hypothesis import reject, given, settings
from hypothesis import strategies as st

from spanserve.query import ir
from spanserve.query.ir import (Assistant, Chat, Cross, Document, Fragment, Generate, Node, Par, Plus,
                                Repeat, Seq, System, User, children, iter_nodes, with_children)
from spanserve.query.optimize import QueryTooLarge, OptimizeError, Options, optimize, rewrite
from spanserve.query.reach import conversation_of, reachable_messages
from spanserve.query.retrieve import BM25Retriever
from spanserve.query.wire import dumps, parse

# The package re-exports the optimize() function under the submodule's name.
opt = importlib.import_module("spanserve.query.optimize")
OPTS = Options(fan_in=None, retriever=BM25Retriever())
M = "m"


def gen(x, **kw):
    return ir.g(x, model=M, **kw)


# --- one test per rule ----------------------------------------------------------


def test_desugar_chat():
    c = ir.chat(ir.system("s"), "u", model=M, max_tokens=7, temperature=0.5, policy="p")
    assert opt.desugar_chat(c, OPTS) == Generate(M, Cross((System("s"), User("u"))), 7, 0.5, "p")
    assert opt.desugar_chat(User("u"), OPTS) is None
    assert optimize(ir.plus(c)) == ir.plus(Generate(M, Cross((System("s"), User("u"))), 7, 0.5, "p"))


def test_desugar_retrieve_with_builtin_bm25():
    corpus = [Document("fr", "Paris is in France.\n\nLyon is in France too."), Document("q", "Qubits.")]
    r = ir.retrieve(corpus, "Where is Paris?", k=1)
    assert opt.desugar_retrieve(r, OPTS) == Plus((Fragment("Paris is in France.", "fr", 0),))
    q = gen(ir.cross(ir.system("s"), r, "Where is Paris?"))
    assert optimize(q) == gen(ir.cross(ir.system("s"), ir.plus(ir.fragment("Paris is in France.", "fr", 0)),
                                       "Where is Paris?"))


class FixedRetriever:
    def __init__(self, out):
        self.out, self.calls = out, []

    def retrieve(self, question, corpus, k):
        self.calls.append((question, tuple(corpus), k))
        return self.out


def test_desugar_retrieve_uses_given_retriever_and_waits_for_generated_questions():
    stub = FixedRetriever((Fragment("x", "d", 0),))
    static = ir.retrieve(["doc"], ir.cross(ir.system("a"), "b"))
    assert optimize(ir.plus(static, "c"), retriever=stub) == ir.plus(Fragment("x", "d", 0), "c")
    assert stub.calls == [("a\nb", (Document("doc0", "doc"),), 4)]
    dynamic = ir.retrieve(["doc"], gen("write a question"))
    assert optimize(dynamic, retriever=stub) == dynamic
    with pytest.raises(TypeError):
        optimize(static, retriever=FixedRetriever(("not a fragment",)))


def test_flatten_plus():
    q = ir.plus("a", ir.plus("b", ir.plus("c")), ir.cross("d"))
    assert opt.flatten_plus(q, OPTS) == ir.plus("a", "b", ir.plus("c"), ir.cross("d"))
    assert optimize(q) == ir.plus("a", "b", "c", ir.cross("d"))
    assert opt.flatten_plus(ir.plus("a", ir.cross("b")), OPTS) is None


def test_flatten_cross_keeps_conversations_whole():
    inner = gen("u")
    q = ir.cross("a", ir.cross("b", ir.cross("c")), ir.plus(ir.cross("d")), ir.cross("u", inner))
    assert optimize(q) == ir.cross("a", "b", "c", ir.plus(ir.cross("d")), ir.cross("u", inner))
    assert opt.flatten_cross(ir.cross("a", ir.plus("b")), OPTS) is None


def test_distribute_plus_of_generations():
    g1, g2 = gen(ir.cross(ir.system("s1"), "u1")), gen("u2")
    q = gen(ir.cross(ir.system("judge"), ir.plus(g1, g2), "pick one"))
    out = optimize(q)
    assert out == gen(ir.cross(ir.system("judge"),
                               ir.plus(ir.cross(ir.system("s1"), "u1", g1), ir.cross("u2", g2)), "pick one"))
    convs = out.input.children[1].children
    assert [conversation_of(c) for c in convs] == [g1, g2]
    assert reachable_messages(out) == reachable_messages(q)


def test_distribute_plus_of_repeat_and_mixed_children():
    inner = gen("email", temperature=0.3)
    q = gen(ir.seq(ir.plus(ir.repeat(4, inner), "a doc", ir.cross(inner))))
    assert optimize(q) == gen(ir.seq(ir.plus(ir.repeat(4, ir.cross("email", inner)), "a doc", ir.cross(inner))))


def test_distribute_plus_only_feeds_a_generation():
    top = ir.par(ir.plus(gen("a"), gen("b")))
    assert optimize(top) == top  # the client asked for the outputs, not conversations
    assert opt.distribute_plus(gen(ir.plus("x")), OPTS) is None


def test_nested_distribution_duplicates_inputs_and_stays_consistent():
    g0 = gen("u0")
    g1 = gen(ir.cross(ir.system("s1"), ir.plus(g0)))
    out = optimize(gen(ir.plus(g1)))
    g1_opt = gen(ir.cross(ir.system("s1"), ir.plus(ir.cross("u0", g0))))
    assert out == gen(ir.plus(ir.cross(ir.system("s1"), ir.plus(ir.cross("u0", g0)), g1_opt)))
    assert conversation_of(out.input.children[0]) == g1_opt


def test_locality_is_off_by_default():
    q = gen(ir.cross(ir.system("s"), ir.plus(*[f"d{i}" for i in range(50)]), "q"))
    assert optimize(q) == q


def _judges(node):
    return [n for n in iter_nodes(node) if isinstance(n, Generate)]


def test_locality_builds_a_tree_of_judges():
    docs = [f"d{i}" for i in range(5)]
    q = gen(ir.cross(ir.system("s"), ir.plus(*docs), "q"), max_tokens=9, policy="p")
    out = optimize(q, fan_in=2)

    def call(*items):
        return gen(ir.cross(ir.system("s"), ir.plus(*items), "q"), max_tokens=9, policy="p")

    # 5 items -> judges of widths 2,2,1 -> 3 > 2 judges -> judges of 2 and 1 judges.
    j1, j2, j3 = call("d0", "d1"), call("d2", "d3"), call("d4")
    k1, k2 = call(Cross((j1,)), Cross((j2,))), call(Cross((j3,)))
    assert out == call(Cross((k1,)), Cross((k2,)))
    leaves = [n for n in iter_nodes(out) if isinstance(n, User) and n.text.startswith("d")]
    assert sorted(m.text for m in leaves) == docs  # every document is read by exactly one judge
    assert set(reachable_messages(out)) == set(reachable_messages(q))


def test_locality_splits_repeats_by_width_and_handles_bare_plus_input():
    inner = gen("email")
    out = optimize(gen(ir.plus(ir.repeat(5, inner))), fan_in=3)
    conv = ir.cross("email", inner)
    assert out == gen(ir.plus(Cross((gen(ir.plus(ir.repeat(3, conv))),)), Cross((gen(ir.plus(ir.repeat(2, conv))),))))


def test_locality_on_spnl_judge_example():
    q = parse((Path(__file__).parent / "data" / "spnl_examples" / "about_judge_emails.json").read_text())
    out = optimize(q, fan_in=2)
    judges = out.input.children[1].children
    assert len(judges) == 2 and all(isinstance(j, Cross) and len(j.children) == 1 for j in judges)
    assert all(j.children[0].input.children[1].children[0].n == 2 for j in judges)
    assert optimize(out, fan_in=2) == out


@pytest.mark.parametrize("fan_in", [1, 0, True, 2.5])
def test_bad_fan_in(fan_in):
    with pytest.raises(ValueError):
        optimize(ir.user("a"), fan_in=fan_in)


def test_driver_reaches_fixed_point_and_caps_iterations():
    assert rewrite(ir.cross("a", ir.cross("b")), [opt.flatten_cross], OPTS) == ir.cross("a", "b")

    def forever(node, options):
        return Repeat(node.n + 1, node.query) if isinstance(node, Repeat) else None

    with pytest.raises(OptimizeError):
        rewrite(ir.repeat(0, "a"), [forever], OPTS, max_passes=5)

    def rebuilds(node, options):
        return Cross(node.children) if isinstance(node, Cross) else None

    assert rewrite(ir.cross("a"), [rebuilds], OPTS) == ir.cross("a")  # an equal result is no change


def test_optimized_query_still_serialises():
    q = gen(ir.cross(ir.system("s"), ir.plus(gen("a"), ir.repeat(2, gen("b")))))
    out = optimize(q, fan_in=2)
    assert parse(dumps(out)) == out


# --- properties over random trees -----------------------------------------------

_MESSAGE = st.sampled_from([System, User, Assistant, Fragment]).map(lambda cls: cls(""))


def _composite(kids):
    items = st.lists(kids, max_size=4).map(tuple)
    model = st.sampled_from(["m1", "m2"])
    sampling = dict(max_tokens=st.none() | st.integers(0, 3), temperature=st.none() | st.just(0.5))
    generation = st.builds(Generate, model, kids, **sampling) | st.builds(Chat, items, model)
    candidates = generation | st.builds(Repeat, st.integers(0, 3), generation)
    # The judge/generator shape (a g over instructions and a plus of generations) is
    # where distribution and locality act; plain recursion rarely builds it.
    judge = st.builds(lambda head, cands, tail, m: Generate(m, Cross(head + (Plus(cands + tail),))),
                      items, st.lists(candidates, min_size=1, max_size=4).map(tuple), items, model)
    return st.one_of(
        st.builds(Cross, items), st.builds(Plus, items), st.builds(Seq, items), st.builds(Par, items),
        st.builds(Repeat, st.integers(0, 3), kids), generation, judge,
    )


def _relabel(node: Node, counter: list[int]) -> Node:
    """Give every leaf a distinct text, so no two subtrees with messages are equal by chance."""
    if isinstance(node, ir.Message):
        counter[0] += 1
        return type(node)(f"t{counter[0]}")
    return with_children(node, tuple(_relabel(c, counter) for c in children(node)))


QUERIES = st.recursive(_MESSAGE, _composite, max_leaves=24).map(lambda q: _relabel(q, [0]))
FAN_IN = st.sampled_from([None, 2, 3])


@settings(max_examples=300, deadline=None)
@given(QUERIES, FAN_IN)
def test_optimize_reaches_a_fixed_point(q, fan_in):
    try:
        once = optimize(q, fan_in=fan_in)
    except QueryTooLarge:
        reject()  # deeply nested distributions: covered by test_too_large_queries_are_refused
    assert optimize(once, fan_in=fan_in) == once
    assert optimize(once, fan_in=fan_in) == once
    assert parse(dumps(once)) == once


@settings(max_examples=300, deadline=None)
@given(QUERIES)
def test_optimize_keeps_the_messages_generations_read(q):
    try:
        out = optimize(q)
    except QueryTooLarge:
        reject()
    assert reachable_messages(out) == reachable_messages(q)


def test_too_large_queries_are_refused():
    from spanserve.query.ir import cross, g, plus, user
    q = g(user("leaf"))
    for i in range(20):  # each level distributes (copies) the inner generation's input
        q = g(cross(user(f"level {i}"), plus(q, q)))
    with pytest.raises(QueryTooLarge, match="flatten the nesting"):
        optimize(q)


@settings(max_examples=200, deadline=None)
@given(QUERIES, st.sampled_from([2, 3]))
def test_locality_only_duplicates_what_generations_read(q, fan_in):
    # Judges repeat the instructions of the call they split, so counts may grow, but
    # no message is lost or invented.
    before, after = reachable_messages(q), reachable_messages(optimize(q, fan_in=fan_in))
    assert set(after) == set(before)
    assert all(after[m] >= c for m, c in before.items())
