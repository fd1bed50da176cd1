"""The 8-bit KV cache: the quantizer, the Triton write and attention kernels against it and against
attention over the dequantized cache, whole blocks through storage and tier payloads, and the
engine (cold equals warm) with kv_cache_dtype="fp8". Triton runs in its interpreter."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import test_triton_attention as tta  # noqa: E402
from spanserve import LLM, SamplingParams, Segment  # noqa: E402
from spanserve.attention.kv_cache import FP8, Fp8Cache, dequantize, quantize, read_rows  # noqa: E402
from spanserve.attention.reference import ReferenceBackend  # noqa: E402
from spanserve.attention.triton.backend import rotate_keys, write_kv  # noqa: E402
from spanserve.attention.triton.launch import Prerotation  # noqa: E402
from spanserve.cache.tiers.payload import BadPayload, BlockKV, BlockShape, PayloadCodec  # noqa: E402
from spanserve.model.config import ModelConfig  # noqa: E402
from spanserve.model.loader import load_model  # noqa: E402
from spanserve.rope import Rotary  # noqa: E402
from spanserve.worker.storage import KVStorage, bytes_per_block  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402


def _rows(n: int, kvh: int, d: int, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes, some all zero, in bfloat16 (as a model writes them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, kvh, d, generator=g) * torch.exp2(torch.randint(-12, 12, (n, kvh, 1), generator=g).float())
    x[0, 0] = 0.0
    return x.to(torch.bfloat16)


def test_quantize_scales_are_powers_of_two_and_dequantize_exactly() -> None:
    x = _rows(300, 3, 64, 0).float()
    q, s = quantize(x)
    assert q.dtype == FP8 and s.dtype == torch.bfloat16
    exp = torch.log2(s.float())
    assert torch.equal(exp, exp.round())  # powers of two
    amax = x.abs().amax(-1)
    ratio = amax / s.float()
    live = amax > 0
    assert (ratio[live] <= 448).all() and (ratio[live] > 224).all()  # the least such power
    back = dequantize(q, s)
    assert torch.equal(dequantize(q, s, torch.bfloat16).float(), back)  # exact in bfloat16
    # e4m3 keeps 3 mantissa bits: each value within half a quantum (2**-4 of its binade)
    assert ((back - x).abs() <= x.abs() / 16 + s.float()[..., None] * 2.0 ** -10).all()


@pytest.mark.parametrize("seed", range(2))
def test_triton_write_quantizes_as_the_reference(seed: int) -> None:
    T, KVH, D, blocks, bs = 37, 3, 64, 12, 4
    k, v = _rows(T, KVH, D, seed), _rows(T, KVH, D, seed + 10)
    # exact ties between two e4m3 values (the rounding must go to the even one)
    k[1, 1, :4] = torch.tensor([448.0, 17.0, 19.0, -9.25])
    slots = torch.randperm(blocks * bs, generator=torch.Generator().manual_seed(seed))[:T]
    slots[5] = -1  # a padding row: not written
    caches = [Fp8Cache(torch.zeros(blocks, bs, KVH, D, dtype=FP8), torch.ones(blocks, bs, KVH, dtype=torch.bfloat16))
              for _ in range(2)]
    write_kv(k, v, caches[0], caches[1], slots)
    for x, c in zip((k, v), caches):
        keep = slots >= 0
        q, s = quantize(x[keep])
        assert torch.equal(c.data.view(-1, KVH, D)[slots[keep]].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(c.scale.view(-1, KVH)[slots[keep]], s)
        assert (c.data.view(-1, KVH, D)[slots[5 + 1:5 + 1]].float() == 0).all()


def _fp8_cache(cache: torch.Tensor) -> Fp8Cache:
    q, s = quantize(cache)
    return Fp8Cache(q, s)


CASES = [(m, torch.float32, False) for m in sorted(tta.BACKENDS)] + [(m, torch.float16, False) for m in sorted(tta.BACKENDS)]
CASES += [(m, torch.float32, True) for m in sorted(tta.BACKENDS)]  # the interpreter has no bfloat16 dot


@pytest.mark.parametrize("mode,dtype,staged", CASES)
def test_fp8_attention_is_attention_over_the_dequantized_cache(mode: str, dtype: torch.dtype, staged: bool) -> None:
    """Every launch kind (prerotated or fused deltas, split or not, repaired rows, plus segments)
    over an 8-bit cache computes what it computes over that cache dequantized: bit for bit where
    the scaled probabilities keep their precision (float32 here, bfloat16 on a GPU; float16's
    subnormals round some), and the dense reference over the dequantized cache agrees. `staged`:
    the engine's backend for an 8-bit cache, whose prefill launch copies keys and values into
    scratch first (`TritonBackend.for_kv_cache`)."""
    rng = random.Random(sum(map(ord, mode)) + (dtype == torch.float32) + 7 * staged)
    case = tta._case(rng, n_rows=rng.randint(2, 4), plus=True, max_keys=90, repair=True)
    H, KVH, D = 6, 2, tta.D
    gen = torch.Generator().manual_seed(3)
    rotary = Rotary(D, 10000.0, None, torch.device("cpu"))
    T = int(case.plan.positions.numel())
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    k, v = torch.randn(T, KVH, D, generator=gen).to(dtype), torch.randn(T, KVH, D, generator=gen).to(dtype)
    shape = (case.num_blocks, tta.BS, KVH, D)
    k8, v8 = _fp8_cache(torch.randn(shape, generator=gen)), _fp8_cache(torch.randn(shape, generator=gen))
    backend = tta.BACKENDS[mode]()
    if staged:
        backend = backend.for_kv_cache(FP8)
        assert backend.launches(backend.prepare(case.plan, rotary, tta.BS), H // KVH, KVH)[1].prerotation is not None
    lay = backend.prepare(case.plan, rotary, tta.BS)
    got = backend.forward(lay, q, k, v, k8, v8)  # writes this step's rows quantized, then attends
    dk, dv = dequantize(k8.data, k8.scale, dtype), dequantize(v8.data, v8.scale, dtype)
    same = backend.attend(backend.prepare(case.plan, rotary, tta.BS), q, dk, dv)
    if dtype == torch.float32:
        assert torch.equal(got, same)
    else:
        torch.testing.assert_close(got, same, rtol=2e-3, atol=2e-3)
    ref = ReferenceBackend()
    want = ref.attend(ref.prepare(case.plan, rotary, tta.BS), q.float(), dk.float(), dv.float())
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < (2e-6 if dtype == torch.float32 else 2e-3), err
    # the reference backend reads an 8-bit cache as its dequantized copy
    ref_fp8 = ref.attend(ref.prepare(case.plan, rotary, tta.BS), q.float(), k8, v8)
    assert torch.equal(ref_fp8, want)


@pytest.mark.parametrize("kvh,counted", [(3, False), (8, True)])
def test_staging_an_8bit_cache_turns_and_dequantizes_as_the_plain_kernel(kvh: int, counted: bool) -> None:
    """The staging of an 8-bit cache (keys and values in one pass) writes what the plain
    prerotation writes over the dequantized cache, bit for bit, for any number of KV heads; a
    counted (graph) launch writes its first `count` rows."""
    gen = torch.Generator().manual_seed(kvh)
    D, slots_total, n = 16, 40, 23
    k8 = _fp8_cache(torch.randn(slots_total // 4, 4, kvh, D, generator=gen) * 3)
    v8 = _fp8_cache(torch.randn(slots_total // 4, 4, kvh, D, generator=gen))
    src = torch.randint(0, slots_total, (n,), generator=gen, dtype=torch.int32)
    delta = torch.randint(-500, 500, (n,), generator=gen, dtype=torch.int32)
    count = torch.tensor([17], dtype=torch.int32) if counted else None
    inv_freq = Rotary(D, 10000.0, None, torch.device("cpu")).inv_freq.float()
    pre = Prerotation(src, delta, count)
    k_out, v_out = rotate_keys(k8, pre, inv_freq, torch.float32, v8)
    dk = dequantize(k8.data, k8.scale, torch.float32)
    want_k, _ = rotate_keys(dk, pre, inv_freq, torch.float32)
    used = 17 if counted else n
    assert torch.equal(k_out[:used], want_k[:used])
    dv = dequantize(v8.data, v8.scale, torch.float32).view(-1, kvh, D)
    assert torch.equal(v_out[:used].view(used, kvh, D), dv[src[:used].long()])


def _storage(seed: int, dtype: torch.dtype = FP8) -> KVStorage:
    cfg = ModelConfig(arch="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=2,
                      num_kv_heads=2, head_dim=8)
    st = KVStorage(cfg, num_blocks=10, block_size=4, dtype=dtype, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    for t in (st.k, st.v):
        t.copy_(torch.randn(t.shape, generator=g).clamp(-400, 400).to(dtype))
    if st.fp8:
        for s in (st.k_scale, st.v_scale):
            s.copy_(torch.exp2(torch.randint(-8, 8, s.shape, generator=g).float()))
    return st


def _snapshot(st: KVStorage) -> list[torch.Tensor]:
    return [t.clone() for t in st._tensors()]


def test_fp8_pool_holds_twice_the_tokens_per_byte() -> None:
    cfg = ModelConfig(arch="llama", vocab_size=8, hidden_size=4096, intermediate_size=8, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128)
    ratio = bytes_per_block(cfg, 16, torch.bfloat16) / bytes_per_block(cfg, 16, FP8)
    assert ratio == 256 / 130  # 1.97x: one byte a value, two a row for its scale


def test_fp8_blocks_move_with_their_scales() -> None:
    st = _storage(0)
    before = _snapshot(st)
    st.copy(1, 2, 3)
    st.copy_many([(3, 4, 4), (4, 3, 2)])
    for t, b in zip(st._tensors(), before):
        assert torch.equal(t[:, 2, :3].view(torch.uint8) if t.dtype == FP8 else t[:, 2, :3],
                           b[:, 1, :3].view(torch.uint8) if t.dtype == FP8 else b[:, 1, :3])
        assert torch.equal(t[:, 4].view(torch.uint8) if t.dtype == FP8 else t[:, 4],
                           b[:, 3].view(torch.uint8) if t.dtype == FP8 else b[:, 3])
    # whole blocks out and back in: packed rows carry their scale bytes
    ids = [5, 0, 7]
    out = torch.empty(len(ids), 2, 3, 4, 2, 8 + 2, dtype=st.host_dtype)
    st.read_blocks(ids, out)
    other = _storage(1)
    other.write_blocks([1, 2, 3], list(out))
    for a, b in zip(st._tensors(), other._tensors()):
        assert torch.equal(a[:, ids].view(torch.uint8) if a.dtype == FP8 else a[:, ids],
                           b[:, [1, 2, 3]].view(torch.uint8) if b.dtype == FP8 else b[:, [1, 2, 3]])
    k_rows = read_rows(st.layer(2)[0], torch.arange(5 * 4, 6 * 4))
    assert torch.equal(k_rows, dequantize(st.k[2, 5], st.k_scale[2, 5]))


def test_eager_repositioning_of_an_fp8_pool_requantizes_turned_keys() -> None:
    st = _storage(2)
    rotary = Rotary(8, 10000.0, None, torch.device("cpu"))
    ref = _storage(2, torch.float32)
    ref.k.copy_(dequantize(st.k, st.k_scale))
    ref.v.copy_(dequantize(st.v, st.v_scale))
    st.copy_rotated([1, 2], [6, 7], 37, rotary)
    ref.copy_rotated([1, 2], [6, 7], 37, rotary)
    want_k, want_s = quantize(ref.k[:, [6, 7]])
    assert torch.equal(st.k[:, [6, 7]].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(st.k_scale[:, [6, 7]], want_s)
    assert torch.equal(dequantize(st.v[:, [6, 7]], st.v_scale[:, [6, 7]]), ref.v[:, [6, 7]])


def test_fp8_payload_round_trips_and_is_never_read_as_bfloat16() -> None:
    shape = BlockShape(2, 4, 2, 8, FP8)
    assert shape.dims == (2, 2, 4, 2, 10) and shape.host_dtype == torch.uint8
    kv = torch.randint(0, 255, shape.dims, dtype=torch.uint8)
    codec = PayloadCodec(shape, b"f" * 16)
    data = codec.encode(BlockKV(7, (1, 2, 3), kv))
    assert torch.equal(codec.decode(data, 7).kv, kv)
    bf16 = PayloadCodec(BlockShape(2, 4, 2, 8, torch.bfloat16), b"f" * 16)
    with pytest.raises(BadPayload):
        bf16.decode(data, 7)
    with pytest.raises(ValueError):
        bf16.encode(BlockKV(7, (1, 2, 3), kv))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path, _ = make_tiny_model("llama", tmp_path_factory.mktemp("fp8kv"))
    return load_model(str(path))


def _toks(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("policy", ["none", "cacheblend"])
def test_cold_equals_warm_under_fp8_kv(loaded, policy: str) -> None:
    """Segments read back from the 8-bit cache at new positions give the logprobs of the engine
    that encoded them for another layout, bit for bit, and those of a fresh engine that encodes
    them in the same pass (its steps batch rows otherwise: float rounding, as without FP8)."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    docs = [Segment(token_ids=_toks(13, s), kind="plus") for s in (1, 2, 3)]
    question = Segment(token_ids=_toks(7, 9), kind="cross")
    layout = [docs[2], docs[0], docs[1], question]

    def engine() -> LLM:
        return LLM(loaded, block_size=4, num_blocks=128, kv_cache_dtype="fp8", default_policy=policy)

    a = engine()
    a.generate([docs[0], docs[1], docs[2], question], params)
    warm = a.generate(layout, params)[0]
    b = engine()
    for d in docs:
        b.generate([d, question], params)
    other = b.generate(layout, params)[0]
    cold = engine().generate(layout, params)[0]
    assert a.engine.storage.k.dtype == FP8
    assert warm.metrics["reuse"]["segment"] > 0 and other.metrics["reuse"]["segment"] > 0
    assert warm.token_ids == other.token_ids == cold.token_ids
    assert warm.logprobs == other.logprobs
    for x, y in zip(warm.logprobs, cold.logprobs):
        assert x.top.keys() == y.top.keys()
        assert all(abs(x.top[t] - y.top[t]) < 1e-5 for t in x.top)


