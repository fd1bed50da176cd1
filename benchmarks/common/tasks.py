"""Synthetic long-context tasks for the quality benchmark, generated from a seed (nothing downloaded):
retrieval in the style of RULER and the SparseX appendix, multi-document aggregation and many-shot
in-context learning (tasks_reasoning.py), each laid out two ways:

  rag   [cross: system + user instruction] [plus: document chunk] x n [cross: question + assistant header]
  chat  [cross: system + first exchange (instruction)] [plus: one user/assistant turn per chunk] x n
        [cross: question turn + assistant header]

The plus segments (document chunks, history turns) are what a server would cache once and reuse; the
context is cut into them at sentence/line boundaries, each about ctx_tokens / n_chunks tokens long.
The instruction names what to find (query first) and the question repeats it at the end.

Families (answer kind):
  single_needle   one "The special magic number is N." in filler text; ask N             (number)
  multi_key       four "The special magic number for KEY is N." in filler; ask one KEY's N (number)
  kv_retrieval    only lines "key 7f3a: value 4821"; ask one key's value                (number)
  var_tracking    two chains "VAR A = 48213. VAR B = A. VAR C = B." in filler, different
                  values; ask the last variable of one of them                         (number)
  frequent_words  lines of common words, one of them markedly more frequent; ask it    (word)

REASONING: aggregation over documents; the facts sit in different chunks, none holds the answer alone.
  majority_docs   "A shipment arrived in Oslo." three times, each in another chunk, and once to
                  another city; ask which city received the most shipments              (word)
  link_docs       "Anna moved to Oslo." and "The code of Oslo is 4821." in different chunks,
                  and another person, city and code; ask the code of Anna's city         (number)

ICL: many-shot in-context learning. The context is example exchanges, a user turn holding an
input and the assistant's turn its answer, as many as fit, every chunk a run of them; the
question is the next user turn (one of the inputs shown). rag gives the instruction in the system
message, chat as a first exchange; neither names the input to be asked.
  icl_classify    16 words of four categories, each answered fruit, animal, color or tool;
                  ask one of them                                                       (word)
  icl_map         six words, each answered with its own made-up 2-digit number; ask one  (number)

FAMILIES keeps the five retrieval families (the benchmark's default); ALL_FAMILIES adds the others.
"""
from __future__ import annotations

import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spanserve.engine.layout import Segment

from . import tasks_reasoning
from .tasks_reasoning import ICL, PARTED, REASONING

FAMILIES = ("single_needle", "multi_key", "kv_retrieval", "var_tracking", "frequent_words")  # retrieval
ALL_FAMILIES = FAMILIES + REASONING + ICL
LAYOUTS = ("rag", "chat")

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
USER = "<|im_start|>user\n"
END = "<|im_end|>\n"
ASSISTANT = "<|im_start|>assistant\n"

# Filler: varied, meaningless-but-grammatical sentences (RULER's essay/noise haystacks, generated).
_SUBJECTS = ["The farmer", "A young student", "The old sailor", "My neighbour", "The baker", "A tired traveller",
             "The teacher", "Our guide", "The painter", "A quiet child", "The mayor", "The gardener"]
_VERBS = ["walked to", "looked at", "talked about", "painted", "cleaned", "visited", "remembered", "carried",
          "described", "waited near", "found", "repaired"]
_OBJECTS = ["the red barn", "a small boat", "the village market", "an old bridge", "the green hills",
            "a wooden table", "the river bank", "a broken clock", "the town library", "a basket of apples",
            "the stone wall", "a long road"]
_TAILS = ["in the morning", "after lunch", "on a rainy day", "before sunset", "with a friend", "without a word",
          "during the summer", "late at night", "for a while", "once again", "in silence", "with great care"]

_KEY_WORDS = ["apple", "river", "tiger", "violet", "copper", "falcon", "maple", "harbor", "lemon", "canyon",
              "silver", "meadow", "pepper", "glacier", "orchid", "thunder", "cobalt", "walnut", "lantern", "marble"]
