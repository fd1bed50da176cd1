"""Where each rank's shard of the weights comes from. A source is plain picklable data (a path,
CPU tensors, or a seed): the driver hands it to every worker, and each rank reads only its slice.

- a Hugging Face directory: safetensors slices, read without loading the rest;
- a GGUF file or an in-memory LoadedModel: the whole model on the host, then sliced;
- RandomWeights: random weights created on the rank's device, piece by piece, so that any shard
  is exactly the slice of the whole model with the same seed (TP=N and TP=1 compute the same
  function, and a 70B shape is never materialised whole)."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spanserve.model import fp8, loader
from spanserve.model.config import ModelConfig
from spanserve.model.shard import ShardPlan, shard_dim

_PIECES = 64  # random tensors are made of this many pieces along their split dimension


def _finish(weights: dict[str, torch.Tensor], plan: ShardPlan, dtype: torch.dtype,
            device: torch.device) -> dict[str, torch.Tensor]:
    out = {k: fp8.loaded_as(k, v, dtype, device) for k, v in weights.items()}
    if "lm_head.weight" not in out:  # tied: the head is a slice of the (whole) embedding
        full = weights["model.embed_tokens.weight"]
        out["lm_head.weight"] = plan.slice(full, "lm_head.weight").to(device=device, dtype=dtype)
    return out


@dataclass(frozen=True)
class MemoryWeights:
    """A model already loaded on the host (a GGUF file, or a LoadedModel passed in)."""

    model: loader.LoadedModel

    def describe(self) -> tuple[ModelConfig, Any]:
        return self.model.config, self.model.tokenizer

    def for_workers(self) -> "MemoryWeights":
        m = self.model  # workers need no tokenizer (it may not pickle cheaply)
        return MemoryWeights(loader.LoadedModel(m.config, {k: v.cpu() for k, v in m.weights.items()}, None, m.source))

    def shard(self, plan: ShardPlan, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        return _finish({k: plan.slice(v, k) for k, v in self.model.weights.items()}, plan, dtype, device)


@dataclass(frozen=True)
class PathWeights:
    """A Hugging Face model directory (safetensors, read slice by slice)."""

    path: str

    def describe(self) -> tuple[ModelConfig, Any]:
        p = Path(self.path)
        config = ModelConfig.from_hf(json.loads((p / "config.json").read_text()), name=p.name)
        config = loader._merge_generation_eos(config, p / "generation_config.json")
        tokenizer = None
        if any((p / f).is_file() for f in loader._TOKENIZER_FILES):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        return config, tokenizer

    def for_workers(self) -> "PathWeights":
        return self

    def shard(self, plan: ShardPlan, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        expected = loader.expected_shapes(plan.config)
        if plan.config.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
        hf_config = json.loads((Path(self.path) / "config.json").read_text())
        quantized = fp8.checkpoint_quantization(hf_config, self.path) is not None
        out: dict[str, torch.Tensor] = {}
        for file in loader._safetensors_files(Path(self.path)):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    weight = name.removesuffix("_scale")
                    if quantized and name.endswith(".weight_scale") and weight in expected:
                        # [out] like the weight's rows: sliced with them (whole for row-parallel)
                        out[name] = plan.slice(fp8.row_scales(name, f.get_tensor(name), expected[weight][0]), name)
                        continue
                    if name not in expected:
                        continue
                    sl = f.get_slice(name)
                    shape = tuple(sl.get_shape())
                    if shape != expected[name]:
                        raise ValueError(f"{self.path}: {name} has shape {shape}, the config says {expected[name]}")
                    cut = plan.rows(name, shape[shard_dim(name) or 0])
                    if cut is None:
                        t = sl[:]
                    else:
                        dim, a, b = cut
                        t = plan.pad_head(name, sl[a:b] if dim == 0 else sl[:, a:b])
                    out[name] = t
        missing = sorted(expected.keys() - out.keys())
        if missing:
            raise ValueError(f"{self.path}: weights missing for {', '.join(missing[:5])}")
        return _finish(out, plan, dtype, device)


@dataclass(frozen=True)
class RandomWeights:
    """Random weights of `config`'s shape (for benchmarks: outputs are meaningless): matrices
    ~ N(0, 1/fan_in), norms 1, embedding N(0, 1). Pass as the engine's `model`."""

    config: ModelConfig
    seed: int = 0

    def describe(self) -> tuple[ModelConfig, Any]:
        return self.config, None

    def for_workers(self) -> "RandomWeights":
        return self

    def whole(self, dtype: torch.dtype, device: torch.device) -> loader.LoadedModel:
        """The whole model in one process (what every TP=N shard is a slice of)."""
        weights = self.shard(ShardPlan(self.config, 0, 1), dtype, torch.device(device))
        return loader.LoadedModel(self.config, weights, None, self.config.name or "random")

    def shard(self, plan: ShardPlan, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        shapes = loader.expected_shapes(self.config)
        out: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            if len(shape) == 1:
                out[name] = torch.ones(shape, dtype=dtype, device=device)
                continue
            dim = shard_dim(name) or 0
            cut = plan.rows(name, shape[dim]) or (dim, 0, shape[dim])
            t = self._range(name, shape, cut, dtype, device)
            if name != "model.embed_tokens.weight":
                t.mul_(1.0 / math.sqrt(shape[1]))
            out[name] = plan.pad_head(name, t)
        return _finish(out, plan, dtype, device)

    def _range(self, name: str, shape: tuple[int, ...], cut: tuple[int, int, int], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        """Entries [start, stop) along `dim` of the whole tensor, made of whole pieces."""
        dim, start, stop = cut
        size = -(-shape[dim] // _PIECES)
        first, last = start // size, -(-stop // size)
        parts = []
        for j in range(first, last):
            n = min(size, shape[dim] - j * size)
            piece_shape = list(shape)
            piece_shape[dim] = n
            gen = torch.Generator(device=device)
            gen.manual_seed(_seed(self.seed, name, j))
            parts.append(torch.randn(piece_shape, generator=gen, dtype=dtype, device=device))
        whole = torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0]
        return whole.narrow(dim, start - first * size, stop - start)


def _seed(seed: int, name: str, piece: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{piece}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def source_of(model: Any) -> Any:
    """The engine's `model` argument as a weight source."""
    if isinstance(model, (MemoryWeights, PathWeights, RandomWeights)):
        return model
    if isinstance(model, loader.LoadedModel):
        return MemoryWeights(model)
    path = loader.resolve_model(str(model))
    if path.is_file():  # GGUF: quantized blocks do not slice; dequantize whole on the host, then slice
        return MemoryWeights(loader.load_model(str(path), torch.float32, "cpu"))
    return PathWeights(str(path))
