"""Triton attention backend for CUDA (and Triton's CPU interpreter in tests)."""
from spanserve.attention.triton.backend import (
    DECODE,
    PREFILL,
    LaunchConfig,
    TritonBackend,
    reposition_blocks,
    write_kv,
)

__all__ = ["DECODE", "PREFILL", "LaunchConfig", "TritonBackend", "reposition_blocks", "write_kv"]
