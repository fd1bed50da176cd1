"""The real default model behind the API: one short chat request (slow-ish: the GGUF load)."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest

from test_server_harness import run_server


def test_smollm2_chat(tmp_path: Path) -> None:
    # No --model: the default must be the embedded SmolLM2, served under the name "smollm2".
    with run_server(None, tmp_path, "--kv-cache-memory", "64MiB", timeout=300) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        r = client.chat.completions.create(model="smollm2", max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        text = r.choices[0].message.content or ""
        assert r.usage is not None and 0 < r.usage.completion_tokens <= 8
        assert text.strip(), r
        assert "KV pool:" in srv.log_text() and "blocks" in srv.log_text()