_COMMON_WORDS = ["house", "water", "stone", "cloud", "bread", "chair", "light", "grass", "paper", "music",
                 "horse", "table", "green", "window", "garden", "forest", "candle", "bottle", "pencil", "mirror",
                 "basket", "bridge", "island", "ticket", "wallet", "button", "ladder", "carpet", "kettle", "rabbit"]


@dataclass
class Case:
    family: str
    layout: str  # "rag" | "chat"
    index: int
    prefix: list[int]  # the leading cross segment
    chunks: list[list[int]]  # the plus segments
    suffix: list[int]  # the trailing cross segment (question + generation prompt)
    answer: str
    kind: str  # "number" | "word"
    meta: dict[str, Any] = field(default_factory=dict)

    def segments(self, anchor: str = "none") -> list[Segment]:
        return ([Segment(token_ids=self.prefix)] + [Segment(token_ids=c, kind="plus", anchor=anchor) for c in self.chunks]
                + [Segment(token_ids=self.suffix)])

    @property
    def context_tokens(self) -> int:
        return sum(len(c) for c in self.chunks)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prefix) + self.context_tokens + len(self.suffix)


# ---- scoring ---------------------------------------------------------------------------------
def normalize(text: str) -> str:
    text = text.lower().translate(str.maketrans({c: " " for c in string.punctuation}))
    return " ".join(text.split())


def is_correct(output: str, answer: str, kind: str) -> bool:
    """The answer appears in the output as a whole number (number) or a whole word (word), after
    lower-casing and turning punctuation into spaces ("The value of key 3c34 is 5288." is right
    for 5288; "52880" or "3c34" is not)."""
    words = normalize(output.replace(",", "") if kind == "number" else output).split()
    return answer.lower() in words


# ---- text generators ---------------------------------------------------------------------------
def _filler_sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def _with_inserts(rng: random.Random, filler: list[str], inserts: list[str], ordered: bool = False) -> list[str]:
    """Put each insert at a random depth of the filler (keeping their order if `ordered`)."""
    n = len(filler) + 1
    spots = sorted(rng.sample(range(n), len(inserts))) if ordered else [rng.randrange(n) for _ in inserts]
    out = list(filler)
    for pos, s in sorted(zip(spots, inserts), key=lambda x: x[0], reverse=True):  # back to front
        out.insert(pos, s)
    return out


class _Builder:
    """Fills sentences up to a token budget (measured with the real tokenizer)."""

    def __init__(self, encode: Callable[[str], list[int]]):
        self.encode = encode

    def filler(self, rng: random.Random, n_tokens: int) -> list[str]:
        out, n = [], 0
        while n < n_tokens:
            s = _filler_sentence(rng)
            out.append(s)
            n += len(self.encode(" " + s))
        return out


# Each generator returns (context units, instruction, question, answer, meta). The instruction (the
# leading cross segment) already names what to look for: SmolLM2-135M, checked under `full`, gets
# key-value retrieval mostly wrong when the key is asked only after the list (2 of 8) and mostly right
# when it is also named before it (7 of 8). That also makes the documents' encoding depend on
# text outside them, which is exactly what span reuse loses and recomputation has to restore.
Task = tuple[list[str], str, str, str, dict]


def single_needle(rng: random.Random, b: _Builder, ctx: int) -> Task:
    n = _number(rng, 5)
    needle = f"The special magic number is {n}."
    sents = _with_inserts(rng, b.filler(rng, ctx - len(b.encode(" " + needle))), [needle])
    return (sents, "A special magic number is hidden in the text below. Find the special magic number.",
            "What is the special magic number in the text?", n, {"depth": round(sents.index(needle) / len(sents), 3)})


