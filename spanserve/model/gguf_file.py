"""GGUF files: config from their metadata, weights dequantized to float32 under Hugging Face names
(Q and K rows un-permuted from llama.cpp's order), and the tokenizer their metadata describes."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from spanserve.model.config import ModelConfig

if TYPE_CHECKING:
    import transformers
    from gguf import GGUFReader

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

_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


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


def load_gguf(
    path: Path,
) -> tuple[ModelConfig, dict[str, torch.Tensor], "transformers.PreTrainedTokenizerBase | None"]:
    """(config, weights under Hugging Face names in [out, in] layout, tokenizer or None) of a GGUF file."""
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
    return config, weights, gguf_tokenizer(reader, path)


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


def gguf_tokenizer(reader: "GGUFReader", path: Path) -> "transformers.PreTrainedTokenizerBase | None":
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
