import os

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter. Set before any test module imports them:
# @triton.jit reads it when a kernel is defined, and tests/gpu's modules are collected first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A redis-server of this module's own (each xdist worker starts its own)."""
    from redis_server import RedisServer  # here: the GPU machine runs tests/gpu without redis

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()
