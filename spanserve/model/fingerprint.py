"""A model's identity for the KV tiers' key space (`model_fingerprint`), and the same identity
for a tensor-parallel engine (`whole_model_fingerprint`): the fingerprint the model has at TP=1,
so TP=1 and TP=N engines share a disk or remote store.

`model_fingerprint` hashes the config and the leading bytes of a few whole tensors; no rank holds
those whole (a row-parallel weight's leading rows span every shard). The driver reads just those
rows from the weight source: safetensors slices, the host model, or the random pieces that make
them."""
from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash

from spanserve.model import fp8, loader
from spanserve.model.config import ModelConfig
from spanserve.model.shard import shard_dim
from spanserve.model.weights import MemoryWeights, PathWeights, RandomWeights

# Bumped whenever what a block's bytes mean changes (payload layout, K rotation convention).
LAYOUT_VERSION = 1
FINGERPRINT_BYTES = 1 << 16  # sampled from each of a few tensors: cheap, and any retraining shows


def model_fingerprint(config: object, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                      block_size: int, quantization: str | None = None,
                      kv_dtype: torch.dtype | None = None) -> bytes:
    """16 bytes naming everything that makes two models' blocks differ: the architecture, the
    weights (a sample of a few tensors' bytes), the dtype, the block size, the layout, the
    quantization the model runs (an FP8 model computes other KV from the same checkpoint) and the
    KV pool's dtype where it is not the model's (an 8-bit pool's blocks are other bytes)."""
    h = xxhash.xxh3_128()
    header = f"{LAYOUT_VERSION}|{config!r}|{dtype}|{block_size}"
    header += "" if quantization is None else f"|{quantization}"
    header += "" if kv_dtype in (None, dtype) else f"|kv {kv_dtype}"
    h.update(header.encode())
    # An FP8 checkpoint's scales are skipped: no rank holds a row-parallel one's rows as TP=1 does,
    # and the FP8 bytes sampled beside them differ wherever the scales do.
    names = sorted(n for n in weights if not n.endswith("_scale"))
    for name in names[:2] + names[len(names) // 2: len(names) // 2 + 1] + names[-2:]:
        t = weights[name].detach().reshape(-1)
        n = min(t.numel(), FINGERPRINT_BYTES // max(1, t.element_size()))
        h.update(name.encode())
        h.update(t[:n].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def whole_model_fingerprint(source: Any, config: ModelConfig, dtype: torch.dtype, block_size: int,
                            device: torch.device, quantization: str | None = None,
                            kv_dtype: torch.dtype | None = None) -> bytes:
    return model_fingerprint(config, LeadingRows(source, config, dtype, device), dtype, block_size, quantization,
                             kv_dtype)


class LeadingRows(Mapping):
    """The whole model's tensors by name as TP=1 loads them, each cut to the leading rows that
    hold the bytes `model_fingerprint` samples (flattened, a tensor starts with its first rows)."""

    def __init__(self, source: Any, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.source, self.config, self.dtype, self.device = source, config, dtype, device
        self.shapes = loader.expected_shapes(config)
        # An FP8 checkpoint's FP8 tensors keep their 1-byte elements: enough rows for those
        # (rows past what `model_fingerprint` samples do not change it).
        self.fp8 = False
        if isinstance(source, MemoryWeights):
            self.shapes = {k: tuple(v.shape) for k, v in source.model.weights.items()}
            self.fp8 = any(v.dtype == fp8.FP8 for v in source.model.weights.values())
        elif isinstance(source, RandomWeights):  # its whole model always has its own LM head
            self.shapes.setdefault("lm_head.weight", self.shapes["model.embed_tokens.weight"])
        elif isinstance(source, PathWeights):
            hf_config = json.loads((Path(source.path) / "config.json").read_text())
            self.fp8 = fp8.checkpoint_quantization(hf_config, source.path) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        elem = 1 if self.fp8 else torch.empty((), dtype=self.dtype).element_size()
        row = math.prod(shape[1:])
        rows = min(shape[0], -(-(FINGERPRINT_BYTES // elem) // row))
        s = self.source
        if isinstance(s, MemoryWeights):
            return fp8.loaded_as(name, s.model.weights[name][:rows], self.dtype)
        if isinstance(s, PathWeights):
            return fp8.loaded_as(name, _safetensors_rows(Path(s.path), name, rows), self.dtype)
        if isinstance(s, RandomWeights):
            return _random_rows(s, name, shape, rows, self.dtype, self.device)
        raise TypeError(f"no fingerprint for weight source {type(s).__name__}")


def _safetensors_rows(path: Path, name: str, rows: int) -> torch.Tensor:
    from safetensors import safe_open

    for file in loader._safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if name in f.keys():
                return f.get_slice(name)[:rows]
    raise ValueError(f"{path}: weights missing for {name}")


def _random_rows(s: RandomWeights, name: str, shape: tuple[int, ...], rows: int, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
    """Rows [0, rows) of RandomWeights' whole tensor, made as `RandomWeights.shard` makes it."""
    if len(shape) == 1:
        return torch.ones(rows, dtype=dtype, device=device)
    if name == "lm_head.weight" and s.config.tie_word_embeddings:
        name = "model.embed_tokens.weight"
    dim = shard_dim(name) or 0
    # pieces along the rows: make only the first ones; along the columns every piece holds part of a row
    cut = (0, 0, rows) if dim == 0 else (dim, 0, shape[dim])
    t = s._range(name, shape, cut, dtype, device)[:rows]
    if name != "model.embed_tokens.weight":
        t.mul_(1.0 / math.sqrt(shape[1]))
    return t
