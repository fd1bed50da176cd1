"""The model directory the serving benchmark serves, and the device's copy bandwidth.

A Llama-3-8B-shaped checkpoint with random bf16 weights (or a tiny float32 one for dry runs),
written as a Hugging Face directory (config.json, safetensors shards, tokenizer) so that
`spanserve serve --model DIR` loads it like any checkpoint. The tokenizer is a word-level one
over the model's whole vocabulary: token i is the word `w<i>` (a few ids are roles and special
tokens), so every id the random model samples decodes to text, streamed deltas are never empty,
and a prompt of n words is n tokens.

    python benchmarks/serving.py write-model DIR [--dry]   # prints one JSON line (sizes, bandwidth)
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common import llama3_8b_config
from spanserve.attention.kv_cache import cache_dtype
from spanserve.model import fp8
from spanserve.model.config import ModelConfig
from spanserve.model.loader import expected_shapes
from spanserve.worker.storage import bytes_per_block

# Offsets from the top of the vocabulary: Llama 3's ids (128000, ...) for its 128256 entries.
SPECIAL = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>", 7: "<|end_header_id|>",
           9: "<|eot_id|>"}
SPECIAL_BASE = 256  # the special ids start this far below the vocabulary size
ROLES = {1: "user", 2: "assistant", 3: "system"}
FIRST_WORD = 16  # ids below this are roles or unused: random text draws from [FIRST_WORD, vocab - 256)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|> "
                 "{{ m['content'] }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|> assistant{% endif %}")
# The generation prompt ends in a word: random models tend to repeat the last token, and a run of
# special tokens would decode (skip_special_tokens) to no text at all.


def special_ids(vocab_size: int) -> dict[int, str]:
    base = vocab_size - SPECIAL_BASE
    return {base + k: v for k, v in SPECIAL.items()}


def tiny() -> ModelConfig:
    """Same family, CPU-sized."""
    return ModelConfig(arch="llama", vocab_size=2048, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=500000.0, max_position_embeddings=8192,
                       tie_word_embeddings=True, bos_token_id=2048 - 256, eos_token_ids=(2048 - 255, 2048 - 247))


def hf_config(c: ModelConfig, dtype: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling,
            "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
            "bos_token_id": c.bos_token_id, "eos_token_id": list(c.eos_token_ids), "torch_dtype": dtype}


def word_tokenizer(vocab_size: int):  # -> transformers.PreTrainedTokenizerFast
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    names = {i: f"w{i}" for i in range(vocab_size)} | ROLES | special_ids(vocab_size)
    tok = Tokenizer(models.WordLevel(vocab={n: i for i, n in names.items()}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIAL[0], eos_token=SPECIAL[9],
                                                unk_token="w0")
    fast.add_special_tokens({"additional_special_tokens": [SPECIAL[i] for i in (1, 6, 7)]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


@dataclass
class Prepared:
    path: str
    vocab_size: int
    weight_bytes: int  # bytes a decode step reads from weights (all but the embedding table)
    kv_bytes_per_token: int  # K and V of one token over all layers
    copy_gbps: float  # device-to-device copy: bytes read + written per second / 1e9
    seconds: float


def write_model(path: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
    """Random weights (matrices ~ N(0, 1/fan_in), norms 1, embeddings N(0, 1)) made on `device`,
    one safetensors shard per few layers so host memory holds one shard at a time."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = expected_shapes(config)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        layer = name.split(".")[2] if name.startswith("model.layers.") else "x"
        groups.setdefault("x" if layer == "x" else str(int(layer) // 4), []).append(name)
    weight_map = {}
    for i, (key, names) in enumerate(sorted(groups.items())):
        shard = f"model-{i:05d}.safetensors"
        tensors = {}
        for name in names:
            shape = shapes[name]
            if len(shape) == 1:
                t = torch.ones(shape, device=device, dtype=dtype)
            else:
                t = torch.randn(shape, generator=gen, device=device, dtype=dtype)
                if name != "model.embed_tokens.weight":
                    t.mul_(1.0 / math.sqrt(shape[1]))
            tensors[name] = t.cpu()
            weight_map[name] = shard
        save_file(tensors, str(path / shard))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(hf_config(config, str(dtype).removeprefix("torch.")), indent=1))
    word_tokenizer(config.vocab_size).save_pretrained(str(path))


def sizes(config: ModelConfig, dtype: torch.dtype, quantization: str | None = None,
          kv_cache_dtype: str = "auto") -> tuple[int, int]:
    """(weight bytes a decode step reads, KV bytes per token) as the engine holds them: FP8
    projections are 1 byte a weight and a float32 scale a row; KV as the pool stores it
    (`bytes_per_block`: an 8-bit row carries its scale)."""
    item = torch.empty((), dtype=dtype).element_size()
    shapes = expected_shapes(config)
    total = 0
    for name, s in shapes.items():
        if name == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            continue  # only looked up; tied, the table is the LM head too: read every step
        if quantization == "fp8" and name.endswith(fp8.PROJECTIONS):
            total += math.prod(s) + 4 * s[0]
        else:
            total += math.prod(s) * item
    return total, bytes_per_block(config, 1, cache_dtype(kv_cache_dtype, dtype))


def copy_bandwidth(device: torch.device) -> float:
    """Median device copy rate (bytes read + written per second / 1e9) of a 512 MiB buffer
    (64 MiB on a CPU)."""
    n = (1 << 28) if device.type == "cuda" else (1 << 25)
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    times = []
    for _ in range(30 if device.type == "cuda" else 5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        y.copy_(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * x.numel() * x.element_size() / times[len(times) // 2] / 1e9


def prepare(path: Path, dry: bool, quantization: str | None = None, kv_cache_dtype: str = "auto") -> Prepared:
    t0 = time.perf_counter()
    device = torch.device("cpu" if dry else "cuda")
    config, dtype = (tiny(), torch.float32) if dry else (llama3_8b_config(), torch.bfloat16)
    if not (path / "config.json").is_file():
        write_model(path, config, device, dtype)
    weight_bytes, kv = sizes(config, dtype, quantization, kv_cache_dtype)
    return Prepared(str(path), config.vocab_size, weight_bytes, kv, copy_bandwidth(device), time.perf_counter() - t0)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="serving.py write-model", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--dry", action="store_true", help="tiny float32 model on the CPU")
    ap.add_argument("--quantization", default=None, help="the engine's: counts FP8 projections at 1 byte")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine's: counts 8-bit KV rows")
    args = ap.parse_args(argv)
    print(json.dumps(asdict(prepare(args.path, args.dry, args.quantization, args.kv_cache_dtype))), flush=True)
