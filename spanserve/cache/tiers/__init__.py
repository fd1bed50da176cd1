"""KV tiers below the block pool: host memory, local disk and a remote store (Redis)."""
from spanserve.cache.tiers.config import OffloadConfig, model_fingerprint
from spanserve.cache.tiers.payload import BlockKV, BlockShape

__all__ = ["BlockKV", "BlockShape", "OffloadConfig", "model_fingerprint"]
