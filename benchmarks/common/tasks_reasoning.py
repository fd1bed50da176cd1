"""Task families beyond retrieval for the quality benchmark: aggregation over several documents and
many-shot in-context learning. tasks.py registers and lays them out and describes each family.

The aggregation families put each fact into a chunk of their choosing (no chunk holds enough to
answer), so they take n_chunks and return their sentences already cut into chunks. The ICL
families return their examples as conversation turns, cut into chunks like retrieval units.

SmolLM2-135M at 1024 context tokens in 4 chunks, 16 cases each, full attention (none): icl_classify
16 (9), icl_map 15 (8), but majority_docs 6 (8) and link_docs 7 (7), about chance. So were the
simpler aggregations tried first, answered with a constant or by position: how many times a
shipment arrived (2-4), which of two or three stated tower heights is largest, the sum of two
stated numbers (1-9 each).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol

REASONING = ("majority_docs", "link_docs")
ICL = ("icl_classify", "icl_map")

# Capitalized city names, each one token with its leading space in SmolLM2's tokenizer.
CITIES = ["Oslo", "Lima", "Cairo", "Paris", "Rome", "Berlin", "Madrid", "Tokyo", "Delhi", "Dublin", "Vienna",
          "Prague", "Athens", "Lisbon", "Warsaw", "Sydney", "Boston", "Denver", "Toronto", "Havana", "Manila", "Seoul"]
PEOPLE = ["Anna", "Peter", "Maria", "David", "Laura", "James", "Sofia", "Thomas"]
CATEGORIES = {
    "fruit": ["apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum"],
    "animal": ["tiger", "horse", "rabbit", "sheep", "mouse", "eagle", "zebra", "camel"],
    "color": ["red", "blue", "green", "yellow", "purple", "brown", "black", "white"],
    "tool": ["hammer", "wrench", "saw", "drill", "knife", "ladder", "shovel", "axe"]}
MAP_WORDS = ["river", "violet", "copper", "falcon", "maple", "harbor", "canyon", "silver", "meadow", "glacier",
             "orchid", "thunder", "cobalt", "walnut", "lantern", "marble"]


class Filler(Protocol):  # tasks._Builder
    encode: Callable[[str], list[int]]

    def filler(self, rng: random.Random, n_tokens: int) -> list[str]: ...


# (chunks of sentences | example turns, instruction, question, answer, meta), as tasks.Task
Parted = tuple[list[list[str]], str, str, str, dict[str, Any]]
Flat = tuple[list[str], str, str, str, dict[str, Any]]


def _spread(rng: random.Random, b: Filler, ctx: int, n_chunks: int, facts: list[str]) -> list[list[str]]:
    """n_chunks runs of filler, ctx / n_chunks tokens each with their facts; fact i goes into chunk
    order[i % n_chunks] of a random order (facts share a chunk only when there are more facts than
    chunks), at a random depth."""
    order = rng.sample(range(n_chunks), n_chunks)
    where = [order[i % n_chunks] for i in range(len(facts))]
    chunks = []
    for j in range(n_chunks):
        mine = [f for f, w in zip(facts, where) if w == j]
        sents = b.filler(rng, ctx // n_chunks - sum(len(b.encode(" " + f)) for f in mine))
        for f in mine:
            sents.insert(rng.randrange(len(sents) + 1), f)
        chunks.append(sents)
    return chunks


def majority_docs(rng: random.Random, b: Filler, ctx: int, n_chunks: int, times: int = 3) -> Parted:
    """"A shipment arrived in Oslo." `times` times, each in another chunk while chunks last, and once
    to another city; ask which city received the most shipments."""
    city, other = rng.sample(CITIES, 2)
    facts = [f"A shipment arrived in {city}."] * times + [f"A shipment arrived in {other}."]
    return (_spread(rng, b, ctx, n_chunks, facts),
            "Shipments to several cities are mentioned in the text below. Find the city that received the most shipments.",
            "Which city received the most shipments?", city, {"city": city, "other": other, "times": times})


def link_docs(rng: random.Random, b: Filler, ctx: int, n_chunks: int) -> Parted:
    """Two hops across chunks: "Anna moved to Oslo." in one, "The code of Oslo is 4821." in another,
    and a second person, city and code as a distractor; ask the code of the asked person's city."""
    person, other = rng.sample(PEOPLE, 2)
    cities = rng.sample(CITIES, 2)
    codes = [str(c) for c in rng.sample(range(1000, 10000), 2)]
    facts = [f"{p} moved to {c}." for p, c in zip((person, other), cities)]
    facts += [f"The code of {c} is {k}." for c, k in zip(cities, codes)]
    return (_spread(rng, b, ctx, n_chunks, facts),
            f"Find the city that {person} moved to, then find the code of that city.",
            f"What is the code of the city that {person} moved to?", codes[0],
            {"person": person, "city": cities[0], "distractor_code": codes[1]})


def exchange(x: str, y: str) -> str:
    """One ICL example as a user turn and the assistant's reply (tasks.py's chat template): SmolLM2-135M
    follows examples given as turns (14 of 16 under `full`), not as lines inside one message."""
    return f"<|im_start|>user\n{x}<|im_end|>\n<|im_start|>assistant\n{y}<|im_end|>\n"


def _examples(rng: random.Random, b: Filler, ctx: int, pairs: list[tuple[str, str]]) -> list[str]:
    """Example turns drawn from pairs, as many as fit ctx tokens, every pair at least once."""
    out, n = [], 0
    while n < ctx or len(out) < len(pairs):
        out.append(exchange(*(pairs[len(out)] if len(out) < len(pairs) else rng.choice(pairs))))
        n += len(b.encode(out[-1]))
    return rng.sample(out, len(out))


def icl_classify(rng: random.Random, b: Filler, ctx: int, per_class: int = 4) -> Flat:
    """per_class words of each of four categories (fruit, animal, color, tool), answered with their
    category; ask one of them."""
    pairs = [(w, cat) for cat, words in CATEGORIES.items() for w in rng.sample(words, per_class)]
    turns = _examples(rng, b, ctx, pairs)
    word, label = rng.choice(pairs)
    return turns, "Classify each word I send. Answer with the category only.", word, label, {"examples": len(turns)}


def icl_map(rng: random.Random, b: Filler, ctx: int, n_words: int = 6) -> Flat:
    """n_words words, each answered with its own made-up 2-digit number; ask one of them."""
    pairs = list(zip(rng.sample(MAP_WORDS, n_words), (str(v) for v in rng.sample(range(10, 100), n_words))))
    turns = _examples(rng, b, ctx, pairs)
    word, value = rng.choice(pairs)
    return (turns, "Each word I send has a fixed number. Answer with the number only.", word, value,
            {"mapping": dict(pairs), "examples": len(turns)})


PARTED: dict[str, Callable[..., Parted]] = {"majority_docs": majority_docs, "link_docs": link_docs}
GENERATORS: dict[str, Callable[..., Flat]] = {"icl_classify": icl_classify, "icl_map": icl_map}
KINDS = {"majority_docs": "word", "icl_classify": "word"}
