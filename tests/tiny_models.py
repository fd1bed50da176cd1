"""Tiny deterministic float32 models for loader and numerics tests.

make_tiny_model writes a Hugging Face directory (config.json, model.safetensors, a byte-level
BPE tokenizer with a chat template) and returns the transformers model it came from, so tests can
compare against transformers' own forward pass. make_tiny_gguf writes the same model as an F32
GGUF laid out the way llama.cpp's converter does (permuted Q/K rows, rope_freqs for llama3).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

ARCHS: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
TINY_WORDS: tuple[str, ...] = (
    "hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran",
    "user", "assistant", "system", ":", ".", ",", "?", "!",
)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Llama is the one with llama3 RoPE scaling; the band edges (wavelengths 128 and 1024) put two
# of the eight frequencies of head_dim 16 in the interpolated band, enough to recover the
# parameters from a GGUF's rope_freqs.
LLAMA3_ROPE_THETA = 500_000.0
LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 8.0,
    "original_max_position_embeddings": 1024,
}
TINY_ROPE_THETA: dict[str, float] = {
    "llama": LLAMA3_ROPE_THETA, "mistral": 10_000.0, "qwen2": 1_000_000.0, "qwen3": 1_000_000.0
}
TINY_VOCAB = 384  # room for the tokenizer: 3 specials + 256 bytes + word merges (349)
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_COMMON: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(arch: str, tie: bool = False, layers: int = 2) -> transformers.PretrainedConfig:
    # transformers 5 spelling: theta and scaling both live in rope_parameters.
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": TINY_ROPE_THETA[arch]}
    common = dict(_COMMON, tie_word_embeddings=tie, num_hidden_layers=layers)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, rope_parameters=rope)
    if arch == "qwen3":
        # head_dim deliberately != hidden/heads, as in real Qwen3 checkpoints.
        return transformers.Qwen3Config(**common, head_dim=32, rope_parameters=rope)
    if arch == "llama":
        common["max_position_embeddings"] = 8192
        return transformers.LlamaConfig(**common, rope_parameters=dict(rope, **LLAMA3_ROPE))
    if arch == "mistral":
        return transformers.MistralConfig(**common, rope_parameters=rope, sliding_window=None)
    raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")


def make_tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE with Qwen2's pre-tokenizer, built by hand (no training, so deterministic).

    Byte-level BPE rather than WordLevel because transformers 5 rebuilds Qwen2 tokenizers from
    vocab + merges with its own byte-level pipeline, ignoring tokenizer.json's model; this
    tokenizer encodes the same either way.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(("<unk>", "<s>", "</s>"))}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []
    # Merge each word (bare and space-prefixed) left to right into a single token.
    for word in TINY_WORDS:
        for variant in (" " + word, word):
            (mapped, _), = byte_level.pre_tokenize_str(variant)
            left = mapped[0]
            for ch in mapped[1:]:
                if left + ch not in vocab:
                    merges.append((left, ch))
                    vocab[left + ch] = len(vocab)
                left += ch
    assert len(vocab) <= TINY_VOCAB, len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), byte_level]
    )
    backend.decoder = decoders.ByteLevel()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_model(
    arch: str, tmp_path: Path, tie: bool = False, seed: int = 0, layers: int = 2
) -> tuple[Path, transformers.PreTrainedModel]:
    """Save a random tiny `arch` model with a tokenizer under tmp_path; return (dir, eval model)."""
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(arch, tie, layers), attn_implementation="eager"
    ).float()
    # Default init leaves norms at 1 and biases at 0, which would hide swapped or dropped tensors.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.dim() == 1:
                param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)
            else:
                param.copy_(noise * param.shape[-1] ** -0.5)
    model.eval()
    deep = f"-{layers}l" if layers != 2 else ""  # the 2-layer name is what other tests expect
    path = Path(tmp_path) / f"tiny-{arch}{'-tied' if tie else ''}-{seed}{deep}"
    model.save_pretrained(str(path), safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(str(path))
    return path, model


# ---------------------------------------------------------------------------- GGUF

_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_TO_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    if base in _TO_GGUF_GLOBAL:
        return f"{_TO_GGUF_GLOBAL[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_TO_GGUF_BLOCK[rest]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf does to llama q/k rows.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_tiny_gguf(
    arch: str, tmp_path: Path, tie: bool = False, seed: int = 0
) -> tuple[Path, transformers.PreTrainedModel]:
    """Write make_tiny_model's model as an F32 GGUF (no tokenizer metadata); return (file, model)."""
    import gguf

    _, model = make_tiny_model(arch, tmp_path, tie=tie, seed=seed)
    cfg = model.config
    gguf_arch = "llama" if arch in ("llama", "mistral") else arch
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    path = Path(tmp_path) / f"tiny-{arch}{'-tied' if tie else ''}-{seed}.gguf"
    writer = gguf.GGUFWriter(str(path), gguf_arch)
    writer.add_name(f"{arch} tiny")  # llama.cpp keeps "mistral" only in the name
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(TINY_ROPE_THETA[arch])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    for name, tensor in model.state_dict().items():
        if tie and name == "lm_head.weight":
            continue
        w = tensor.detach().float().numpy().copy()
        if gguf_arch == "llama" and ".q_proj." in name:
            w = _llama_cpp_permute(w, cfg.num_attention_heads)
        elif gguf_arch == "llama" and ".k_proj." in name:
            w = _llama_cpp_permute(w, cfg.num_key_value_heads)
        writer.add_tensor(_gguf_name(name), w)
    if arch == "llama":
        # llama.cpp stores llama3 scaling as per-frequency divisors; take them from transformers.
        plain = 1.0 / LLAMA3_ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        scaled = model.model.rotary_emb.inv_freq.double()
        writer.add_tensor("rope_freqs.weight", (plain / scaled).float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model

