"""The quality benchmark's aggregation and in-context-learning task families (benchmarks/common/
tasks.py, tasks_reasoning.py): cases build in both layouts, are deterministic, the answer follows
from the context, aggregation facts sit in different chunks, and the scorer takes the answer.
A character encoder stands in for the tokenizer (one token per character)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common.tasks import (
    ALL_FAMILIES,
    FAMILIES,
    ICL,
    LAYOUTS,
    REASONING,
    is_correct,
    make_case,
)
from common.tasks_reasoning import CATEGORIES

NEW = REASONING + ICL
SEEDS = (0, 1, 2, 3)


def encode(s: str) -> list[int]:
    return [ord(c) for c in s]


def decode(ids: list[int]) -> str:
    return "".join(map(chr, ids))


def case(family: str, layout: str, seed: int, ctx: int = 1024, n_chunks: int = 4):
    return make_case(family, layout, 0, seed, encode, ctx, n_chunks)


def chunk_texts(c) -> list[str]:
    return [decode(ch) for ch in c.chunks]


def test_tuples():
    assert FAMILIES == ("single_needle", "multi_key", "kv_retrieval", "var_tracking", "frequent_words")
    assert ALL_FAMILIES == FAMILIES + REASONING + ICL and len(set(ALL_FAMILIES)) == len(ALL_FAMILIES)
    assert REASONING and ICL


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", NEW)
def test_builds_deterministic_and_sized(family, layout):
    for seed in SEEDS:
        c = case(family, layout, seed)
        again = case(family, layout, seed)
        assert (c.prefix, c.chunks, c.suffix, c.answer) == (again.prefix, again.chunks, again.suffix, again.answer)
        assert len(c.chunks) == 4 and all(c.chunks) and c.answer
        assert c.kind in ("number", "word")
        # the plus segments together come near the asked context length (chat wraps each in a turn)
        assert 900 <= c.context_tokens <= 1024 * 1.6
    assert len({case(family, layout, s).answer + decode(case(family, layout, s).suffix) for s in SEEDS}) > 1


@pytest.mark.parametrize("ctx", [2048, 4096])  # characters here: ICL turns are ~60 each
def test_length_scales_with_ctx(ctx):
    for family in NEW:
        assert 0.85 * ctx <= case(family, "rag", 0, ctx=ctx).context_tokens <= 1.25 * ctx


@pytest.mark.parametrize("layout", LAYOUTS)
def test_majority_docs(layout):
    for seed in SEEDS:
        c = case("majority_docs", layout, seed)
        counts: dict[str, int] = {}
        for city in re.findall(r"A shipment arrived in (\w+)\.", "".join(chunk_texts(c))):
            counts[city] = counts.get(city, 0) + 1
        assert len(counts) == 2 and max(counts, key=counts.__getitem__) == c.answer
        assert sorted(counts.values()) == [1, 3]
        # the answer's mentions sit in three different chunks: no chunk decides alone
        assert sum(f"arrived in {c.answer}." in t for t in chunk_texts(c)) == 3
        assert c.answer not in decode(c.prefix + c.suffix)  # the question does not name it


@pytest.mark.parametrize("layout", LAYOUTS)
def test_link_docs(layout):
    for seed in SEEDS:
        c = case("link_docs", layout, seed)
        texts = chunk_texts(c)
        person = c.meta["person"]
        assert person in decode(c.suffix)
        [city] = re.findall(rf"{person} moved to (\w+)\.", "".join(texts))
        [code] = re.findall(rf"The code of {city} is (\d+)\.", "".join(texts))
        assert code == c.answer and c.meta["distractor_code"] in "".join(texts)
        # the two hops are in different chunks
        hop1 = [j for j, t in enumerate(texts) if f"{person} moved to" in t]
        hop2 = [j for j, t in enumerate(texts) if f"The code of {city} is" in t]
        assert hop1 != hop2


def _examples(c) -> list[tuple[int, str, str]]:
    """(chunk, input, reply) of every example turn."""
    pat = r"<\|im_start\|>user\n(\w+)<\|im_end\|>\n<\|im_start\|>assistant\n(\w+)<\|im_end\|>\n"
    return [(j, x, y) for j, t in enumerate(chunk_texts(c)) for x, y in re.findall(pat, t)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", ICL)
def test_icl(family, layout):
    for seed in SEEDS:
        c = case(family, layout, seed, ctx=4096)
        ex = _examples(c)
        assert len(ex) > 50 and len({j for j, _, _ in ex}) == 4  # many shots, in every chunk
        assert "".join(decode(ch) for ch in c.chunks).count("<|im_start|>user") == len(ex)  # nothing else there
        query = re.fullmatch(r"<\|im_start\|>user\n(\w+)<\|im_end\|>\n<\|im_start\|>assistant\n", decode(c.suffix))
        assert query, decode(c.suffix)
        replies = {y for _, x, y in ex if x == query.group(1)}
        assert replies == {c.answer}  # the asked input appears, always with the answer
        mapping: dict[str, str] = {}
        for _, x, y in ex:
            assert mapping.setdefault(x, y) == y  # a consistent mapping
        if family == "icl_classify":
            assert set(mapping.values()) == set(CATEGORIES) and all(x in CATEGORIES[y] for x, y in mapping.items())


@pytest.mark.parametrize("family", NEW)
def test_scoring(family):
    c = case(family, "rag", 0)
    assert is_correct(f"The answer is {c.answer}.", c.answer, c.kind)
    assert is_correct(c.answer.upper() if c.kind == "word" else c.answer, c.answer, c.kind)
    wrong = "Nowhere" if c.kind == "word" else str(int(c.answer) + 1)
    assert not is_correct(f"The answer is {wrong}.", c.answer, c.kind)
    assert not is_correct(f"{c.answer}0", c.answer, c.kind)


def test_unknown_layout():
    with pytest.raises(ValueError):
        case(ICL[0], "essay", 0)
