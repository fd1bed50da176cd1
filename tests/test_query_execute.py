"""Planner and executor over the engine (tiny model): judge/generator reuse and closures."""
import pytest

from spanserve import LLM
from spanserve.engine.layout import resolve
from spanserve.query import Assistant, Cross, assistant, cross, g, plus, repeat, system, user
from spanserve.query.execute import EngineRunner, Executor, locality_order
from spanserve.query.ir import iter_nodes
from spanserve.query.plan import Done, Planner
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("q"))[0])


def _judge():
    inner = g(user("hello world the cat sat on the mat"), temperature=0.5, max_tokens=13)
    return g(cross(system("the cat"), plus(repeat(4, inner)), user("dog ran?")), max_tokens=8)


def test_judge_reads_inner_conversations_from_cache_and_matches_a_cold_run(path):
    llm = LLM(path, block_size=4, num_blocks=1024)
    llm.generate("the dog sat on the mat", )  # unrelated cache state
    out = Executor(EngineRunner(llm.engine), llm.tokenizer, max_tokens=12).execute(_judge())
    inner = [o for p, o in out.outputs.items() if p]
    judge = out.outputs[()]
    assert len(inner) == 4
    assert judge.metrics["reuse"]["segment"] >= sum(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in inner)
    fresh = LLM(path, block_size=16, num_blocks=1024)
    cold = Executor(EngineRunner(fresh.engine), fresh.tokenizer, max_tokens=12).execute(_judge())
    assert cold.outputs[()].token_ids == judge.token_ids
    assert [cold.outputs[p].token_ids for p in out.outputs] == [o.token_ids for o in out.outputs.values()]
    # sampling at temperature 0.5 with per-generation seeds: the four inner answers differ
    assert len({tuple(o.token_ids) for o in inner}) > 1


def test_result_is_a_query_closure(path):
    llm = LLM(path, block_size=4, num_blocks=1024)
    res = Executor(EngineRunner(llm.engine), llm.tokenizer, max_tokens=6).execute(_judge()).query
    assert isinstance(res, Assistant)
    q = g(cross(system("a"), plus(g(user("the cat"), max_tokens=3), user("dog")), user("?")), max_tokens=3)
    res = Executor(EngineRunner(llm.engine), llm.tokenizer).execute(cross(user("x"), q)).query
    assert not any(type(n).__name__ in ("Generate", "Done") for n in iter_nodes(res))
    assert isinstance(res, Cross) and isinstance(res.children[-1], Assistant)


def test_planner_renders_messages_position_independently(path):
    llm = LLM(path, block_size=4, num_blocks=64)
    pl = Planner(llm.tokenizer)
    a = pl.layout(cross(system("s"), plus(user("doc one"), user("doc two")), user("q")))
    b = pl.layout(cross(system("s"), plus(user("doc two"), user("doc one")), user("q")))
    assert [s.kind for s in a] == ["cross", "plus", "plus", "cross", "cross"]
    assert list(a[1].token_ids) == list(b[2].token_ids) and list(a[2].token_ids) == list(b[1].token_ids)
    done = Done((5, 6, 7), (8, 9), "x", user("u"))
    c = pl.layout(cross(system("s"), plus(done), user("q")))
    assert list(c[1].token_ids) == [5, 6, 7, 8, 9] and c[1].anchor == "none"
    whole = [t for p in resolve(a, llm.engine.encode, "none") for t in p.tokens]
    rendered = llm.tokenizer.apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "doc one"},
         {"role": "user", "content": "doc two"}, {"role": "user", "content": "q"}],
        tokenize=False, add_generation_prompt=True)
    assert whole == llm.engine.encode(rendered)


def test_locality_order_clusters_shared_fragments():
    docs = [user(f"doc {i}") for i in range(6)]
    qs = [g(plus(docs[0], docs[1])), g(plus(docs[4], docs[5])), g(plus(docs[1], docs[2])),
          g(plus(docs[5], docs[3])), g(plus(docs[2], docs[0]))]
    order = locality_order(qs)
    assert order[0] == 0 and set(order[:3]) == {0, 2, 4}
