"""FP8 weights (spanserve/model/fp8.py) on the CPU: quantization bounds, fp8_linear against dense
float32 products, the Triton kernels in Triton's interpreter (chosen before triton is first
imported), tiny Llama models with quantization="fp8", FP8 checkpoints in the compressed-tensors
layout, and emulate_tp=2 / TP=2 (gloo) with FP8 computing the same bits."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from span_helpers import capture_logits, run_all  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402

from spanserve import LLM, SamplingParams  # noqa: E402
from spanserve.model import fp8, fp8_kernels  # noqa: E402
from spanserve.model.fingerprint import model_fingerprint, whole_model_fingerprint  # noqa: E402
from spanserve.model.fp8 import Fp8Weight, fp8_linear, quantize_weight  # noqa: E402
from spanserve.model.loader import load_model  # noqa: E402
from spanserve.model.weights import source_of  # noqa: E402

BS = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
# A random tiny model amplifies weight error: 2.5% random noise on its projections moves its
# prompt-end logits by ~10% (relative norm), bf16 weights by ~2%, FP8 (W8A8 prefill) by 10-16%.
TRACKS = 0.25
CT_CONFIG = {  # what llm-compressor writes for FP8 weights per channel, activations per token
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                              "symmetric": True}}},
    "ignore": ["lm_head"],
}


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- quantization ---------------------------------------------------------------------------------
def test_quantize_round_trip_within_half_a_step():
    w = _rand(24, 80) * torch.logspace(-3, 2, 24)[:, None]  # rows of very different magnitudes
    w[5] = 0
    wt = quantize_weight(w)
    assert wt.q.dtype == torch.float8_e4m3fn and wt.q.is_contiguous() and wt.shape == (24, 80)
    assert wt.scale.dtype == torch.float32 and wt.scale.shape == (24,) and wt.scale[5] == 1
    amax = w.abs().amax(1)
    torch.testing.assert_close(wt.q.float().abs().amax(1)[amax > 0], torch.full((23,), 448.0))  # full range used
    err = (fp8.dequantize(wt) - w).abs()
    # e4m3: 3 mantissa bits (half a step is 1/16 of the value), subnormal steps of 2^-9 (times the scale)
    assert (err <= w.abs() / 16 + wt.scale[:, None] * 2.0 ** -10).all()
    assert err.max() > 0
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        Fp8Weight(w, wt.scale)
    with pytest.raises(ValueError, match="scale"):
        Fp8Weight(wt.q, wt.scale[:3])


def test_pieces_quantize_as_their_stack_and_slices_keep_their_scales():
    q, k = _rand(16, 32, seed=1), _rand(8, 32, seed=2) * 10
    whole, parts = quantize_weight(torch.cat([q, k])), fp8.cat([quantize_weight(q), quantize_weight(k)])
    assert torch.equal(whole.q.view(torch.uint8), parts.q.view(torch.uint8)) and torch.equal(whole.scale, parts.scale)
    rows, cols = whole.narrow(0, 4, 8), whole.narrow(1, 8, 16)
    assert torch.equal(rows.scale, whole.scale[4:12]) and torch.equal(cols.scale, whole.scale)
    assert torch.equal(fp8.dequantize(cols), fp8.dequantize(whole)[:, 8:24])


@pytest.mark.parametrize("rows", [1, 16, 17, 33])
def test_fp8_linear_on_the_cpu_is_the_dense_product_of_what_it_quantizes(rows):
    """Up to WEIGHT_ONLY_ROWS rows x is used as it is; beyond, x is quantized per token too."""
    w, x, b = _rand(48, 64, seed=3), _rand(rows, 64, seed=4) * 3, _rand(48, seed=5)
    wt = quantize_weight(w)
    xq, sx = fp8.quantize_rows(x)
    xd = x if rows <= fp8.WEIGHT_ONLY_ROWS else xq.float() * sx
    want = F.linear(xd.double(), fp8.dequantize(wt).double(), b.double())
    y = fp8_linear(x, wt, b)
    assert y.dtype == torch.float32 and y.shape == (rows, 48)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    # and close to the unquantized product: weights only ~2%, with activations ~3% (relative norm)
    exact = F.linear(x.double(), w.double(), b.double())
    assert ((y.double() - exact).norm() / exact.norm()) < (0.03 if rows <= fp8.WEIGHT_ONLY_ROWS else 0.05)
    assert fp8_linear(x.bfloat16(), wt).dtype == torch.bfloat16
    assert fp8_linear(x.view(rows, 1, 64), wt).shape == (rows, 1, 48)
    with pytest.raises(ValueError, match="features"):
        fp8_linear(_rand(2, 63), wt)


# ---- the Triton kernels (interpreter) -------------------------------------------------------------
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("cfg", [fp8_kernels.Fp8GemvConfig(16, 64, 4, 2), fp8_kernels.Fp8GemvConfig(32, 32, 2, 1)])
def test_gemv_kernel_matches_the_reference(M, cfg):
    g = torch.Generator().manual_seed(M)
    N = int(torch.randint(1, 40, (1,), generator=g))  # rows not a multiple of block_n
    K = 96 if M % 2 else 128  # a partial last tile (96 with 64) and whole ones
    wt = quantize_weight(torch.randn(N, K, generator=g))
    x, b = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, generator=g)
    for bias, out in ((None, torch.bfloat16), (b, torch.float32)):
        y = fp8_kernels.gemv(x, wt.q, wt.scale, bias, out, cfg)
        assert y.dtype == out
        want = fp8.weight_only_linear(x, wt, bias, torch.float32)
        torch.testing.assert_close(y.float(), want, rtol=1e-5 if out == torch.float32 else 1e-2, atol=1e-5)
    # a weight row's result does not depend on the rows around it: a shard's rows are the whole's
    cut = N // 2
    y = fp8_kernels.gemv(x, wt.q, wt.scale, None, torch.float32, cfg)
    shard = wt.narrow(0, cut, N - cut)
    assert torch.equal(fp8_kernels.gemv(x, shard.q, shard.scale, None, torch.float32, cfg), y[:, cut:])


def test_activation_quantization_kernel_matches_torch():
    """Rows built from e4m3 values times a power of two, so that every quotient is exact: the
    interpreter's float32 -> fp8 rounding does not carry into the exponent as the GPU's does (the
    GPU test compares random rows bit for bit)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (7, 100), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    vals = codes.float().nan_to_num(0.0)
    vals[:, 0] = 448.0
    x = vals * (2.0 ** torch.arange(-3, 4).float())[:, None]
    x[2] = 0
    q2, s2 = fp8.quantize_rows(x)
    for kw in ({"block_k": 32, "one_pass_max": 0}, {}):  # rows in tiles, read twice; whole rows, once
        q, s = fp8_kernels.quantize_rows(x, **kw)
        assert torch.equal(s, s2) and s[2] == 1
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))


