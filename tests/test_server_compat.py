"""OpenAI compatibility and access control end to end: a `spanserve serve --api-key` subprocess
on the tiny model, driven by the openai client with every field of OpenAI's request schemas, by
IBM's spnl client, and by raw httpx where the wire format matters."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import spnl

from test_server_harness import ServerProcess, build_tiny_model, run_server

MODEL = "tiny"
KEY = "sk-test-compat"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("compat")
    path = build_tiny_model(root / MODEL)
    # debug: the log lists the fields each request had ignored
    with run_server(str(path), root, "--kv-cache-memory", "4MiB", "--block-size", "8", "--served-model-name",
                    MODEL, "--api-key", KEY, "--log-level", "debug") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---------------------------------------------------------------------------- access


def test_key_required_everywhere_but_health(server: ServerProcess) -> None:
    routes = [("GET", "/v1/models", None), ("GET", "/metrics", None),
              ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
              ("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}),
              ("POST", "/v1/segments", {"segments": [{"text": "a doc"}]}), ("DELETE", "/v1/segments/k", None),
              ("POST", "/v1/query/execute", {"g": {"model": MODEL, "input": {"user": "hi"}, "max_tokens": 1}}),
              ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [5]})]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, server.url + path, json=body, headers=headers)
            err = error_of(r, 401)
            assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"].startswith("Bearer")
        ok = httpx.request(method, server.url + path, json=body, headers=AUTH)
        assert ok.status_code in (200, 404), (path, ok.text)  # 404: nothing pinned under "k"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_openai_client_with_and_without_key(server: ServerProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)


# ---------------------------------------------------------------------------- every field


CHAT_FIELDS: dict[str, Any] = dict(
    frequency_penalty=0.5, presence_penalty=0.3, logit_bias={"5": -100}, logprobs=True, top_logprobs=2,
    max_completion_tokens=5, max_tokens=7, metadata={"team": "search"}, modalities=["text"], n=2,
    parallel_tool_calls=False, prediction={"type": "content", "content": "hello"}, reasoning_effort="low",
    seed=7, service_tier="auto", stop=["zzz"], store=False, temperature=0.8, top_p=0.9, user="u-1",
    verbosity="low", prompt_cache_key="k", safety_identifier="s", tool_choice="none",
    function_call="none", prompt_cache_retention="24h", prompt_cache_options={"mode": "implicit"},
    response_format={"type": "text"},
)
COMPLETION_FIELDS: dict[str, Any] = dict(
    best_of=2, echo=False, frequency_penalty=0.5, logit_bias={"5": -100}, logprobs=2, max_tokens=5, n=2,
    presence_penalty=0.3, seed=7, stop="zzz", suffix=None, temperature=0.8, top_p=0.9, user="u-1",
)


def test_chat_with_every_openai_field(server: ServerProcess, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, **CHAT_FIELDS)  # type: ignore[arg-type]
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.logprobs is not None and c.logprobs.content is not None
        assert len(c.logprobs.content) <= 5  # max_completion_tokens wins over max_tokens
        assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert r.usage is not None and r.usage.completion_tokens <= 10
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,  # type: ignore[call-overload]
                                            stream_options={"include_usage": True, "include_obfuscation": False},
                                            **CHAT_FIELDS)
    chunks = list(stream)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 10
    log = server.log_text()
    for field in ("metadata", "store", "service_tier", "reasoning_effort", "user"):
        assert field in log.split("accepted and ignored:")[-1], field


def test_completion_with_every_openai_field(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, **COMPLETION_FIELDS)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.logprobs is not None and len(c.logprobs.tokens or []) <= 5 for c in r.choices)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **COMPLETION_FIELDS))
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    texts = ["", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert all(isinstance(t, str) for t in texts)


def test_unknown_fields_are_ignored_with_a_warning(server: ServerProcess, http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "frobnicate": 1,
                                           "stream_options": {"include_usage": True, "shiny": 2}})
    assert r.status_code == 200, r.text
    assert "ignoring parameters outside the OpenAI schema: frobnicate, stream_options.shiny" in server.log_text()
    nested = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}],
        "max_tokens": 1})
    assert nested.status_code == 200 and "messages.0.content.0.cache_control" in server.log_text()


@pytest.mark.parametrize("route, extra, param", [
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"moderation": {"model": "omni"}}, "moderation"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages.0.content.0"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logit_bias": {"99999": 5}}, "logit_bias"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"logit_bias": {"five": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": None, "segments": [{"text": "doc", "kind": "plus"}, {"text": "q"}],
                         "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_refusals_name_the_field(http: httpx.Client, route: str, extra: dict[str, Any], param: str) -> None:
    base: dict[str, Any] = {"max_tokens": 2}
    base["messages" if "chat" in route else "prompt"] = MESSAGES if "chat" in route else PROMPT
    err = error_of(http.post(route, json={**base, **extra}), 400)
    assert err["param"] == param, err


def test_null_means_default(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "n": None, "stream": None,
                                                "logprobs": None, "temperature": None, "stop": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


# ---------------------------------------------------------------------------- what the fields do


def greedy(client: openai.OpenAI, **kw: Any) -> list[str]:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True, **kw.pop("extra_body", {})}, **kw)
    assert r.choices[0].logprobs is not None
    return list(r.choices[0].logprobs.tokens or [])


def test_logit_bias_forces_and_bans(client: openai.OpenAI, http: httpx.Client) -> None:
    tokens = http.post("/tokenize", json={"prompt": " the"}).json()["tokens"]
    forced = greedy(client, logit_bias={str(tokens[0]): 100})
    assert forced == [" the"] * 6
    plain = greedy(client)
    first = http.post("/tokenize", json={"prompt": plain[0]}).json()["tokens"][0]
    assert greedy(client, logit_bias={str(first): -100})[0] != plain[0]


def test_penalties_change_a_greedy_decode(client: openai.OpenAI) -> None:
    plain = greedy(client)
    assert greedy(client, frequency_penalty=2.0, presence_penalty=2.0) != plain or len(set(plain)) == len(plain)
    assert greedy(client, extra_body={"repetition_penalty": 100.0}) != plain


def test_echo_and_prompt_logprobs(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1,
                                  extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    c = r.choices[0]
    assert c.text.startswith(PROMPT) and len(c.text) > len(PROMPT)
    lp = c.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    plp = c.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):  # the same scores, in vLLM's shape
        entry = plp[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(lp.token_logprobs[i]) and entry["rank"] >= 1
    # max_tokens 0 with echo: the prompt scored, nothing generated
    z = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    assert z.choices[0].text == PROMPT and z.usage is not None and z.usage.completion_tokens == 0
    assert z.choices[0].logprobs is not None and z.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in streamed) == c.text


def test_chat_prompt_logprobs(client: openai.OpenAI, http: httpx.Client) -> None:
    count = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,  # type: ignore[arg-type]
                                       extra_body={"prompt_logprobs": 0})
    assert r.usage is not None and r.usage.prompt_tokens == count
    plp = r.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(plp) == count and plp[0] is None and all(len(e) == 1 for e in plp[1:])


def test_tokenize_detokenize(http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert http.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    strs = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()["token_strs"]
    assert "".join(strs) == PROMPT
    error_of(http.post("/tokenize", json={"prompt": "x", "messages": MESSAGES}), 400)
    error_of(http.post("/detokenize", json={"tokens": [10**9]}), 400)
    error_of(http.post("/tokenize", json={"model": "other", "prompt": "x"}), 404)


# ---------------------------------------------------------------------------- spnl


def test_spnl_client(server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """IBM's spnl (Rust, async-openai) sends its real chat requests, reasoning_effort included."""
    monkeypatch.setenv("OPENAI_API_BASE", f"{server.url}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    query = {"g": {"model": f"openai/{MODEL}", "max_tokens": 4, "temperature": 0,
                   "input": {"seq": [{"system": "be brief"}, {"user": "hello"}]}}}
    before = server.log_text().count("reasoning_effort")
    out = asyncio.run(spnl.execute(json.dumps(query)))
    assert isinstance(out.data, str)
    assert server.log_text().count("reasoning_effort") > before
