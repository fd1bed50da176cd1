"""Token ids picked on the device on their way to the host, for steps chained on the device."""
from __future__ import annotations

import torch


class HostTokens:
    """Token ids picked on the device (and any tensors that go with them) on their way to the
    host: the copies are queued behind the step that picks them, and `lists` waits for them only
    when the host needs them."""

    def __init__(self, ids: torch.Tensor, *extra: torch.Tensor):
        self.device_ids = ids
        self._done: torch.cuda.Event | None = None
        self._host = [ids, *extra]
        if ids.is_cuda:
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (ids, *extra)]
            for h, t in zip(self._host, (ids, *extra)):
                h.copy_(t, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()

    def lists(self) -> list[list]:
        """The ids, then each extra tensor, as lists."""
        if self._done is not None:
            self._done.synchronize()
        return [t.tolist() for t in self._host]

    def rows(self, index: list[int]) -> torch.Tensor:
        """The picks of these rows, in this order, on the device."""
        if index == list(range(self.device_ids.numel())):
            return self.device_ids
        return self.device_ids[torch.tensor(index, dtype=torch.long, device=self.device_ids.device)]
