"""Executor: runs a span query through the engine and returns the evaluated query (a closure).

Generations whose inputs are ready run together as one batch of engine requests; their results
are spliced into the tree (an inner conversation as its exact tokens, a bare generation as an
assistant message) and the next wave runs, until no generation is left. Seeds derive from each
generation's place in the tree, so a query's output does not depend on what was cached."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol, Sequence

import xxhash

from spanserve.engine.layout import Segment
from spanserve.engine.outputs import RequestOutput
from spanserve.engine.params import SamplingParams

from .ir import Assistant, Chat, Cross, Generate, Group, Message, Node, Par, Repeat, Retrieve, leaf_messages
from .optimize import optimize
from .plan import Done, Planner
from .reach import conversation_of


@dataclass
class Job:
    layout: list[Segment]
    params: SamplingParams
    policy: str | None


class Runner(Protocol):
    def run(self, jobs: list[Job]) -> list[RequestOutput]:
        """Run the jobs concurrently; outputs in job order."""


class EngineRunner:
    """Drives a synchronous LLMEngine until the batch is done."""

    def __init__(self, engine: Any, namespace: str = ""):
        self.engine = engine
        self.namespace = namespace

    def run(self, jobs: list[Job]) -> list[RequestOutput]:
        ids = []
        try:
            for j in jobs:
                ids.append(self.engine.add_request(j.layout, j.params, namespace=self.namespace,
                                                   policy=j.policy).request_id)
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]


@dataclass
class Outcome:
    """What execution left: the evaluated query, and every generation's engine output."""

    query: Node
    outputs: dict[tuple, RequestOutput]


class Executor:
    def __init__(self, runner: Runner, tokenizer: Any, *, policy: str | None = None, anchor: str = "none",
                 seed: int = 0, max_tokens: int = 256, temperature: float = 0.0, fan_in: int | None = None,
                 max_prompt_chars: int | None = None):
        self.runner = runner
        self.planner = Planner(tokenizer, anchor, max_prompt_chars)
        self.policy = policy
        self.seed = seed
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.fan_in = fan_in

    def prepare(self, query: Node) -> Node:
        return _expand(optimize(query, fan_in=self.fan_in))  # optimize bounds the expanded size

    def execute(self, query: Node) -> Outcome:
        tree = self.prepare(query)
        results: dict[tuple, Done] = {}
        outputs: dict[tuple, RequestOutput] = {}
        while True:
            ready: list[tuple[tuple, Generate]] = []
            tree = self._walk(tree, (), ready, results)
            if not ready:
                break
            jobs = [self._job(path, gen) for path, gen in ready]
            for (path, gen), out in zip(ready, self.runner.run(jobs)):
                outputs[path] = out
                results[path] = Done(tuple(out.prompt_token_ids), tuple(out.token_ids), out.text, gen.input)
            tree = self._walk(tree, (), [], results)
        return Outcome(_closure(tree), outputs)

    def execute_many(self, queries: Sequence[Node], order: str = "locality") -> list[Outcome]:
        """Run queries in an order that keeps those sharing fragments together (greedy nearest
        neighbour on shared messages), so a small cache serves each fragment while it is hot."""
        idx = locality_order(queries) if order == "locality" else list(range(len(queries)))
        outs = {i: self.execute(queries[i]) for i in idx}
        return [outs[i] for i in range(len(queries))]

    def _job(self, path: tuple, gen: Generate) -> Job:
        seed = xxhash.xxh64(repr((self.seed, path)).encode()).intdigest() % (2**63)
        params = SamplingParams(
            max_tokens=gen.max_tokens or self.max_tokens,
            temperature=self.temperature if gen.temperature is None else gen.temperature,
            seed=seed,
        )
        return Job(self.planner.layout(gen.input), params, gen.policy or self.policy)

    def _walk(self, node: Node, path: tuple, ready: list, results: dict[tuple, Done]) -> Node:
        """Splice finished generations in; collect the ones whose input is fully evaluated."""
        conv = conversation_of(node)
        gen = conv if conv is not None else (node if isinstance(node, Generate) else None)
        if gen is not None:
            if path in results:
                done = results[path]
                return done if conv is not None else Assistant(done.text)
            inner = self._walk(gen.input, path + ("in",), ready, results)
            gen = replace(gen, input=inner)
            if _evaluated(inner):
                ready.append((path, gen))
            return Cross(tuple(node.children[:-1]) + (gen,)) if conv is not None else gen
        if isinstance(node, (Chat, Retrieve)):
            raise ValueError(f"{type(node).__name__} must be desugared before execution (a Retrieve whose "
                             "question is generated is not supported yet)")
        if isinstance(node, Group):
            return type(node)(tuple(self._walk(c, path + (i,), ready, results) for i, c in enumerate(node.children)))
        return node


def _evaluated(node: Node) -> bool:
    if isinstance(node, (Message, Done)):
        return True
    if isinstance(node, Group):
        return all(_evaluated(c) for c in node.children)
    return False


def _expand(node: Node) -> Node:
    """Repeat(n, q) becomes n copies (each its own generations, so its own seeds), spliced into
    the enclosing group; a Repeat at the root becomes a Par."""
    if isinstance(node, Repeat):
        return Par(tuple(_expand(node.query) for _ in range(node.n)))
    if isinstance(node, Group):
        kids: list[Node] = []
        for c in node.children:
            if isinstance(c, Repeat):
                kids.extend(_expand(c.query) for _ in range(c.n))
            else:
                kids.append(_expand(c))
        return type(node)(tuple(kids))
    if isinstance(node, Generate):
        return replace(node, input=_expand(node.input))
    return node


def _closure(node: Node) -> Node:
    """The evaluated query in plain IR: a finished conversation is its input plus the answer."""
    if isinstance(node, Done):
        return Cross((_closure(node.input), Assistant(node.text)))
    if isinstance(node, Group):
        return type(node)(tuple(_closure(c) for c in node.children))
    return node


def locality_order(queries: Sequence[Node]) -> list[int]:
    frags = [{m for m in leaf_messages(q)} for q in queries]
    order: list[int] = []
    left = set(range(len(queries)))
    cur = None
    while left:
        nxt = min(left) if cur is None else max(sorted(left), key=lambda j: len(frags[j] & frags[cur]))
        order.append(nxt)
        left.remove(nxt)
        cur = nxt
    return order
