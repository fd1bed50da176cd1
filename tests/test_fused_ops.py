"""spanserve.model.fused against the eager ops of spanserve.model.layers and spanserve.rope, on CPU
through Triton's interpreter.

The interpreter is chosen before triton is first imported: the flag is read at import time."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from spanserve.model import fused  # noqa: E402
from spanserve.model.layers import rms_norm  # noqa: E402
from spanserve.rope import Rotary, apply_rotary  # noqa: E402

HIDDEN = 576  # SmolLM2-135M: not a power of two
H, KVH, D = 9, 3, 64
INTER = 1536
EPS = 1e-5
TS = [1, 7, 33]
BF16 = torch.bfloat16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def _qkv(g: torch.Generator, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as the model has them: views split out of one fused projection output."""
    qkv = _randn(g, T, (H + 2 * KVH) * D, dtype=dtype)
    q, k, _ = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    return q.view(T, H, D), k.view(T, KVH, D)


def _cos_sin(g: torch.Generator, T: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = Rotary(D, 10000.0, None, torch.device("cpu"))
    return rotary.cos_sin(torch.randint(0, 8192, (T,), generator=g), dtype)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _check_bf16(fused_out: torch.Tensor, eager_out: torch.Tensor, ref32: torch.Tensor) -> None:
    """bf16 results: close to the float32 computation on the same inputs, and no further from it
    than the eager bf16 op (which rounds at least as often)."""
    assert fused_out.dtype == BF16
    err_fused, err_eager = _rel(fused_out, ref32), _rel(eager_out, ref32)
    assert err_fused <= 1e-2
    assert err_fused <= err_eager * 1.02 + 1e-6, (err_fused, err_eager)


def _frac_equal(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


@pytest.mark.parametrize("T", TS)
def test_rms_norm_float32(T: int) -> None:
    g = _gen(100 + T)
    x, w = _randn(g, T, HIDDEN), _randn(g, HIDDEN)
    out = fused.rms_norm(x, w, EPS)
    assert out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out, rms_norm(x, w, EPS), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", TS)
def test_rms_norm_bfloat16(T: int) -> None:
    g = _gen(200 + T)
    x, w = _randn(g, T, HIDDEN, dtype=BF16), _randn(g, HIDDEN, dtype=BF16)
    out, eager = fused.rms_norm(x, w, EPS), rms_norm(x, w, EPS)
    _check_bf16(out, eager, rms_norm(x.float(), w.float(), EPS))
    # Same two roundings as eager: only a rare tie broken by summation order may differ.
    assert _frac_equal(out, eager) >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_rms_norm_strided_views(dtype: torch.dtype) -> None:
    """Per-head norms (Qwen3 q_norm/k_norm) over q/k views, and a row-strided 2-D view."""
    g = _gen(300)
    T = 7
    q, k = _qkv(g, T, dtype)
    wq, wk = _randn(g, D, dtype=dtype), _randn(g, D, dtype=dtype)
    wide = _randn(g, T, HIDDEN + 40, dtype=dtype)
    w = _randn(g, HIDDEN, dtype=dtype)
    for x, wt in ((q, wq), (k, wk), (wide[:, 3:3 + HIDDEN], w)):
        assert not x.is_contiguous()
        out = fused.rms_norm(x, wt, EPS)
        assert out.shape == x.shape and out.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(out, rms_norm(x, wt, EPS), rtol=1e-5, atol=1e-6)
        else:
            _check_bf16(out, rms_norm(x, wt, EPS), rms_norm(x.float(), wt.float(), EPS))


def test_rms_norm_mixed_weight_dtype() -> None:
    """bf16 activations with a float32 weight promote like the eager `weight * normed`."""
    g = _gen(350)
    x, w = _randn(g, 7, HIDDEN, dtype=BF16), _randn(g, HIDDEN)
    out, eager = fused.rms_norm(x, w, EPS), rms_norm(x, w, EPS)
    assert out.dtype == eager.dtype == torch.float32
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("T", TS)
def test_add_rms_norm(T: int, dtype: torch.dtype) -> None:
    g = _gen(400 + T)
    # x as a row-strided view, the way an output projection might hand it over.
    x = _randn(g, T, HIDDEN + 8, dtype=dtype)[:, :HIDDEN]
    residual, w = _randn(g, T, HIDDEN, dtype=dtype), _randn(g, HIDDEN, dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, summed = fused.add_rms_norm(x, residual, w, EPS)
    expected_sum = residual + x
    assert torch.equal(summed, expected_sum)  # one add, rounded once, exactly as torch does it
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    assert out.is_contiguous() and summed.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(out, rms_norm(expected_sum, w, EPS), rtol=1e-5, atol=1e-6)
    else:
        eager = rms_norm(expected_sum, w, EPS)
        _check_bf16(out, eager, rms_norm(expected_sum.float(), w.float(), EPS))
        assert _frac_equal(out, eager) >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("T", TS)
def test_rotary(T: int, dtype: torch.dtype) -> None:
    g = _gen(500 + T)
    q, k = _qkv(g, T, dtype)
    cos, sin = _cos_sin(g, T, dtype)
    for x in (q, k):
        assert T == 1 or not x.is_contiguous()  # torch ignores the stride of a size-1 dim
        out = fused.rotary(x, cos, sin)
        assert out.shape == x.shape and out.is_contiguous() and out.dtype == dtype
        ref32 = apply_rotary(x.float(), cos.float(), sin.float())
        if dtype == torch.float32:
            torch.testing.assert_close(out, apply_rotary(x, cos, sin), rtol=1e-5, atol=1e-6)
        else:
            _check_bf16(out, apply_rotary(x, cos, sin), ref32)
            # float32 math rounded once: round-to-nearest-even of the float32 result.
            assert _frac_equal(out, ref32.to(BF16)) >= 0.99


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("T", TS)
def test_silu_mul(T: int, dtype: torch.dtype) -> None:
    g = _gen(600 + T)
    gate_up = _randn(g, T, 2 * INTER + 16, dtype=dtype)[:, 16:]  # row-strided view
    out = fused.silu_mul(gate_up)
    assert out.shape == (T, INTER) and out.is_contiguous() and out.dtype == dtype
    gate, up = gate_up.chunk(2, dim=-1)
    gate32, up32 = gate_up.float().chunk(2, dim=-1)
    ref32 = F.silu(gate32) * up32
    if dtype == torch.float32:
        torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    else:
        _check_bf16(out, F.silu(gate) * up, ref32)
        assert _frac_equal(out, ref32.to(BF16)) >= 0.99


@pytest.mark.parametrize("T", TS)
def test_quantizing_forms_are_their_outputs_quantized(T: int) -> None:
    """With quant=True the norms and the SiLU hand an FP8 projection its rows already quantized:
    the same bytes and scales as quantizing their bf16 outputs with the activation kernel."""
    from spanserve.model import fp8_kernels
    from spanserve.model.fp8 import Fp8Rows

    g = _gen(650 + T)
    w = _randn(g, HIDDEN, dtype=BF16)
    x, r = _randn(g, T, HIDDEN, dtype=BF16) * 3, _randn(g, T, HIDDEN, dtype=BF16)
    x[0] = -r[0]  # a zero sum: an all-zero normed row, scale 1
    gate_up = _randn(g, T, 2 * INTER + 16, dtype=BF16)[:, 16:]
    cases = [(fused.rms_norm(x, w, EPS, quant=True), fused.rms_norm(x, w, EPS)),
             (fused.add_rms_norm(x, r, w, EPS, quant=True)[0], fused.add_rms_norm(x, r, w, EPS)[0]),
             (fused.silu_mul(gate_up, quant=True), fused.silu_mul(gate_up))]
    assert torch.equal(fused.add_rms_norm(x, r, w, EPS, quant=True)[1], fused.add_rms_norm(x, r, w, EPS)[1])
    for rows, dense in cases:
        assert isinstance(rows, Fp8Rows) and rows.dtype == BF16 and rows.shape == dense.shape
        q, s = fp8_kernels.quantize_rows(dense)
        assert torch.equal(rows.scale, s)
        assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    assert cases[1][0].scale[0].item() == 1.0 and not cases[1][0].q[0].float().any()


def test_empty_batch() -> None:
    g = _gen(700)
    w = _randn(g, HIDDEN)
    x = torch.empty(0, HIDDEN)
    assert fused.rms_norm(x, w, EPS).shape == (0, HIDDEN)
    out, summed = fused.add_rms_norm(x, torch.empty(0, HIDDEN), w, EPS)
    assert out.shape == summed.shape == (0, HIDDEN)
    q, _ = _qkv(g, 0, torch.float32)
    cos, sin = _cos_sin(g, 0, torch.float32)
    assert fused.rotary(q, cos, sin).shape == (0, H, D)
    assert fused.silu_mul(torch.empty(0, 2 * INTER)).shape == (0, INTER)
    assert fused.silu_mul(torch.empty(0, 2 * INTER), quant=True).q.shape == (0, INTER)
    assert fused.rms_norm(x, w, EPS, quant=True).q.shape == (0, HIDDEN)


def test_bad_inputs() -> None:
    g = _gen(800)
    x, w = _randn(g, 4, 64), _randn(g, 64)
    with pytest.raises(ValueError, match="weight"):
        fused.rms_norm(x, _randn(g, 63), EPS)
    with pytest.raises(ValueError, match="unit-stride"):
        fused.rms_norm(_randn(g, 64, 4).t(), w, EPS)
    with pytest.raises(ValueError, match="collapse"):
        # Three leading dims, none mergeable: no (outer, inner) pair addresses every row.
        fused.rms_norm(_randn(g, 3, 5, 7, 80)[:, :4, :6, :64], w, EPS)
    with pytest.raises(ValueError, match="residual"):
        fused.add_rms_norm(x, _randn(g, 5, 64), w, EPS)
    with pytest.raises(ValueError, match="residual"):
        fused.add_rms_norm(x, x.to(BF16), w, EPS)
    q, _ = _qkv(g, 3, torch.float32)
    cos, sin = _cos_sin(g, 3, torch.float32)
    with pytest.raises(ValueError, match="T, heads, head_dim"):
        fused.rotary(q.reshape(3, H * D), cos, sin)
    with pytest.raises(ValueError, match="cos"):
        fused.rotary(q, cos[:2], sin)
    with pytest.raises(ValueError, match="sin"):
        fused.rotary(q, cos, sin[:, :32])
    with pytest.raises(ValueError, match="even"):
        fused.rotary(_randn(g, 3, H, 7), _randn(g, 3, 7), _randn(g, 3, 7))
    with pytest.raises(ValueError, match="unit-stride"):
        fused.rotary(_randn(g, 3, H, 2 * D)[..., ::2], cos, sin)
    with pytest.raises(ValueError, match="dtypes differ"):
        fused.rotary(q, cos, sin.to(BF16))
    with pytest.raises(ValueError, match=r"2\*I"):
        fused.silu_mul(_randn(g, 3, 2 * INTER + 1))
    with pytest.raises(ValueError, match=r"2\*I"):
        fused.silu_mul(_randn(g, 2, 3, 2 * INTER))
    with pytest.raises(ValueError, match="unit-stride"):
        fused.silu_mul(_randn(g, 3, 4 * INTER)[:, ::2])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_model_with_fused_ops_matches_eager(arch: str, tmp_path) -> None:
    """The whole forward with the fused kernels (qwen3: per-head q/k norms on strided views) gives
    the eager model's logits on span layouts, cold and warm."""
    from engine_helpers import make_engine
    from span_helpers import capture_logits, run_all
    from tiny_models import make_tiny_model

    from spanserve.engine.layout import Segment
    from spanserve.model.llama import _Eager

    path, _ = make_tiny_model(arch, tmp_path)
    g = _gen(5)
    t = lambda n: torch.randint(3, 200, (n,), generator=g).tolist()  # noqa: E731
    doc = t(21)
    prompts = [t(13), [Segment(token_ids=t(5)), Segment(token_ids=doc, kind="plus"), Segment(token_ids=t(4))],
               [Segment(token_ids=t(3)), Segment(token_ids=t(9), kind="plus"), Segment(token_ids=doc, kind="plus"),
                Segment(token_ids=t(6))]]
    logits = {}
    for name in ("eager", "fused"):
        eng = make_engine(str(path), block_size=8, num_blocks=64)
        assert eng.model.ops is _Eager  # CPU default
        if name == "fused":
            eng.model.ops = fused
        seen = capture_logits(eng)
        ids = run_all(eng, prompts) + run_all(eng, prompts[::-1])
        logits[name] = [seen[i] for i in ids]
    for a, b in zip(logits["fused"], logits["eager"]):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
