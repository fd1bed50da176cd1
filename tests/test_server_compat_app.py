"""Server options that need an app configured differently from the shared subprocess one:
--strict-params and --auth-all-routes, in-process (Starlette's TestClient runs the lifespan)."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from spanserve.engine.engine import LLMEngine
from spanserve.server.app import create_app
from spanserve.server.context import ServerConfig
from engine_helpers import make_engine
from test_server_harness import build_tiny_model

KEY = "sk-all-routes"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    path = build_tiny_model(tmp_path_factory.mktemp("tiny-compat-app") / "tiny")
    return make_engine(str(path), num_blocks=64, block_size=8)


@pytest.fixture(scope="module")
def strict(engine: LLMEngine) -> Iterator[TestClient]:
    config = ServerConfig(served_model_name="tiny", model_source="tiny", strict_params=True, api_key=KEY,
                          auth_all_routes=True)
    with TestClient(create_app(engine, config), raise_server_exceptions=False) as c:
        yield c


def test_strict_params_refuse_unknown_fields_by_name(strict: TestClient) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    r = strict.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 1, "best_of_luck": 1}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of_luck"
    assert r.json()["error"]["code"] == "unknown_parameter" and "--strict-params" in r.json()["error"]["message"]
    nested = strict.post("/v1/chat/completions", headers=auth, json={
        "messages": [{"role": "user", "content": "hi", "mood": "good"}], "max_tokens": 1})
    assert nested.status_code == 400 and nested.json()["error"]["param"] == "messages.0.mood"
    # every OpenAI field is still accepted
    ok = strict.post("/v1/chat/completions", headers=auth, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "reasoning_effort": "high",
        "store": True, "metadata": {"a": "b"}, "service_tier": "flex", "parallel_tool_calls": True})
    assert ok.status_code == 200, ok.text
    assert strict.post("/tokenize", headers=auth, json={"prompt": "x", "extra": 1}).json()["error"]["param"] == "extra"


def test_auth_all_routes_closes_health_and_metrics(strict: TestClient) -> None:
    for path in ("/health", "/metrics", "/openapi.json"):
        assert strict.get(path).status_code == 401
        assert strict.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_openapi_documents_request_bodies(strict: TestClient) -> None:
    doc = strict.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    fields = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"reasoning_effort", "max_completion_tokens", "logit_bias", "prompt_logprobs"} <= set(fields)


def _openai_fields(*typed_dicts: type) -> set[str]:
    import typing

    out: set[str] = set()
    for td in typed_dicts:
        out |= set(typing.get_type_hints(td))
    return out


def test_every_field_of_the_openai_schemas_is_declared() -> None:
    """The installed openai package's request TypedDicts are the reference: a field OpenAI adds
    shows up here as a failure rather than as an 'unknown parameter' warning in users' logs."""
    from openai.types import completion_create_params as cmpl
    from openai.types.chat import (chat_completion_assistant_message_param as assistant,
                                   chat_completion_content_part_param as part,
                                   chat_completion_content_part_text_param as text_part,
                                   chat_completion_function_message_param as function_msg,
                                   chat_completion_stream_options_param as stream_opts,
                                   chat_completion_tool_message_param as tool_msg,
                                   chat_completion_user_message_param as user_msg)
    from openai.types.chat import completion_create_params as chat

    from spanserve.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, ContentPart,
                                           StreamOptions)

    checks = [
        (ChatCompletionRequest, _openai_fields(chat.CompletionCreateParamsStreaming,
                                               chat.CompletionCreateParamsNonStreaming)),
        (CompletionRequest, _openai_fields(cmpl.CompletionCreateParamsStreaming,
                                           cmpl.CompletionCreateParamsNonStreaming)),
        (ChatMessage, _openai_fields(assistant.ChatCompletionAssistantMessageParam, user_msg.ChatCompletionUserMessageParam,
                                     tool_msg.ChatCompletionToolMessageParam,
                                     function_msg.ChatCompletionFunctionMessageParam)),
        (ContentPart, _openai_fields(text_part.ChatCompletionContentPartTextParam, part.File)),
        (StreamOptions, _openai_fields(stream_opts.ChatCompletionStreamOptionsParam)),
    ]
    for model, fields in checks:
        assert fields, model
        missing = fields - set(model.model_fields)
        assert not missing, f"{model.__name__} lacks OpenAI fields {sorted(missing)}"


def test_api_key_from_flag_or_environment() -> None:
    from spanserve.server.launch import API_KEY_ENV, resolve_api_key

    assert API_KEY_ENV == "SPANSERVE_API_KEY"
    assert resolve_api_key("sk-flag", {API_KEY_ENV: "sk-env"}) == "sk-flag"
    assert resolve_api_key(None, {API_KEY_ENV: "sk-env"}) == "sk-env"
    assert resolve_api_key(None, {API_KEY_ENV: ""}) is None and resolve_api_key(None, {}) is None
