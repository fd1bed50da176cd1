"""Structured output (response_format) through the engine and the sampler.

The model is a tiny random Llama behind SmolLM2's real tokenizer: its tokens are noise, so every
well-formed output is the grammar's doing. Outputs are checked by `json` and `jsonschema`, and
every generated token is replayed through a fresh matcher, independently of the engine's."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar
from structured_helpers import build_tiny_smollm2, json_schema_format, random_schema

from spanserve.engine.engine import LLMEngine
from spanserve.engine.params import SamplingParams
from spanserve.engine.sampling import Sampler, make_generator
from spanserve.engine.structured import (
    Grammars,
    JsonFormat,
    ResponseFormatError,
    TokenMask,
    apply_bitmask,
    parse_response_format,
)
from spanserve.model.loader import load_tokenizer
from engine_helpers import make_engine
from structured_helpers import build_tiny_smollm2, json_schema_format, random_schema

N_SCHEMAS = 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_smollm2(tmp_path_factory.mktemp("structured") / "tiny-smollm2", load_tokenizer("smollm2"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLMEngine:
    return make_engine(str(model_dir), num_blocks=512, block_size=16)


def run(engine: LLMEngine, requests: list[tuple[str, SamplingParams]]) -> dict[str, Any]:
    ids = [engine.add_request(prompt, params).request_id for prompt, params in requests]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.grammars.live == 0  # every matcher freed with its request
    return {rid: finals[rid] for rid in ids}


def replay(engine: LLMEngine, fmt: dict[str, Any], tokens: list[int]) -> bool:
    """Whether a fresh matcher accepts every token (an independent check of the engine's masks)."""
    matcher = xgrammar.GrammarMatcher(engine.grammars.compile(parse_response_format(fmt)))
    return all(matcher.accept_token(t) for t in tokens)


def test_random_schemas_hold_on_a_noise_model(engine: LLMEngine) -> None:
    rng = random.Random(1234)
    schemas = [random_schema(rng) for _ in range(N_SCHEMAS)]
    for s in schemas:
        jsonschema.Draft202012Validator.check_schema(s)
    requests = [(f"Answer in JSON, request {i}:", SamplingParams(max_tokens=400, seed=i,
                                                                  response_format=json_schema_format(s)))
                for i, s in enumerate(schemas)]
    # unconstrained rows share the batch: their logits must stay untouched
    requests += [("plain text", SamplingParams(max_tokens=8, seed=99, ignore_eos=True))]
    outs = list(run(engine, requests).values())
    for schema, (_, params), out in zip(schemas, requests, outs):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
        assert replay(engine, params.response_format, out.token_ids)
    assert len(outs[-1].token_ids) == 8
    assert engine.pool.num_free == engine.pool.num_blocks  # no block held by a finished request


def test_json_object_is_one_object(engine: LLMEngine) -> None:
    # Free-form keys and strings have no length bound: a noise model ends some objects within
    # the budget and not others; the ones it ends must parse, the others must be valid prefixes.
    fmt = {"type": "json_object"}
    outs = run(engine, [("{", SamplingParams(max_tokens=60, seed=s, response_format=fmt)) for s in range(8)])
    ended = [o for o in outs.values() if o.finish_reason == "stop"]
    assert ended
    for out in ended:
        assert isinstance(json.loads(out.text), dict)
    for out in outs.values():
        assert out.text.startswith("{") and replay(engine, fmt, out.token_ids)


def test_greedy_and_ignore_eos_stop_when_the_grammar_ends(engine: LLMEngine) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = json_schema_format(schema)
    outs = run(engine, [("x", SamplingParams(max_tokens=50, temperature=0.0, response_format=fmt)),
                        ("x", SamplingParams(max_tokens=50, seed=3, ignore_eos=True, response_format=fmt))])
    for out in outs.values():
        assert out.finish_reason == "stop" and out.stop_reason is None
        jsonschema.validate(json.loads(out.text), schema)
        assert out.token_ids[-1] in engine.eos_token_ids  # the grammar's only way out


def test_too_few_tokens_ends_with_length_and_a_prefix(engine: LLMEngine) -> None:
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 40, "maxLength": 60}},
              "required": ["story"]}
    fmt = json_schema_format(schema)
    out, = run(engine, [("x", SamplingParams(max_tokens=6, seed=0, response_format=fmt))]).values()
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert out.text.startswith('{"story":"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)
    assert replay(engine, fmt, out.token_ids)


def test_preemption_feeds_each_token_once(model_dir: Path) -> None:
    # 12 blocks of 4 slots for 4 growing requests: the scheduler must preempt and recompute
    small = make_engine(str(model_dir), num_blocks=12, block_size=4)
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(4)]
    requests = [("hi", SamplingParams(max_tokens=40, seed=i, response_format=json_schema_format(s)))
                for i, s in enumerate(schemas)]
    outs = list(run(small, requests).values())
    assert small.counters["preemptions"] > 0
    for schema, (_, params), out in zip(schemas, requests, outs):
        assert replay(small, params.response_format, out.token_ids)
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
    assert small.pool.num_free == small.pool.num_blocks


