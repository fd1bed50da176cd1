"""Bulk execution (tiny model): 64 RAG queries over a 32-document corpus, with a KV pool that holds
a quarter of the corpus (plus room for one query). Running them in locality order gives a higher
plus-document hit ratio than submission order.

Everything here is deterministic: the workload comes from one seeded random.Random,
locality_order is a pure function of the queries, and cache hits depend only on the order of
requests (one query at a time, never on timing), so the hit counts are exact and the margin below
is not a statistical one.
"""
import math
import random
from dataclasses import dataclass

import pytest
import torch

from spanserve import LLM
from spanserve.engine.layout import resolve
from spanserve.query import cross, g, plus, system, user
from spanserve.query.execute import EngineRunner, Executor, locality_order
from spanserve.query.ir import Node, Plus
from spanserve.query.plan import Planner
from tiny_models import make_tiny_model

TOPICS, DOCS_PER_TOPIC, QUERIES, PER_QUERY, BLOCK = 8, 4, 64, 3, 4
WORDS = ("hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran")


@dataclass(frozen=True)
class Workload:
    docs: tuple[str, ...]  # doc i belongs to topic i // DOCS_PER_TOPIC
    queries: tuple[Node, ...]  # in submission order
    doc_ids: tuple[tuple[int, ...], ...]  # the documents each query reads


def make_workload(seed: int) -> Workload:
    """Each query reads 3 of its topic's 4 documents as a plus, in random order; topics shuffled."""
    rng = random.Random(seed)
    docs = [f"doc {i} : " + " ".join(rng.choice(WORDS) for _ in range(40)) for i in range(TOPICS * DOCS_PER_TOPIC)]
    picks = [tuple(rng.sample(range(t * DOCS_PER_TOPIC, (t + 1) * DOCS_PER_TOPIC), PER_QUERY))
             for t in range(TOPICS) for _ in range(QUERIES // TOPICS)]
    rng.shuffle(picks)
    queries = tuple(g(cross(system("answer the question from the documents ."), plus(*(user(docs[i]) for i in ids)),
                            user(f"question {q} : what sat on the mat ?")), max_tokens=2, temperature=0.0)
                    for q, ids in enumerate(picks))
    return Workload(tuple(docs), queries, tuple(picks))


def blocks(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK)


def pool_blocks(llm: LLM, wl: Workload, fraction: float) -> tuple[int, int]:
    """(corpus blocks, pool blocks): `fraction` of the corpus plus what the largest query holds."""
    planner = Planner(llm.tokenizer)
    corpus = sum(blocks(len(llm.engine.encode(planner.turn(user(d))))) for d in wl.docs)
    one_query = max(sum(blocks(len(p.tokens) + 2) for p in resolve(planner.layout(q.input), llm.engine.encode, "none"))
                    for q in wl.queries)
    return corpus, math.ceil(fraction * corpus) + one_query + 1


def run_order(path: str, wl: Workload, order: str, fraction: float) -> dict[str, float]:
    corpus, num_blocks = pool_blocks(LLM(path, block_size=BLOCK, num_blocks=2), wl, fraction)
    llm = LLM(path, block_size=BLOCK, num_blocks=num_blocks)
    outcomes = Executor(EngineRunner(llm.engine), llm.tokenizer, max_tokens=2).execute_many(list(wl.queries), order=order)
    assert all(o.outputs[()].token_ids for o in outcomes), "a query was never admitted"
    planner = Planner(llm.tokenizer)
    hits = sum(o.outputs[()].metrics["reuse"]["segment"] for o in outcomes)
    total = sum(len(s.token_ids) for q in wl.queries for s in planner.layout(q.input) if s.kind == "plus")
    return {"corpus_blocks": corpus, "num_blocks": num_blocks, "plus_tokens": total, "hit_ratio": hits / total}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("bulk"))[0])


@pytest.fixture
def one_thread():
    # The tiny model gains nothing from threads; on busy shared cores they only spin-wait.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_workload_is_deterministic_and_clustered():
    a, b = make_workload(seed=0), make_workload(seed=0)
    assert a == b
    assert len(a.queries) == 64 and len(a.docs) == 32 and len(set(a.docs)) == 32
    for ids in a.doc_ids:  # three distinct documents, all from one topic of four
        assert len(set(ids)) == 3 and len({i // 4 for i in ids}) == 1
    assert all(sum(ids[0] // 4 == t for ids in a.doc_ids) == 8 for t in range(8))
    # submission order interleaves topics, so the pool has to forget a topic before it returns
    topics = [ids[0] // 4 for ids in a.doc_ids]
    assert sum(x != y for x, y in zip(topics, topics[1:])) > 40
    # locality order keeps each topic's queries together
    order = locality_order(a.queries)
    runs = 1 + sum(topics[i] != topics[j] for i, j in zip(order, order[1:]))
    assert runs == 8
    assert all(isinstance(q.input.children[1], Plus) for q in a.queries)


def test_locality_order_beats_submission_order_with_a_quarter_pool(path, one_thread):
    wl = make_workload(seed=0)
    loc = run_order(path, wl, "locality", 0.25)
    sub = run_order(path, wl, "submission", 0.25)
    # The pool really is a quarter of the corpus plus one query, far from holding it all.
    assert loc["num_blocks"] == sub["num_blocks"] < 0.5 * loc["corpus_blocks"]
    assert loc["plus_tokens"] == sub["plus_tokens"]
    # Each topic's four documents are computed once, then hit by its other queries: 20 of 24
    # document reads hit in locality order. Shuffled submission order mostly misses.
    assert loc["hit_ratio"] > 0.75
    assert sub["hit_ratio"] < 0.5
    assert loc["hit_ratio"] > sub["hit_ratio"] + 0.25
