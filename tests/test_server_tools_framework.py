"""An agent framework, unmodified, against `spanserve serve` (a subprocess, tiny noise model
behind SmolLM2's tokenizer, --tool-call-parser hermes): LangChain's ChatOpenAI with bind_tools
makes a call, gets the tool's answer back and answers, whole and streamed."""
from __future__ import annotations

from collections.abc import Iterator

import jsonschema
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

from spanserve.model.loader import load_tokenizer
from structured_helpers import build_tiny_smollm2
from test_server_harness import ServerProcess, run_server
from tool_helpers import TOOLS, schema_of


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("framework")
    path = build_tiny_smollm2(root / "tiny", load_tokenizer("smollm2"))
    with run_server(str(path), root, "--served-model-name", "tiny", "--kv-cache-memory", "8MiB",
                    "--tool-call-parser", "hermes") as srv:
        yield srv


def test_start_up_log_names_the_choice(server: ServerProcess) -> None:
    assert ("chat template: hermes (shipped); tool calling: hermes parser (--tool-call-parser; the model's "
            "template renders no tools, so spanserve's is used)") in server.log_text()


def test_langchain_bind_tools(server: ServerProcess) -> None:
    llm = ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key="unused", max_tokens=120, temperature=1.0,
                     seed=5, max_retries=0)
    agent = llm.bind_tools(TOOLS, tool_choice="get_weather")
    history: list = [HumanMessage("What is the weather in Oslo?")]
    ai = agent.invoke(history)
    assert isinstance(ai, AIMessage) and len(ai.tool_calls) == 1, ai
    call = ai.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], schema_of(TOOLS, "get_weather"))
    # streamed, the chunks add up to the same call
    streamed = None
    for chunk in agent.stream(history):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None and [(c["name"], c["args"]) for c in streamed.tool_calls] == [
        (call["name"], call["args"])]
    history += [ai, ToolMessage("Cloudy, 8 degrees.", tool_call_id=call["id"])]
    short = ChatOpenAI(model="tiny", base_url=f"{server.url}/v1", api_key="unused", max_tokens=8, max_retries=0)
    answer = short.bind_tools(TOOLS, tool_choice="none").invoke(history)
    assert isinstance(answer, AIMessage) and answer.content and not answer.tool_calls
    assert answer.response_metadata["finish_reason"] == "length"
