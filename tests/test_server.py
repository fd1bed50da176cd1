"""The HTTP API end to end: a `spanserve serve` subprocess on the tiny model, driven by the
real openai client (and raw httpx where the client would hide the wire format)."""
from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from test_server_harness import ServerProcess, build_tiny_model, metric, run_server

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("server")
    path = build_tiny_model(root / MODEL)
    with run_server(str(path), root, "--kv-cache-memory", "4MiB", "--block-size", "8") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def metrics(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/metrics").text


def wait_idle(server: ServerProcess, timeout: float = 10.0) -> str:
    """Metrics text once nothing runs or waits and every block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        text = metrics(server)
        idle = metric(text, "spanserve_requests_running") == 0 and metric(text, "spanserve_requests_waiting") == 0
        if idle and metric(text, "spanserve_kv_blocks_free") == metric(text, "spanserve_kv_blocks_total"):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"server did not go idle:\n{text}")
        time.sleep(0.05)


# ---------------------------------------------------------------------------- happy paths


def test_models_and_health(server: ServerProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_completion_shape_and_usage(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage is not None and r.usage.completion_tokens <= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_token_id_prompt_and_batch(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, n=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage is not None and r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    # Greedy samples of the same prompt agree.
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text == r.choices[3].text


def test_chat_completion(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                       max_completion_tokens=6, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.usage is not None and 0 < r.usage.completion_tokens <= 6


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12

    messages = [{"role": "user", "content": "tell me"}]
    ckw = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    chat_full = client.chat.completions.create(**ckw).choices[0].message.content  # type: ignore[call-overload]
    stream = list(client.chat.completions.create(stream=True, **ckw))  # type: ignore[call-overload]
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == chat_full
    assert stream[-1].choices[0].finish_reason == "length"


def test_sse_wire_format(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[6:])["object"] == "text_completion"


def test_cached_tokens_on_repeated_long_prefix(client: openai.OpenAI) -> None:
    prefix = " ".join(["The capital of France is Paris."] * 12)
    first = client.completions.create(model=MODEL, prompt=prefix + " One", max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prefix + " Two", max_tokens=2)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens >= 48
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert details.cached_tokens >= second.usage.prompt_tokens // 2
    # A different cache salt is a different tenant: nothing is shared with it.
    salted = client.completions.create(model=MODEL, prompt=prefix + " Two", max_tokens=2,
                                       extra_body={"cache_salt": "tenant-b"})
    assert salted.usage is not None and salted.usage.prompt_tokens_details is not None
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_stop_sequences(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    candidates = [text[i:i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i:i + 2]]
    assert candidates, f"greedy text too short to pick a stop string from: {text!r}"
    stop = candidates[len(candidates) // 2]
    r = client.completions.create(stop=[stop], **kw)  # type: ignore[call-overload]
    assert r.choices[0].text == text[:text.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(stop=stop, stream=True, **kw)  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in streamed) == text[:text.find(stop)]


def test_seed_reproducibility_and_n(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)  # type: ignore[call-overload]
    b = client.completions.create(**kw)  # type: ignore[call-overload]
    assert a.choices[0].text == b.choices[0].text
    two = client.completions.create(n=2, **kw)  # type: ignore[call-overload]
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == a.choices[0].text  # choice 0 keeps the request's own seed
    assert two.choices[1].text != two.choices[0].text  # derived seed: a different sample
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                          max_tokens=4, seed=5)
    assert [c.index for c in chat.choices] == [0, 1]


def test_logprobs_shapes(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs or []) == len(lp.top_logprobs) == 6
    for tok, top in zip(lp.tokens, lp.top_logprobs):
        # Top 3 plus the sampled token; fewer when distinct ids decode to the same string (the
        # legacy format keys by text), e.g. partial UTF-8 byte tokens that all read U+FFFD.
        assert tok in top and len(top) <= 4
    assert lp.text_offset is not None and lp.text_offset[0] == 0

    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob

    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, logprobs=True, stream=True,
                                              extra_body={"ignore_eos": True})
    n = sum(len(ch.choices[0].logprobs.content or []) for ch in streamed if ch.choices and ch.choices[0].logprobs)
    assert n == 5


def test_stop_token_ids(client: openai.OpenAI) -> None:
    # Every id is a stop id, so whatever the model samples first ends the request.
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10,
                                  extra_body={"ignore_eos": True, "stop_token_ids": list(range(400))})
    assert r.usage is not None and r.usage.completion_tokens == 1
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].model_extra.get("stop_reason"), int)  # type: ignore[union-attr]


# ---------------------------------------------------------------------------- errors


def error_of(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    return err


def test_bad_json_is_400(server: ServerProcess) -> None:
    for route in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(f"{server.url}{route}", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
        assert "JSON" in str(error_of(r, 400)["message"])


def test_wrong_types_are_400(server: ServerProcess) -> None:
    cases = [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": 12}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT, "n": True}, "n"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ]
    for route, body, param in cases:
        err = error_of(httpx.post(f"{server.url}{route}", json=body), 400)
        assert str(err["param"]).startswith(param), err


def test_bad_values_are_400(server: ServerProcess) -> None:
    for body in ({"prompt": PROMPT, "temperature": -1}, {"prompt": PROMPT, "top_p": 0},
                 {"prompt": PROMPT, "logprobs": 99}, {"prompt": ""}, {"prompt": [999999]},
                 {"prompt": PROMPT, "stop": [""]}, {"prompt": PROMPT, "logit_bias": {"x": 1}},
                 {"prompt": PROMPT, "frequency_penalty": 2.5}, {"prompt": PROMPT, "n": 0}):
        error_of(httpx.post(f"{server.url}/v1/completions", json=body), 400)


def test_unknown_model_is_404(server: ServerProcess, client: openai.OpenAI) -> None:
    err = error_of(httpx.post(f"{server.url}/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])


def test_prompt_too_long_is_400(server: ServerProcess, client: openai.OpenAI) -> None:
    long = " ".join(["The quick brown fox jumps over the lazy dog."] * 200)
    err = error_of(httpx.post(f"{server.url}/v1/completions", json={"prompt": long}), 400)
    assert err["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10_000)


def test_unknown_route_is_404(server: ServerProcess) -> None:
    assert error_of(httpx.get(f"{server.url}/v1/nothing"), 404)["code"] == "unknown_route"
    error_of(httpx.get(f"{server.url}/v1/completions"), 405)


# ---------------------------------------------------------------------------- disconnects, metrics


def test_disconnect_mid_stream_frees_blocks(server: ServerProcess) -> None:
    wait_idle(server)
    before = metrics(server)
    aborted = 'spanserve_requests_finished_total{reason="abort"}'
    body = {"model": MODEL, "prompt": PROMPT * 4, "max_tokens": 400, "stream": True, "ignore_eos": True}
    # Disconnected right after the first token: the engine core (a process of its own) is far
    # from its 400th, so the request is aborted. On a loaded machine the core may still finish
    # all 400 before the disconnect reaches it; then the request ended by length, and it is sent
    # again.
    length = 'spanserve_requests_finished_total{reason="length"}'

    def count(text: str, name: str) -> float:
        return metric(text, name) if name in text else 0

    for _ in range(3):
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        after = wait_idle(server)
        if count(after, aborted) > count(before, aborted):
            break
        assert count(after, length) == count(before, length) + 1
        before = after
    assert count(after, aborted) == count(before, aborted) + 1

    # A non-streaming request whose client gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=0.3)
    wait_idle(server)


def test_metrics_exposition(server: ServerProcess, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    text = wait_idle(server)
    for name in ("spanserve_kv_blocks_free", "spanserve_kv_blocks_used", "spanserve_kv_blocks_cached",
                 "spanserve_kv_blocks_total", "spanserve_requests_running", "spanserve_requests_waiting",
                 "spanserve_preemptions_total", "spanserve_prompt_tokens_total", "spanserve_generation_tokens_total"):
        metric(text, name)
    for kind in ("prefix", "perforated", "segment", "computed"):
        assert f'spanserve_prompt_tokens_by_reuse_total{{kind="{kind}"}}' in text
    assert metric(text, "spanserve_time_to_first_token_seconds_count") > 0
    assert metric(text, "spanserve_inter_token_latency_seconds_count") > 0
    assert metric(text, "spanserve_kv_blocks_cached") > 0


def test_sse_events_survive_splitlines_readers() -> None:
    from spanserve.server.streaming import sse

    text = "a\u2028b\u2029c\x85d\ne\rf"
    event = sse(json.dumps({"text": text}, ensure_ascii=False)).decode()
    lines = event.splitlines()
    assert lines[1:] == [""] and json.loads(lines[0][len("data: "):]) == {"text": text}
