"""spanserve.model.gemv (the batch-1 matrix-vector kernel) against a float64 product, on CPU
through Triton's interpreter (chosen before triton is first imported)."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from spanserve.model.gemv import GemvConfig, fits, gemv, linear  # noqa: E402

CFGS = [GemvConfig(2, 256, 4, 2), GemvConfig(4, 128, 4, 1), GemvConfig(1, 64, 2, 2)]


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("seed", range(3))
def test_matches_a_float64_product_on_random_shapes(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    N = int(torch.randint(1, 70, (1,), generator=g))  # rows not a multiple of block_n
    K = cfg.block_k * int(torch.randint(1, 4, (1,), generator=g))
    w, x = torch.randn(N, K, generator=g), torch.randn(1, K, generator=g)
    y = gemv(x, w, cfg)
    want = x.double() @ w.double().t()
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    # a row's result does not depend on the rows around it: a shard's rows are the whole's, bit for bit
    cut = N // 2 + 1
    assert torch.equal(gemv(x, w[cut:].contiguous(), cfg), y[:, cut:])


def test_linear_takes_the_kernel_only_for_what_it_fits():
    x, w = torch.randn(1, 1024), torch.randn(8, 1024)
    assert not fits(x, w)  # a CPU tensor (and float32): F.linear
    torch.testing.assert_close(linear(x, w), x @ w.t())
    assert not fits(torch.randn(2, 1024), w)  # two rows
    assert not fits(torch.randn(1, 1000), torch.randn(8, 1000))  # K not a whole number of tiles
