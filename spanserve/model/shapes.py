"""Real models' shapes, for random-weight engines (model/weights.py RandomWeights): what the GPU
benchmarks and tests time and check without downloading a checkpoint."""
from __future__ import annotations

import dataclasses

from spanserve.model.config import ModelConfig


def llama3_8b() -> ModelConfig:
    """Llama-3.1-8B's shape (128k context, llama3 RoPE scaling)."""
    return ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
        eos_token_ids=(128001, 128009), name="random-llama3-8b",
    )


def llama3_70b() -> ModelConfig:
    """Llama-3-70B's shape: ~141 GB in bf16, which only tensor parallelism holds."""
    return dataclasses.replace(llama3_8b(), hidden_size=8192, intermediate_size=28672, num_layers=80,
                               num_heads=64, num_kv_heads=8, name="random-llama3-70b")
