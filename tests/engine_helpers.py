"""LLMEngine for tests, from the keyword arguments LLM(...) takes, on the CPU in float32 unless a
test says otherwise: the tests compare against float32 references whatever the machine has."""
from __future__ import annotations

from typing import Any

from spanserve.engine.config import EngineConfig
from spanserve.engine.engine import LLMEngine


def make_engine(model: Any, **options: Any) -> LLMEngine:
    return LLMEngine(EngineConfig.from_kwargs(model=model, **{"device": "cpu", "dtype": "float32", **options}))
