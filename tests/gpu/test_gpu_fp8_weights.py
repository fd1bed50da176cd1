"""FP8 weights on the GPU at Llama-3-8B's projection shapes (qkv 4096 -> 6144, gate_up 4096 -> 28672,
down 14336 -> 4096): the Triton weight-only kernel, the per-token activation quantization and the
torch._scaled_mm path against float64 products of the same FP8 operands, and the CPU reference;
then the engine with quantization="fp8" on an 8B-shaped random model, decode graphs against eager
steps. tests/test_fp8_weights.py covers the same code at small shapes on the CPU.

Tolerances (relative norms): a bf16 result is within its rounding (2^-9 per element) of the float64
product, held to 4e-3; a float32 result to 1e-5 (the kernel's float32 sums over K) and 1e-3 for
_scaled_mm, whose FP8 tensor-core accumulation keeps fewer bits than float32 even with fast
accumulation off (1.3e-4 to 4e-4 on an H100)."""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import LLAMA3_8B, rel_err, release
from span_helpers import capture_logits, run_all
from spanserve import LLM, SamplingParams
from spanserve.model import fp8, fp8_kernels
from spanserve.model.fp8 import fp8_linear, quantize_weight

SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
BF16_TOL, F32_TOL, SCALED_MM_F32_TOL = 4e-3, 1e-5, 1e-3
ENGINE_TOL = 0.25  # FP8 against bf16 logits of the random 32-layer model: 0.157-0.159 on an H100
DEV = torch.device("cuda")


def _operands(name: str, rows: int, seed: int = 0) -> tuple[torch.Tensor, fp8.Fp8Weight, torch.Tensor]:
    N, K = SHAPES[name]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    w = (torch.randn(N, K, generator=gen, device=DEV) / K ** 0.5).bfloat16()
    # rows of different magnitudes, as hidden states have: per-token scales matter
    x = (torch.randn(rows, K, generator=gen, device=DEV) * torch.logspace(-1, 1, rows, device=DEV)[:, None]).bfloat16()
    return x, quantize_weight(w), w