def multi_key(rng: random.Random, b: _Builder, ctx: int, n_keys: int = 4) -> Task:
    keys = rng.sample(_KEY_WORDS, n_keys)
    nums = [_number(rng, 5) for _ in keys]
    needles = [f"The special magic number for {k} is {v}." for k, v in zip(keys, nums)]
    budget = ctx - sum(len(b.encode(" " + s)) for s in needles)
    sents = _with_inserts(rng, b.filler(rng, budget), needles)
    i = rng.randrange(n_keys)
    return (sents, f"Special magic numbers are hidden in the text below. Find the special magic number for {keys[i]}.",
            f"What is the special magic number for {keys[i]}?", nums[i], {"keys": keys, "asked": keys[i]})


def kv_retrieval(rng: random.Random, b: _Builder, ctx: int) -> Task:
    """Only "key 7f3a: value 4821" lines, as many as fit ctx tokens (4-hex-digit keys, 4-digit values)."""
    lines, seen, n = [], set(), 0
    while n < ctx:
        k = "".join(rng.choice("0123456789abcdef") for _ in range(4))
        if k in seen or k.isdigit():
            continue
        seen.add(k)
        line = f"key {k}: value {_number(rng, 4)}"
        lines.append(line)
        n += len(b.encode(line + "\n"))
    i = rng.randrange(len(lines))
    k, v = re.fullmatch(r"key (\w+): value (\d+)", lines[i]).groups()  # type: ignore[union-attr]
    return (lines, f"Below is a list of keys and their values. Find the value of key {k}.",
            f"What is the value of key {k}?", v, {"depth": round(i / len(lines), 3), "lines": len(lines)})


def _var_names(rng: random.Random, n: int) -> list[str]:
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice(string.ascii_uppercase) for _ in range(3)))
    return sorted(names, key=lambda _: rng.random())


def var_tracking(rng: random.Random, b: _Builder, ctx: int, hops: int = 2) -> Task:
    """Two chains "VAR A = 48213. VAR B = A. VAR C = B." (each written in one place, at random
    depths): the asked one and a distractor with another value; ask the asked chain's last variable.
    (Chains spread sentence by sentence through the filler, SmolLM2-135M gets 2 of 8 under `full`.)"""
    names = _var_names(rng, 2 * (hops + 1))
    value, other = (str(v) for v in rng.sample(range(10000, 100000), 2))

    def chain(vs: list[str], v: str) -> str:
        return " ".join([f"VAR {vs[0]} = {v}."] + [f"VAR {vs[j]} = {vs[j - 1]}." for j in range(1, len(vs))])

    main, distract = chain(names[: hops + 1], value), chain(names[hops + 1:], other)
    budget = ctx - sum(len(b.encode(" " + s)) for s in (main, distract))
    sents = _with_inserts(rng, b.filler(rng, budget), [main, distract])
    last = names[hops]
    return (sents, f"Read the text below and find the value of VAR {last}.", f"What is the value of VAR {last}?",
            value, {"chain": names[: hops + 1], "distractor_value": other})


def frequent_words(rng: random.Random, b: _Builder, ctx: int, n_vocab: int = 8, weight: float = 8.0) -> Task:
    """Lines of 10 words drawn from n_vocab common words, the target `weight` times as likely as each
    other word."""
    vocab = rng.sample(_COMMON_WORDS, n_vocab)
    weights = [weight] + [1.0] * (len(vocab) - 1)
    lines, n = [], 0
    while n < ctx:
        line = " ".join(rng.choices(vocab, weights, k=10)) + "."
        lines.append(line)
        n += len(b.encode(" " + line))
    words = " ".join(lines).replace(".", "").split()
    counts = {w: words.count(w) for w in vocab}
    target = max(vocab, key=lambda w: counts[w])  # the target, barring a (rare) upset by sampling
    return (lines, "Read the list of words below and find the word that appears most often.",
            "Which word appears most often in the list?", target, {"counts": counts})


GENERATORS: dict[str, Callable[..., Task]] = {
    "single_needle": single_needle, "multi_key": multi_key, "kv_retrieval": kv_retrieval,
    "var_tracking": var_tracking, "frequent_words": frequent_words, **tasks_reasoning.GENERATORS}
