"""Triton attention backend for CUDA (and Triton's CPU interpreter in tests).

- kernels.py: the Triton kernels (every step);
- launch.py: the launch description of general steps (eager steps; step graphs, on the host);
- decode_launch.py: the launch description of decode-only steps, from host arrays (decode graphs);
- graph_buffers.py: packed fixed-address buffers (both kinds of graph);
- graph_decode.py: decode graphs' buffers, one set per batch size;
- graph_step.py: step graphs' padded shapes and buffers;
- dense.py: fresh prompt rows through torch's fused attention (eager steps);
- backend.py: TritonBackend, which launches what a description asks for.
Which path a step and each of its rows take is decided in `spanserve/attention/paths.py`.
"""
from spanserve.attention.triton.backend import (
    DECODE,
    PREFILL,
    LaunchConfig,
    TritonBackend,
    reposition_blocks,
    write_kv,
)

__all__ = ["DECODE", "PREFILL", "LaunchConfig", "TritonBackend", "reposition_blocks", "write_kv"]