# ---- tiny models ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("fp8"))[0]


def _prompt_logits(llm, prompts):
    seen = capture_logits(llm.engine)
    return [seen[r] for r in run_all(llm.engine, prompts)]


PROMPTS = [list(range(5, 40)), [3, 17, 99, 250, 7]]  # prefills of 35 rows (W8A8) and 5 (weight-only)


def test_quantized_tiny_model_tracks_the_dense_one(tiny):
    dense = LLM(str(tiny), device="cpu", block_size=BS, num_blocks=128)
    q = LLM(str(tiny), device="cpu", block_size=BS, num_blocks=128, quantization="fp8")
    assert q.engine.model.quantization == "fp8" and dense.engine.model.quantization is None
    L = q.engine.model.layers[0]
    assert all(isinstance(p, Fp8Weight) for p in (L.qkv, L.o, L.gate_up, L.down))
    assert q.engine.model.lm_head.dtype == torch.float32  # embeddings, norms and the head stay dense
    for a, b in zip(_prompt_logits(dense, PROMPTS), _prompt_logits(q, PROMPTS)):
        rel = ((b - a).norm() / a.norm()).item()
        assert 1e-3 < rel < TRACKS, rel  # quantized (not the dense model), and close to it
        assert a.argmax() == b.argmax()
    # The first greedy token agrees; later ones part at the random model's near-ties (at the
    # second token for the first prompt), so longer runs are compared where the numbers are exact.
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in q.generate(PROMPTS, first)] == [o.token_ids for o in dense.generate(PROMPTS, first)]
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(tiny), device="cpu", num_blocks=64, quantization="int4")


def test_inputs_quantized_by_the_ops_before_them_give_the_same_bits(tiny, monkeypatch):
    """A W8A8 step takes its projections' rows quantized by the norm or SiLU before them
    (fp8.Fp8Rows); quantized inside the product instead, the logits are the same bits. Steps of up
    to WEIGHT_ONLY_ROWS rows keep unquantized rows, and an Fp8Rows reaching them, or a dense
    projection, is refused."""
    q = LLM(str(tiny), device="cpu", block_size=BS, num_blocks=128, quantization="fp8")
    model = q.engine.model
    assert model._quantized_inputs
    seen = []
    real = fp8.fp8_linear
    monkeypatch.setattr(fp8, "fp8_linear", lambda x, *a, **k: seen.append(type(x).__name__) or real(x, *a, **k))
    fused_in = _prompt_logits(q, PROMPTS)
    assert seen.count("Fp8Rows") == 3 * len(model.layers)  # qkv, gate_up and down of the 35-row prefill
    assert "Tensor" in seen  # o's rows (the attention's output), and the 5-row prefill (weight-only)
    apart = LLM(str(tiny), device="cpu", block_size=BS, num_blocks=128, quantization="fp8")  # a cold cache
    apart.engine.model._quantized_inputs = False
    for a, b in zip(fused_in, _prompt_logits(apart, PROMPTS)):
        assert torch.equal(a, b)
    rows = fp8.rows_of(torch.randn(3, 64))
    with pytest.raises(ValueError, match="weight-only"):
        fp8.fp8_linear(rows, quantize_weight(torch.randn(8, 64)))
    with pytest.raises(ValueError, match="dense projection"):
        fp8.mixed_linear(torch.nn.functional.linear)(rows, torch.randn(8, 64))


