"""Host values to the device without waiting for it.

A list turned into a device tensor (`torch.tensor(values, device=cuda)`, or indexing a device
tensor with a list) is copied from pageable memory and then waits for every kernel queued on the
stream: a chained decode step's sampling would wait for its own forward pass, and the host could
not prepare the next step meanwhile. From pinned memory the copy is queued behind that work and
the host goes on."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def upload(values: Sequence[float] | Sequence[int] | np.ndarray, dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """`values` as a tensor of `dtype` on `device`, copied without a sync."""
    host = torch.as_tensor(np.asarray(values), dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def row_index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """Row numbers as an int64 index on `device` (for index_select / index_copy_)."""
    return upload(rows, torch.long, device)