@pytest.mark.parametrize("name", SHAPES)
def test_weight_only_kernel_against_float64(name):
    for M in (1, 5, 16):
        x, wt, w = _operands(name, M, seed=M)
        want = (x.double() @ wt.q.double().t()) * wt.scale.double()
        assert rel_err(fp8_linear(x, wt), want) < BF16_TOL
        y32 = fp8_kernels.gemv(x, wt.q, wt.scale, None, torch.float32)
        assert rel_err(y32, want) < F32_TOL
        bias = torch.randn(wt.shape[0], device=DEV).bfloat16()
        assert rel_err(fp8_linear(x, wt, bias), want + bias.double()) < BF16_TOL
        # a column-parallel shard's rows are the whole's, bit for bit
        half = wt.narrow(0, wt.shape[0] // 2, wt.shape[0] // 2)
        assert torch.equal(fp8_kernels.gemv(x, half.q, half.scale, None, torch.float32), y32[:, wt.shape[0] // 2:])
        # what quantizing the weights costs: ~2-3% of the bf16 product
        assert rel_err(fp8_linear(x, wt), x.double() @ w.double().t()) < 0.04
        torch.testing.assert_close(fp8_linear(x, wt).cpu(), fp8_linear(x.cpu(), _cpu(wt)), rtol=0.02, atol=0.02)
    # x far outside fp16's range (the kernel multiplies in fp16, x scaled by 2^-6): no overflow, and
    # float32 sums over so wide a range of products keep fewer bits on the tensor cores
    x[0, :64] = 30000.0
    x[-1, 64:128] = 1e-3
    want = (x.double() @ wt.q.double().t()) * wt.scale.double()
    assert rel_err(fp8_kernels.gemv(x, wt.q, wt.scale, None, torch.float32), want) < 1e-4  # 2.9e-5 measured


def _cpu(wt: fp8.Fp8Weight) -> fp8.Fp8Weight:
    return fp8.Fp8Weight(wt.q.cpu(), wt.scale.cpu())


def test_activation_quantization_kernel_is_torch_bit_for_bit():
    gen = torch.Generator(device=DEV).manual_seed(0)
    for M, K in ((1, 4096), (300, 14336), (64, 1000)):
        x = (torch.randn(M, K, generator=gen, device=DEV) * 3).bfloat16()
        x[0, :7] = 0
        if M > 1:
            x[1] = 0
        q, s = fp8_kernels.quantize_rows(x)
        q2, s2 = fp8.quantize_rows(x)
        assert torch.equal(s, s2)
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))


def test_fused_quantizing_ops_are_torch_quantizing_their_outputs():
    """The norms and the SiLU with quant=True (what a W8A8 step's qkv, gate_up and down read) give
    the bytes and scales fp8.quantize_rows gives of their bf16 outputs, at Llama-3-8B's widths and
    SmolLM2's (not powers of two: masked columns).
    Bit for bit on these inputs; compiled apart, the two norm kernels may sum a row's squares in
    another order, and an engine run met one call in 32 where 25 of 1.2M codes moved one step
    (the engine test below bounds what that does to logits)."""
    from spanserve.model import fused

    gen = torch.Generator(device=DEV).manual_seed(1)
    for T, hidden, inter in ((17, 4096, 14336), (300, 4096, 14336), (40, 576, 1536)):  # 576, 1536: SmolLM2's
        w = torch.randn(hidden, generator=gen, device=DEV).bfloat16()
        x = (torch.randn(T, hidden, generator=gen, device=DEV) * 4).bfloat16()
        r = torch.randn(T, hidden, generator=gen, device=DEV).bfloat16()
        r[1] = -x[1]  # an all-zero row
        gate_up = (torch.randn(T, 2 * inter, generator=gen, device=DEV) * 3).bfloat16()
        for rows, dense in ((fused.rms_norm(x, w, 1e-5, quant=True), fused.rms_norm(x, w, 1e-5)),
                            (fused.add_rms_norm(x, r, w, 1e-5, quant=True)[0], fused.add_rms_norm(x, r, w, 1e-5)[0]),
                            (fused.silu_mul(gate_up, quant=True), fused.silu_mul(gate_up))):
            q, s = fp8.quantize_rows(dense)
            assert torch.equal(rows.scale, s)
            assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("name", SHAPES)
def test_scaled_mm_path_against_float64(name):
    if not fp8.scaled_mm_supported(DEV, torch.bfloat16):
        pytest.skip(f"torch._scaled_mm with row-wise scales is not available on {torch.cuda.get_device_name()}")
    for M in (17, 64, 300):
        x, wt, w = _operands(name, M, seed=10 + M)
        xq, sx = fp8.quantize_rows(x)
        want = (xq.double() @ wt.q.double().t()) * sx.double() * wt.scale.double()
        assert rel_err(fp8_linear(x, wt), want) < BF16_TOL
        if fp8.scaled_mm_supported(DEV, torch.float32):
            assert rel_err(fp8.scaled_linear(x, wt, None, torch.float32), want) < SCALED_MM_F32_TOL
        bias = torch.randn(wt.shape[0], device=DEV).bfloat16()
        assert rel_err(fp8_linear(x, wt, bias), want + bias.double()) < BF16_TOL
        # the CPU computes the same function (it is the reference of the CPU tests)
        ref = fp8_linear(x.cpu(), _cpu(wt))  # all M rows: the path follows the row count
        assert rel_err(fp8_linear(x, wt).cpu(), ref.double()) < BF16_TOL
        # activations quantized too: ~3-4% of the bf16 product
        assert rel_err(fp8_linear(x, wt), x.double() @ w.double().t()) < 0.06


def test_engine_fp8_decode_graphs_equal_eager_steps(model_8b):
    """An 8B-shaped random model with quantization="fp8": prompt-end logits within ENGINE_TOL of
    the bf16 model's, and greedy decoding of 3 requests (the weight-only kernel: 3 rows eager, 4 in
    the graph, the same tile) through CUDA graphs equal to eager steps. The prompts (300 tokens
    together) are past the step graphs' 256, so both runs prefill eagerly through _scaled_mm; with
    the rows quantized by the product instead of the ops before it, two prompts give the same bits
    and one moves by a quarter of what FP8 moves it: a few codes on a rounding boundary (see the
    fused-ops test), amplified by 32 random layers."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, LLAMA3_8B.vocab_size, (100,), generator=gen).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tokens, logits = {}, {}
    for quant, graphs in ((None, "auto"), ("fp8", "auto"), ("fp8", False), ("fp8 unfused", False)):
        llm = LLM(model_8b, device="cuda", dtype="bfloat16", quantization=quant and "fp8", cuda_graphs=graphs,
                  kv_cache_memory=2 << 30, max_num_seqs=8)
        assert llm.engine.model.quantization == (quant and "fp8")
        if quant == "fp8 unfused":  # the prefill's projections quantize their own rows
            llm.engine.model._quantized_inputs = False
        seen = capture_logits(llm.engine)
        logits[quant, graphs] = [seen[r].float() for r in run_all(llm.engine, prompts)]
        if quant == "fp8 unfused":
            fused_errs = [rel_err(a, b) for a, b in zip(logits[quant, graphs], logits["fp8", False])]
            print("rows quantized by the product vs by the ops before it, relative:", fused_errs)
            assert max(fused_errs) < 0.1  # 0, 0 and 0.039 on an H100
        else:
            tokens[quant, graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
        del llm
        release()
    errs = [rel_err(q, d) for q, d in zip(logits["fp8", "auto"], logits[None, "auto"])]
    print("fp8 vs bf16 prompt-end logits, relative:", errs)
    assert max(errs) < ENGINE_TOL
    assert tokens["fp8", "auto"] == tokens["fp8", False]


def test_engine_fp8_w8a8_decode_graphs_equal_eager_steps(model_8b):
    """32 requests decode 32 rows a step: the W8A8 path, its rows quantized by the norms and the
    SiLU inside the captured graphs. Greedy tokens through graphs equal eager steps (both run 32
    rows, so cuBLAS takes the same shapes)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, LLAMA3_8B.vocab_size, (20,), generator=gen).tolist() for _ in range(32)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = {}
    for graphs in ("auto", False):
        llm = LLM(model_8b, device="cuda", dtype="bfloat16", quantization="fp8", cuda_graphs=graphs,
                  kv_cache_memory=2 << 30, max_num_seqs=32)
        tokens[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
        del llm
        release()
    assert tokens["auto"] == tokens[False]

