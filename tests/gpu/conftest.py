"""GPU tests: each skips where CUDA is missing, or where a test marked `gpus(n)` finds fewer than
n GPUs. `pytest tests/gpu` on a GPU machine runs them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_helpers import LLAMA3_8B, release

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpus(n): the test needs at least n CUDA GPUs")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        marker = item.get_closest_marker("gpus")
        need = marker.args[0] if marker else 1
        if found < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {found}"))


@pytest.fixture(scope="module")
def model_8b():
    """Random Llama-3-8B-shaped bf16 weights on the GPU, shared by a module's engines."""
    from spanserve.model.weights import RandomWeights

    model = RandomWeights(LLAMA3_8B, seed=0).whole(torch.bfloat16, torch.device("cuda"))
    yield model
    del model
    release()
