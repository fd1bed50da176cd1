"""Bulk execution (tiny model): 64 RAG queries over a 32-document corpus, with a KV pool that holds
a quarter of the corpus (plus room for one query). Running them in locality order gives a higher
plus-document hit ratio than submission order.

The workload and pool sizing are the ones of benchmarks/bulk_locality.py. Everything here is
deterministic: the workload comes from one seeded random.Random, locality_order is a pure function
of the queries, and cache hits depend only on the order of requests (one query at a time, never on
timing), so the hit counts are exact and the margin below is not a statistical one.
"""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from spanserve.query.ir import Plus
from spanserve.query.execute import locality_order
from tiny_models import make_tiny_model

_SPEC = importlib.util.spec_from_file_location(
    "bulk_locality", Path(__file__).resolve().parents[1] / "benchmarks" / "bulk_locality.py")
bulk = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("bulk_locality", bulk)  # its dataclasses look their module up by name
_SPEC.loader.exec_module(bulk)


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
    a, b = bulk.make_workload(seed=0), bulk.make_workload(seed=0)
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
    wl = bulk.make_workload(seed=0)
    loc = bulk.run_order(path, wl, "locality", 0.25)
    sub = bulk.run_order(path, wl, "submission", 0.25)
    # The pool really is a quarter of the corpus plus one query, far from holding it all.
    assert loc["num_blocks"] == sub["num_blocks"] < 0.5 * loc["corpus_blocks"]
    assert loc["plus_tokens"] == sub["plus_tokens"]
    # Each topic's four documents are computed once, then hit by its other queries: 20 of 24
    # document reads hit in locality order. Shuffled submission order mostly misses.
    assert loc["hit_ratio"] > 0.75
    assert sub["hit_ratio"] < 0.5
    assert loc["hit_ratio"] > sub["hit_ratio"] + 0.25