KINDS = {"frequent_words": "word", **tasks_reasoning.KINDS}
# What joins a chunk's units: a space for prose, a newline for lists.
SEPARATORS = {"kv_retrieval": "\n", **{f: "" for f in ICL}}  # ICL turns end in a newline
ANSWER_HINT = {"number": "Answer with the number only.", "word": "Answer with one word only."}


# ---- layouts -----------------------------------------------------------------------------------
def _pack(units: list[str], lengths: list[int], n_chunks: int) -> list[list[str]]:
    """Cut a run of sentences (with their token lengths) into n_chunks runs of about equal length."""
    total = sum(lengths)
    chunks: list[list[str]] = [[]]
    done = 0
    for u, n in zip(units, lengths):
        if len(chunks) < n_chunks and done >= total * len(chunks) / n_chunks:
            chunks.append([])
        chunks[-1].append(u)
        done += n
    return [c for c in chunks if c]


def _layout(layout: str, instruction: str, texts: list[str], ask: str) -> tuple[str, list[str], str]:
    """Prefix, chunks and suffix text of a case of documents (see the module docstring)."""
    if layout == "rag":
        # One user message: instruction, the document chunks (each a newline-ended paragraph), question.
        return SYSTEM + USER + instruction + "\n\n", [t + "\n" for t in texts], "\n" + ask + END + ASSISTANT
    # A conversation: the user announces the text and the task, sends it one part per turn (the
    # assistant acknowledging each), then asks.
    prefix = (SYSTEM + USER + f"I will send you a text in {len(texts)} parts. {instruction}" + END
              + ASSISTANT + "OK, send the text." + END)
    chunks = [USER + f"Part {j + 1}:\n{t}" + END + ASSISTANT + "Got it." + END for j, t in enumerate(texts)]
    return prefix, chunks, USER + ask + END + ASSISTANT


def _icl_layout(layout: str, instruction: str, texts: list[str], query: str) -> tuple[str, list[str], str]:
    """Prefix, chunks and suffix text of an ICL case: the chunks are runs of example turns, the
    question the next user turn; rag gives the instruction in the system message, chat as a first
    exchange."""
    if layout == "rag":
        prefix = SYSTEM.replace(END, f" {instruction}{END}")
    else:
        prefix = SYSTEM + USER + instruction + END + ASSISTANT + "OK." + END
    return prefix, texts, USER + query + END + ASSISTANT


def make_case(family: str, layout: str, index: int, seed: int, encode: Callable[[str], list[int]],
              ctx_tokens: int, n_chunks: int) -> Case:
    """One case; ctx_tokens is the approximate context length in tokens, cut into n_chunks plus segments."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    rng = random.Random(f"{seed}/{family}/{layout}/{index}")
    if family in PARTED:  # the generator puts facts into chunks of its choosing
        parts, instruction, question, answer, meta = PARTED[family](rng, _Builder(encode), ctx_tokens, n_chunks)
    else:
        sents, instruction, question, answer, meta = GENERATORS[family](rng, _Builder(encode), ctx_tokens)
        parts = _pack(sents, [len(encode(" " + s)) for s in sents], n_chunks)
    kind = KINDS.get(family, "number")
    texts = [SEPARATORS.get(family, " ").join(p) for p in parts]
    if family in ICL:  # the instruction already says how to answer
        prefix, chunks, suffix = _icl_layout(layout, instruction, texts, question)
    else:
        prefix, chunks, suffix = _layout(layout, instruction, texts, f"{question} {ANSWER_HINT[kind]}")
    return Case(family, layout, index, encode(prefix), [encode(c) for c in chunks], encode(suffix), answer, kind, meta)


def make_cases(families: list[str], n_per_family: int, seed: int, encode: Callable[[str], list[int]],
               ctx_tokens: int, n_chunks: int, layouts: tuple[str, ...] = LAYOUTS) -> list[Case]:
    """n_per_family cases per family; the layouts alternate (case i gets layouts[i % len])."""
    return [make_case(f, layouts[i % len(layouts)], i, seed, encode, ctx_tokens, n_chunks)
            for f in families for i in range(n_per_family)]