def test_unsatisfiable_schema_ends_instead_of_sampling_from_nothing(engine: LLMEngine) -> None:
    schema = {"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]}
    outs = run(engine, [("x", SamplingParams(max_tokens=30, seed=s, response_format=json_schema_format(schema)))
                        for s in range(2)])
    for out in outs.values():
        assert out.finish_reason == "stop" and out.token_ids[-1] in engine.eos_token_ids


def test_abort_frees_the_matcher(engine: LLMEngine) -> None:
    req = engine.add_request("x", SamplingParams(max_tokens=50, response_format={"type": "json_object"}))
    engine.step()
    assert engine.grammars.live == 1
    engine.abort(req.request_id)
    assert engine.grammars.live == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("fmt, says", [
    ({"type": "xml"}, "response_format.type"),
    ("json", "response_format must be an object"),
    ({"type": "json_schema"}, "response_format.json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}, "json_schema.name"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "json_schema.strict"),
])
def test_bad_shapes_are_refused_by_sampling_params(fmt: Any, says: str) -> None:
    with pytest.raises(ResponseFormatError, match=says) as e:
        SamplingParams(response_format=fmt)
    assert e.value.param == "response_format"


@pytest.mark.parametrize("schema, says", [
    ({"type": "objekt"}, "Unsupported type"),
    ({"type": "object", "properties": 5}, "properties must be an object"),
    ({"type": "string", "pattern": "[a-"}, "Unclosed"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
])
def test_unusable_schemas_are_refused_at_admission(engine: LLMEngine, schema: dict[str, Any], says: str) -> None:
    with pytest.raises(ResponseFormatError, match=f"response_format.*{says}"):
        engine.add_request("x", SamplingParams(response_format=json_schema_format(schema)))
    assert engine.grammars.live == 0 and not engine.has_unfinished() and not engine.requests


def test_text_format_is_unconstrained() -> None:
    assert parse_response_format({"type": "text"}) is None and parse_response_format(None) is None
    assert parse_response_format({"type": "json_object"}) == JsonFormat(None)


# ---- the sampler's masking against dense references ----------------------------------------


def random_bitmask(gen: torch.Generator, rows: int, vocab: int, density: float) -> torch.Tensor:
    allowed = torch.rand(rows, vocab, generator=gen) < density
    allowed[:, 0] = True  # never an empty row
    return pack(allowed)


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """[B, V] bool -> [B, ceil(V/32)] int32, written bit by bit (the obvious form)."""
    rows, vocab = allowed.shape
    words = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int64)
    for b, v in allowed.nonzero().tolist():
        words[b, v // 32] |= 1 << (v % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def test_bitmask_application_matches_a_per_token_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32
    allowed = torch.rand(5, vocab, generator=gen) < 0.3
    bitmask = pack(allowed)
    logits = torch.randn(5, vocab, generator=gen)
    expected = logits.clone()
    for b in range(5):
        for v in range(vocab):
            if not allowed[b, v]:
                expected[b, v] = float("-inf")
    ours = logits.clone()
    apply_bitmask(ours, bitmask)
    assert torch.equal(ours, expected)
    rows = [0, 2, 3]
    partial = TokenMask(rows, bitmask).applied(logits)
    assert torch.equal(partial[rows], expected[rows])
    assert torch.equal(partial[[1, 4]], logits[[1, 4]])  # unconstrained rows untouched


def test_masked_sampling_equals_sampling_the_masked_logits() -> None:
    gen = torch.Generator().manual_seed(1)
    batch, vocab = 6, 777
    logits = torch.randn(batch, vocab, generator=gen) * 3
    bitmask = random_bitmask(gen, batch, vocab, 0.05)
    rows = [0, 1, 3, 4, 5]
    masked = TokenMask(rows, bitmask).applied(logits)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=1.0, seed=2), SamplingParams(temperature=1.3, top_k=5, seed=3),
              SamplingParams(temperature=0.7, min_p=0.1, seed=4), SamplingParams(temperature=1.0, seed=5)]
    sampler = Sampler()
    for trial in range(20):
        gens = [make_generator(None if p.seed is None else p.seed + 100 * trial) for p in params]
        ref_gens = [make_generator(None if p.seed is None else p.seed + 100 * trial) for p in params]
        got, _ = sampler(logits, params, gens, mask=TokenMask(rows, bitmask))
        want, _ = sampler(masked, params, ref_gens)
        assert got == want
        for b in rows:
            assert (int(bitmask[b, got[b] // 32]) >> (got[b] % 32)) & 1


def test_logprobs_report_the_unmasked_model() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 300, generator=gen)
    bitmask = random_bitmask(gen, 1, 300, 0.1)
    tok, lps = Sampler()(logits, [SamplingParams(temperature=0.0, logprobs=0)], [None], mask=TokenMask([0], bitmask))
    assert lps[0] is not None
    assert lps[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[tok[0]]))


def test_grammars_need_a_tokenizer() -> None:
    with pytest.raises(ResponseFormatError, match="tokenizer"):
        Grammars(None, 10, {0}).compile(JsonFormat(None))


def test_python_api(model_dir: Path) -> None:
    from spanserve.llm import LLM

    llm = LLM(str(model_dir), num_blocks=64)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "rank"], "additionalProperties": False}
    out, = llm.generate("Best city?", SamplingParams(max_tokens=40, seed=0, response_format=json_schema_format(schema)))
    jsonschema.validate(json.loads(out.text), schema)
    bad = json_schema_format({"type": "objekt"})
    with pytest.raises(ResponseFormatError):  # the first prompt was queued: it is aborted, matcher and all
        llm.generate(["a", "b"], [SamplingParams(response_format={"type": "json_object"}),
                                  SamplingParams(response_format=bad)])
    assert llm.engine.grammars.live == 0 and not llm.engine.has_unfinished()
