"""Shared pieces of the structured-output tests: a tiny random Llama that speaks through
SmolLM2's real tokenizer (49152 tokens), and a seeded generator of JSON schemas."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

WORDS = ("name", "city", "count", "score", "tags", "owner", "status", "size", "meta", "items", "flag", "level")
ENUM_VALUES: tuple[Any, ...] = ("red", "green", "blue", "on sale", 1, 42, None)


def build_tiny_smollm2(path: Path, tokenizer: Any) -> Path:
    """A 2-layer random Llama with SmolLM2's vocabulary and tokenizer, as a HF directory: its
    output is noise, so only the grammar can make it well formed."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema whose properties are all required; strings, arrays and nesting are
    bounded so that any valid instance is short (a noise model must be able to finish one)."""
    n = rng.randint(1, 4 if depth == 0 else 2)
    props = {f"{rng.choice(WORDS)}_{i}": _value(rng, depth) for i in range(n)}
    schema: dict[str, Any] = {"type": "object", "properties": props, "required": list(props)}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        if rng.random() < 0.4:
            return {"type": "string", "pattern": rng.choice(["^[a-z]{2,6}$", "^[A-Z][0-9]{3}$", "^(yes|no)$"])}
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "integer":
        out: dict[str, Any] = {"type": "integer"}
        if rng.random() < 0.5:
            out.update(minimum=rng.randint(-20, 0), maximum=rng.randint(1, 500))
        return out
    if kind == "number":
        return {"type": "number"}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(ENUM_VALUES, rng.randint(1, 4))}
    if kind == "array":
        items = _value(rng, 2)  # depth 2: scalars, enums or arrays of them, never objects
        return {"type": "array", "items": items, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth + 1)


def json_schema_format(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def streamed_text(r: Any, chat: bool) -> tuple[str, str | None]:
    """The text and finish reason of a streamed response."""
    text, reason = "", None
    for line in r.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            text += (choice["delta"].get("content") or "") if chat else choice["text"]
            reason = choice.get("finish_reason") or reason
    return text, reason


def schema_output(client: Any, route: str, stream: bool, schema: dict[str, Any], seed: int) -> tuple[str, str | None]:
    """One request constrained to `schema` over the chat or completions route, streamed or not:
    its text and finish reason."""
    body: dict[str, Any] = {"max_tokens": 300, "seed": seed, "stream": stream,
                            "response_format": json_schema_format(schema)}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "Give me the record as JSON."}]
    else:
        body["prompt"] = "Record as JSON:"
    url = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    if stream:
        with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            return streamed_text(r, route == "chat")
    r = client.post(url, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return (choice["message"]["content"] if route == "chat" else choice["text"]), choice["finish_reason"]