def test_packed_blocks_cut_along_heads_are_each_ranks_rows() -> None:
    """Tensor-parallel transfers cut packed blocks along the KV heads: a rank's slice, unpacked
    into its own pool, holds exactly its heads' values and scales."""
    st = _storage(3)
    cfg = ModelConfig(arch="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=3, num_heads=1,
                      num_kv_heads=1, head_dim=8)
    rank = KVStorage(cfg, num_blocks=10, block_size=4, dtype=FP8, device=torch.device("cpu"))
    ids = torch.tensor([4, 1, 8])
    rank.unpack(torch.tensor([0, 1, 2]), st.packed(ids)[:, :, :, :, 1:2].contiguous())
    for mine, whole in zip(rank._tensors(), st._tensors()):
        a, b = mine[:, :3, :, 0], whole[:, ids, :, 1]
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8 else a, b.view(torch.uint8) if b.dtype == FP8 else b)


def test_an_fp8_pool_has_a_key_space_of_its_own_in_shared_tiers(loaded, tmp_path) -> None:
    """Blocks of an 8-bit pool are other bytes than a float32 pool's of the same model: the
    fingerprint that names the disk tier's folder (and the store's key prefix) says so; a pool in
    the model's own dtype keeps the fingerprint it always had."""
    from spanserve.model.fingerprint import model_fingerprint

    dirs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(loaded, block_size=4, num_blocks=64, kv_cache_dtype=kv,
                  kv_offload={"disk_path": str(tmp_path / "disk"), "disk_bytes": 1 << 24})
        dirs[kv] = llm.engine.tiers.disk.dir.name
        llm.shutdown()
    plain = model_fingerprint(loaded.config, loaded.weights, torch.float32, 4)
    assert dirs["auto"] == plain.hex()
    assert model_fingerprint(loaded.config, loaded.weights, torch.float32, 4, kv_dtype=torch.float32) == plain
    assert dirs["fp8"] == model_fingerprint(loaded.config, loaded.weights, torch.float32, 4, kv_dtype=FP8).hex()
    assert dirs["fp8"] != dirs["auto"]
