"""engine/upload.py: host values reach the device unchanged (the GPU test
tests/gpu/test_gpu_sampling.py checks that sampling uploads without a sync)."""
import numpy as np
import torch

from spanserve.engine.upload import row_index, upload


def test_upload_keeps_values_and_dtype() -> None:
    cpu = torch.device("cpu")
    assert torch.equal(upload([0.5, 2.0], torch.float32, cpu), torch.tensor([0.5, 2.0]))
    assert torch.equal(upload(np.array([3, 1], dtype=np.int64), torch.long, cpu), torch.tensor([3, 1]))
    idx = row_index([], cpu)
    assert idx.dtype == torch.long and idx.numel() == 0
