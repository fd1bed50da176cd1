import dataclasses
from collections import Counter

import pytest

from spanserve.query import ir
from spanserve.query.ir import (Assistant, Chat, Cross, Document, Fragment, Generate, Par, Plus,
                                Repeat, Retrieve, Seq, System, User, children, generates,
                                leaf_messages, with_children)
from spanserve.query.reach import conversation_of, reachable_messages
from spanserve.query.retrieve import BM25Retriever, Retriever, chunk


def test_builders_build_the_dataclasses():
    assert ir.g("hi", model="m", max_tokens=4) == Generate("m", User("hi"), 4)
    assert ir.cross("a", ir.system("s")) == Cross((User("a"), System("s")))
    assert ir.plus() == Plus(())
    assert ir.seq("a") == Seq((User("a"),)) and ir.par("a") == Par((User("a"),))
    assert ir.repeat(3, "a") == Repeat(3, User("a"))
    assert ir.assistant("x") == Assistant("x")
    assert ir.chat("a", model="m", policy="p") == Chat((User("a"),), "m", policy="p")
    assert ir.fragment("t", "d.txt", 1) == Fragment("t", "d.txt", 1)
    r = ir.retrieve(["first", ("b.txt", "second"), Document("c", "third")], "q", k=2)
    assert r.corpus == (Document("doc0", "first"), Document("b.txt", "second"), Document("c", "third"))
    assert r.question == User("q") and r.k == 2


def test_nodes_are_frozen_hashable_and_role_sensitive():
    q = ir.g(ir.cross("a", ir.plus("b")), model="m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.model = "other"  # type: ignore[misc]
    assert hash(q) == hash(ir.g(ir.cross("a", ir.plus("b")), model="m"))
    assert System("a") != User("a") != Assistant("a") != Fragment("a")
    assert Fragment("a").role == "user" and System("a").role == "system"


def test_children_are_tuples_even_from_lists():
    node = Cross([User("a"), User("b")])  # type: ignore[arg-type]
    assert node.children == (User("a"), User("b"))
    assert Chat([User("a")]).messages == (User("a"),)  # type: ignore[arg-type]


def test_integer_temperature_becomes_float():
    assert ir.g("a", temperature=1).temperature == 1.0
    assert isinstance(ir.chat("a", temperature=0).temperature, float)


@pytest.mark.parametrize("build", [
    lambda: Cross((User("a"), "b")),
    lambda: Repeat(-1, User("a")),
    lambda: Repeat(True, User("a")),
    lambda: Generate("m", "text"),
    lambda: Generate("m", User("a"), max_tokens=-5),
    lambda: Retrieve((Document("a", "b"),), User("q"), k=0),
    lambda: User(3),
    lambda: ir.cross(3),
])
def test_invalid_nodes_are_rejected(build):
    with pytest.raises((TypeError, ValueError)):
        build()


def test_generic_traversal():
    q = ir.g(ir.cross("a", ir.repeat(2, ir.chat("b", model="m"))), model="m")
    assert [m.text for m in leaf_messages(q)] == ["a", "b"]
    assert generates(q) and not generates(ir.cross("a", ir.plus("b")))
    for node in (q, q.input, q.input.children[1], Retrieve((), User("q")), Chat((User("a"),))):
        assert with_children(node, children(node)) == node


def test_conversation_of_recognises_spliced_prompts():
    inner = ir.g(ir.cross(ir.system("s"), "u"), model="m")
    assert conversation_of(Cross((inner.input, inner))) is inner
    assert conversation_of(ir.cross(ir.system("s"), "u", inner)) is inner
    assert conversation_of(ir.cross("u", inner)) is None
    assert conversation_of(Cross((inner,))) is None
    assert conversation_of(ir.plus(inner)) is None


def test_reachable_messages_counts_what_generations_read():
    inner = ir.g("u", model="m")
    q = ir.seq("not read", ir.g(ir.cross(ir.system("s"), ir.plus(ir.repeat(3, inner)),
                                          ir.cross("u", inner)), model="m"))
    # "u" : 3 from the repeat, and inside the conversation cross("u", inner) only once.
    assert reachable_messages(q) == Counter({System("s"): 1, User("u"): 4})
    assert reachable_messages(ir.chat("a", model="m")) == Counter({User("a"): 1})
    assert reachable_messages(ir.plus("x")) == Counter()
    with pytest.raises(ValueError):
        reachable_messages(ir.g(ir.retrieve(["d"], "q"), model="m"))


CORPUS = [
    Document("paris.txt", "Paris is the capital of France.\n\nThe Seine flows through Paris."),
    Document("qubits.txt", "Quantum computers use qubits.\n\n\nQubits can be entangled."),
    Document("empty.txt", "  \n\n "),
]


def test_chunk_splits_paragraphs_and_long_ones_by_words():
    assert chunk(CORPUS[0]) == (Fragment("Paris is the capital of France.", "paris.txt", 0),
                                Fragment("The Seine flows through Paris.", "paris.txt", 1))
    assert chunk(CORPUS[2]) == ()
    long = chunk(Document("l", "w " * 5), max_words=2)
    assert [f.text for f in long] == ["w w", "w w", "w"]
    with pytest.raises(ValueError):
        chunk(CORPUS[0], max_words=0)


def test_bm25_picks_relevant_fragments_in_corpus_order():
    bm25 = BM25Retriever()
    assert isinstance(bm25, Retriever)
    top = bm25.retrieve("What is the capital of France?", CORPUS, 1)
    assert top == (Fragment("Paris is the capital of France.", "paris.txt", 0),)
    both = bm25.retrieve("paris qubits", CORPUS, 4)
    assert [(f.source, f.index) for f in both] == [("paris.txt", 0), ("paris.txt", 1),
                                                   ("qubits.txt", 0), ("qubits.txt", 1)]
    assert bm25.retrieve("entangled QUBITS", CORPUS, 1) == (Fragment("Qubits can be entangled.", "qubits.txt", 1),)


def test_bm25_edge_cases():
    bm25 = BM25Retriever()
    assert bm25.retrieve("zebra", CORPUS, 3) == ()
    assert bm25.retrieve("", CORPUS, 3) == ()
    assert bm25.retrieve("paris", [], 3) == ()
    with pytest.raises(ValueError):
        bm25.retrieve("paris", CORPUS, 0)
