"""One KV block as bytes: a fixed header, the block's tokens, every layer's K and V, a checksum.

Disk and remote tiers keep blocks in this form. Decoding checks everything a reader relies on
(format version, dtype, shape, model fingerprint, the block's key and the checksum over all of
it): a payload that fails any check is a hole, never KV.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

MAGIC = b"SSKV"
VERSION = 1
# magic, version, dtype code, layers, block size, kv heads, head dim, fingerprint, key,
# tokens held (a partial block holds fewer than the block size), has a parent, parent key
_HEADER = struct.Struct("<4sHHIIII16s16sIB16s")
_CHECKSUM = struct.Struct("<Q")
_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


@dataclass(frozen=True)
class BlockShape:
    """What every block of one model looks like: [2 (K, V), layers, block size, kv heads, head dim]."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def kv_bytes(self) -> int:
        return int(np.prod(self.dims)) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def payload_bytes(self) -> int:
        return _HEADER.size + 4 * self.block_size + self.kv_bytes + _CHECKSUM.size


@dataclass(frozen=True)
class BlockKV:
    """A block away from the pool: its chain key, its tokens (compared on load, as a pool hit
    compares them), its K and V on the host shaped `BlockShape.dims` (slots past the tokens are
    unused), and for a partial block the key of the chain it extends (the pool indexes it so)."""

    key: int
    tokens: tuple[int, ...]
    kv: torch.Tensor
    parent: int | None = None


class BadPayload(ValueError):
    """A stored block that must not be used (truncated, corrupted, another model's, another key's)."""


def encode(block: BlockKV, shape: BlockShape, fingerprint: bytes) -> bytes:
    if tuple(block.kv.shape) != shape.dims or block.kv.dtype != shape.dtype:
        raise ValueError(f"block KV is {tuple(block.kv.shape)} {block.kv.dtype}, expected {shape.dims} {shape.dtype}")
    n = len(block.tokens)
    if not 0 < n <= shape.block_size:
        raise ValueError(f"a block holds 1..{shape.block_size} tokens, got {n}")
    parent = (block.parent or 0).to_bytes(16, "little")
    header = _HEADER.pack(MAGIC, VERSION, _DTYPES[shape.dtype], shape.num_layers, shape.block_size,
                          shape.num_kv_heads, shape.head_dim, fingerprint, block.key.to_bytes(16, "little"),
                          n, block.parent is not None, parent)
    toks = np.asarray(tuple(block.tokens) + (0,) * (shape.block_size - n), "<i4").tobytes()
    kv = block.kv.contiguous().view(torch.uint8).numpy().tobytes()
    body = b"".join((header, toks, kv))
    return body + _CHECKSUM.pack(xxhash.xxh3_64_intdigest(body))


def decode(data: bytes, key: int, shape: BlockShape, fingerprint: bytes) -> BlockKV:
    """The block stored in `data` under `key`, or BadPayload saying why not."""
    if len(data) != shape.payload_bytes:
        raise BadPayload(f"payload is {len(data)} bytes, expected {shape.payload_bytes}")
    view = memoryview(data)
    body, tail = view[: -_CHECKSUM.size], view[-_CHECKSUM.size:]
    if xxhash.xxh3_64_intdigest(body) != _CHECKSUM.unpack(tail)[0]:
        raise BadPayload("checksum mismatch")
    magic, version, dtype, layers, bs, kvh, dim, fp, stored_key, n, has_parent, parent = _HEADER.unpack_from(view)
    if magic != MAGIC or version != VERSION:
        raise BadPayload(f"format {magic!r} v{version}, expected {MAGIC!r} v{VERSION}")
    if (dtype, layers, bs, kvh, dim) != (_DTYPES[shape.dtype], shape.num_layers, shape.block_size,
                                         shape.num_kv_heads, shape.head_dim):
        raise BadPayload("dtype or shape differs from this model's")
    if fp != fingerprint:
        raise BadPayload("written by another model")
    if int.from_bytes(stored_key, "little") != key:
        raise BadPayload("stored under another key")
    if not 0 < n <= bs:
        raise BadPayload(f"holds {n} tokens")
    at = _HEADER.size
    tokens = tuple(np.frombuffer(view[at: at + 4 * n], "<i4").tolist())
    at += 4 * bs
    raw = torch.frombuffer(bytearray(view[at: at + shape.kv_bytes]), dtype=torch.uint8)
    return BlockKV(key, tokens, raw.view(shape.dtype).view(shape.dims),
                   int.from_bytes(parent, "little") if has_parent else None)