def test_weight_only_model_is_the_dense_model_of_the_dequantized_weights(tiny, monkeypatch):
    """Every step weight-only: the FP8 model computes what a dense model holding dequantize(q) does,
    to float32 rounding (per rank too, with emulate_tp=2: o and down quantized per piece)."""
    monkeypatch.setattr(fp8, "WEIGHT_ONLY_ROWS", 1 << 30)
    for cuts in (1, 2):
        q = LLM(str(tiny), device="cpu", block_size=BS, num_blocks=64, quantization="fp8", emulate_tp=cuts)
        loaded = load_model(str(tiny))
        for name, t in loaded.weights.items():
            if name.endswith(fp8.PROJECTIONS) and (cuts == 1 or "o_proj" not in name and "down_proj" not in name):
                t.copy_(fp8.dequantize(quantize_weight(t)))
            elif name.endswith(fp8.PROJECTIONS):  # row-parallel: each rank's half of the inputs on its own
                halves = [fp8.dequantize(quantize_weight(h)) for h in t.chunk(2, dim=1)]
                t.copy_(torch.cat(halves, dim=1))
        ref = LLM(loaded, device="cpu", block_size=BS, num_blocks=64, emulate_tp=cuts)
        for a, b in zip(_prompt_logits(ref, PROMPTS), _prompt_logits(q, PROMPTS)):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
        assert [o.token_ids for o in q.generate(PROMPTS, GREEDY)] == [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]


