"""spanserve: an LLM inference engine whose KV cache is reused beyond prompt prefixes."""
from spanserve.engine.config import EngineConfig
from spanserve.engine.layout import Segment
from spanserve.engine.outputs import RequestOutput
from spanserve.engine.params import SamplingParams
from spanserve.llm import LLM

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "Segment"]
