"""The grammar pool of an API server: a format compiled once is served again without a worker
(agents send the same tools every turn), refusals are kept too, and a compile worker that
cannot start is a 503 that says so, not a 500."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from spanserve.engine.structured import ResponseFormatError
from spanserve.server.errors import APIError
from spanserve.server.grammars import GrammarPool
from spanserve.server.limits import RequestLimits
from test_server_harness import build_tiny_model

SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
OTHER = {"type": "json_schema", "json_schema": {"name": "b", "schema": {
    "type": "object", "properties": {"y": {"type": "string"}}, "required": ["y"]}}}
REFUSED = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "object", "minProperties": "x"}}}


def test_kept_grammars_and_a_broken_compiler(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_tiny_model(tmp_path / "tiny")))
    pool = GrammarPool(tok, len(tok), [tok.eos_token_id], RequestLimits(grammar_workers=1))
    try:
        first = asyncio.run(pool(SCHEMA))
        assert first and asyncio.run(pool(SCHEMA)) == first
        with pytest.raises(ResponseFormatError) as refused:
            asyncio.run(pool(REFUSED))
        # From here on no worker can start: what was compiled or refused before is still answered.
        pool._payload = b"not a pickle"
        for w in list(pool._all):
            pool._drop(w)
        assert asyncio.run(pool(SCHEMA)) == first
        with pytest.raises(ResponseFormatError) as again:
            asyncio.run(pool(REFUSED))
        assert str(again.value) == str(refused.value)
        with pytest.raises(APIError) as e:
            asyncio.run(pool(OTHER))
        assert e.value.status == 503 and e.value.code == "grammar_compiler_unavailable"
        assert "response_format" in e.value.message
    finally:
        pool.close()