def _write_fp8_checkpoint(src: Path, dst: Path, strategy: str = "channel", ignore_k: bool = False) -> None:
    """The tiny model saved as compressed-tensors writes FP8: each projection quantize_weight'ed
    (per tensor: one scale, the largest row's), its scale beside it."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if not name.endswith(fp8.PROJECTIONS) or (ignore_k and "k_proj" in name):
            out[name] = t
            continue
        wt = quantize_weight(t)
        if strategy == "tensor":
            s = wt.scale.max()
            out[name], out[name + "_scale"] = (t / s).clamp(-448, 448).to(fp8.FP8), s.reshape(1)
        else:
            out[name], out[name + "_scale"] = wt.q, wt.scale[:, None]
        out[name.replace("weight", "input_scale")] = torch.ones(1)  # static activation scale: unused
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    groups = json.loads(json.dumps(CT_CONFIG))
    groups["config_groups"]["group_0"]["weights"]["strategy"] = strategy
    cfg["quantization_config"] = groups
    (dst / "config.json").write_text(json.dumps(cfg))


def test_fp8_checkpoint_equals_quantizing_the_dense_weights(tiny, tmp_path):
    """The checkpoint holds quantize_weight of each dense projection: what quantization="fp8" does
    to the same tensors (per-row scales make the fused qkv's quantization that of its pieces), so
    the two models hold the same bytes and compute the same bits."""
    ckpt = tmp_path / "fp8"
    _write_fp8_checkpoint(tiny, ckpt)
    loaded = load_model(str(ckpt))  # float32 model: the FP8 tensors keep their dtype
    q_name = "model.layers.0.self_attn.q_proj.weight"
    assert loaded.weights[q_name].dtype == fp8.FP8 and loaded.weights[q_name + "_scale"].shape == (64,)
    assert not any(n.endswith("input_scale") for n in loaded.weights)
    from_ckpt = LLM(str(ckpt), device="cpu", block_size=BS, num_blocks=128)  # no quantization asked: FP8 all the same
    from_dense = LLM(str(tiny), device="cpu", block_size=BS, num_blocks=128, quantization="fp8")
    assert from_ckpt.engine.model.quantization == "fp8"
    a, b = from_ckpt.engine.model.layers[1].qkv, from_dense.engine.model.layers[1].qkv
    assert torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    for x, y in zip(_prompt_logits(from_ckpt, PROMPTS), _prompt_logits(from_dense, PROMPTS)):
        assert torch.equal(x, y)
    # fingerprints: the FP8 model's differs from the dense model's; TP=N's (leading rows) is TP=1's
    w = load_model(str(tiny)).weights
    plain = model_fingerprint(loaded.config, w, torch.float32, BS)
    assert plain == model_fingerprint(loaded.config, w, torch.float32, BS, None)
    assert model_fingerprint(loaded.config, w, torch.float32, BS, "fp8") != plain
    want = model_fingerprint(loaded.config, loaded.weights, torch.float32, BS, "fp8")
    assert whole_model_fingerprint(source_of(str(ckpt)), loaded.config, torch.float32, BS, torch.device("cpu"),
                                   "fp8") == want


def test_per_tensor_scales_and_ignored_layers(tiny, tmp_path):
    ckpt = tmp_path / "fp8-tensor"
    _write_fp8_checkpoint(tiny, ckpt, strategy="tensor", ignore_k=True)
    llm = LLM(str(ckpt), device="cpu", block_size=BS, num_blocks=64)
    L = llm.engine.model.layers[0]
    raw = load_file(str(ckpt / "model.safetensors"))
    s = raw["model.layers.0.mlp.down_proj.weight_scale"]
    assert torch.equal(L.down.scale, s.expand(64))  # one scale for every row
    # k is dense in the checkpoint (an ignored layer): quantized along with its FP8 neighbours
    k = quantize_weight(raw["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(L.qkv.scale[64:96], k.scale)
    assert llm.generate([PROMPTS[1]], GREEDY)[0].token_ids


@pytest.mark.parametrize("qc, found", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    (dict(CT_CONFIG, format="pack-quantized", config_groups={"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group"}}}), "format 'pack-quantized'"),
    (dict(CT_CONFIG, config_groups={"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}),
     "per block"),
    (dict(CT_CONFIG, kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
])
def test_unsupported_quantization_configs_are_named(qc, found):
    with pytest.raises(ValueError, match="unsupported quantization_config") as e:
        fp8.checkpoint_quantization({"quantization_config": qc}, "ckpt")
    assert found in str(e.value) and "compressed-tensors" in str(e.value)
    assert fp8.checkpoint_quantization({}, "ckpt") is None


def test_an_unsupported_checkpoint_fails_to_load(tiny, tmp_path):
    ckpt = tmp_path / "gptq"
    shutil.copytree(tiny, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        LLM(str(ckpt), device="cpu", num_blocks=64)


def test_float32_reduce_keeps_the_fp8_accumulator(monkeypatch):
    from spanserve.distributed.group import TPGroup

    group = TPGroup(0, 1, torch.device("cpu"), None, float32_reduce=True)
    monkeypatch.setattr(group, "all_reduce", lambda t: t)
    x, wt = _rand(6, 32).bfloat16(), quantize_weight(_rand(16, 32, seed=1))
    want = fp8_linear(x, wt, out_dtype=torch.float32).bfloat16()
    assert torch.equal(group.row_linear(x, wt, fp8.mixed_linear(F.linear)), want)


# ---- tensor parallelism -----------------------------------------------------------------------------
def test_emulated_and_real_tp2_compute_the_same_fp8_bits(tiny, tmp_path):
    """emulate_tp=2 and TP=2 quantize the same pieces (o and down after slicing along their inputs)
    and give the same logits bit for bit, from a dense checkpoint and from an FP8 one (the latter
    with an FP8 KV cache too: each rank quantizes its own heads' rows); both track the dense model.
    One torch thread, as the worker has."""
    ckpt = tmp_path / "fp8"
    _write_fp8_checkpoint(tiny, ckpt)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dense = _prompt_logits(LLM(str(tiny), device="cpu", block_size=BS, num_blocks=128), PROMPTS)
        for path, quant, kv in ((tiny, "fp8", "auto"), (ckpt, None, "fp8")):
            emu = LLM(str(path), device="cpu", block_size=BS, num_blocks=128, quantization=quant, emulate_tp=2,
                      kv_cache_dtype=kv)
            assert isinstance(emu.engine.model.layers[0].down, list)
            e = _prompt_logits(emu, PROMPTS)
            for a, b in zip(dense, e):
                assert ((b - a).norm() / a.norm()).item() < TRACKS
            tp = LLM(str(path), device="cpu", block_size=BS, num_blocks=128, quantization=quant, tensor_parallel_size=2,
                     kv_cache_dtype=kv)
            try:
                assert tp.engine.model.quantization == "fp8"
                assert tp.engine.storage.k.dtype == (torch.float8_e4m3fn if kv == "fp8" else torch.float32)
                for a, b in zip(e, _prompt_logits(tp, PROMPTS)):
                    assert torch.equal(a, b)
                tokens = [o.token_ids for o in tp.generate(PROMPTS, GREEDY)]
            finally:
                tp.shutdown()
            assert [o.token_ids for o in emu.generate(PROMPTS, GREEDY)] == tokens
    finally:
        torch.set_num_threads(threads)
