"""One KV block as bytes: a fixed header, the block's tokens, every layer's K and V, a seal.

Disk and remote tiers keep blocks in this form. The seal is computed over the storage key the
block is written under followed by everything before the seal, so a payload read under another
key fails it. With a secret it is a MAC (HMAC-SHA256, first 16 bytes): only a holder of the
secret can write a payload that passes. Without one it is a checksum (xxh3-128), which catches
corruption and nothing else. Decoding checks the seal first, then everything a reader relies on
(format version, dtype, shape, model fingerprint, the block's key): a payload that fails any
check is a hole, never KV.
"""
from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from spanserve.attention.kv_cache import packed_dtype, packed_row

MAGIC = b"SSKV"
VERSION = 2
# magic, version, seal kind, dtype code, layers, block size, kv heads, head dim, fingerprint,
# key, tokens held (a partial block holds fewer than the block size), has a parent, parent key
_HEADER = struct.Struct("<4sHBBIIII16s16sIB16s")
_KIND_AT = 6  # offset of the seal kind in the header
SEAL_BYTES = 16
CHECKSUM, MAC = 1, 2  # seal kinds
# the MAC is keyed for this use alone: a secret shared with something else signs nothing of it
_MAC_CONTEXT = b"spanserve kv block payload v2\0"
# float8 e4m3: rows of D value bytes and a bfloat16 scale (attention/kv_cache.packed_row), as uint8
_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float8_e4m3fn: 4}


@dataclass(frozen=True)
class BlockShape:
    """What every block of one model looks like: [2 (K, V), layers, block size, kv heads, row] of
    `host_dtype`; a row is head dim values, or for an 8-bit pool (dtype float8_e4m3fn) head dim
    value bytes then the row's 2-byte scale."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the pool's

    @property
    def host_dtype(self) -> torch.dtype:
        return packed_dtype(self.dtype)

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_layers, self.block_size, self.num_kv_heads, packed_row(self.head_dim, self.dtype))

    @property
    def kv_bytes(self) -> int:
        return int(np.prod(self.dims)) * torch.empty((), dtype=self.host_dtype).element_size()

    @property
    def payload_bytes(self) -> int:
        return _HEADER.size + 4 * self.block_size + self.kv_bytes + SEAL_BYTES


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


class AuthFailure(BadPayload):
    """A payload whose MAC does not verify under this secret: forged, altered, written with
    another secret or copied under another key."""


class PayloadCodec:
    """Encodes and decodes one model's blocks, sealed with a MAC when given a secret (a shared
    store, a disk tier) and with a checksum otherwise. A codec with a secret accepts MACs under
    it alone; one without accepts checksums alone."""

    def __init__(self, shape: BlockShape, fingerprint: bytes, secret: bytes | None = None):
        if secret is not None and not secret:
            raise ValueError("a payload secret must not be empty")
        self.shape, self.fingerprint = shape, fingerprint
        self.kind = MAC if secret else CHECKSUM
        # keyed once; each payload hashes a copy (the secret's key schedule is not redone per block)
        self._mac = hmac.new(secret, _MAC_CONTEXT, "sha256") if secret else None

    @property
    def authenticated(self) -> bool:
        return self._mac is not None

    def _seal(self, key: int, body: memoryview) -> bytes:
        if self._mac is None:
            h = xxhash.xxh3_128(key.to_bytes(16, "little"))
            h.update(body)
            return h.digest()
        m = self._mac.copy()
        m.update(key.to_bytes(16, "little"))
        m.update(body)
        return m.digest()[:SEAL_BYTES]

    def encode(self, block: BlockKV) -> bytearray:
        """The payload of `block`, to be stored under `block.key`: the KV bytes are copied once."""
        shape = self.shape
        if tuple(block.kv.shape) != shape.dims or block.kv.dtype != shape.host_dtype:
            raise ValueError(f"block KV is {tuple(block.kv.shape)} {block.kv.dtype}, expected {shape.dims} "
                             f"{shape.host_dtype}")
        n = len(block.tokens)
        if not 0 < n <= shape.block_size:
            raise ValueError(f"a block holds 1..{shape.block_size} tokens, got {n}")
        out = bytearray(shape.payload_bytes)
        _HEADER.pack_into(out, 0, MAGIC, VERSION, self.kind, _DTYPES[shape.dtype], shape.num_layers,
                          shape.block_size, shape.num_kv_heads, shape.head_dim, self.fingerprint,
                          block.key.to_bytes(16, "little"), n, block.parent is not None,
                          (block.parent or 0).to_bytes(16, "little"))
        at = _HEADER.size
        np.frombuffer(out, "<i4", n, at)[:] = block.tokens
        at += 4 * shape.block_size
        view = memoryview(out)
        view[at: at + shape.kv_bytes] = block.kv.contiguous().view(torch.uint8).reshape(-1).numpy()
        view[-SEAL_BYTES:] = self._seal(block.key, view[:-SEAL_BYTES])
        return out

    def decode(self, data: bytes | bytearray, key: int) -> BlockKV:
        """The block stored in `data` under `key`, or BadPayload (AuthFailure: the MAC) saying why
        not. A writable `data` (a bytearray) is used in place; bytes are copied once."""
        shape = self.shape
        if len(data) != shape.payload_bytes:
            raise BadPayload(f"payload is {len(data)} bytes, expected {shape.payload_bytes}")
        view = memoryview(data)
        if not hmac.compare_digest(self._seal(key, view[:-SEAL_BYTES]), view[-SEAL_BYTES:]):
            raise self._refusal(view)
        magic, version, kind, dtype, layers, bs, kvh, dim, fp, stored_key, n, has_parent, parent = \
            _HEADER.unpack_from(view)
        if magic != MAGIC or version != VERSION or kind != self.kind:
            raise BadPayload(f"format {magic!r} v{version} seal {kind}, expected {MAGIC!r} v{VERSION} seal {self.kind}")
        if (dtype, layers, bs, kvh, dim) != (_DTYPES[shape.dtype], shape.num_layers, shape.block_size,
                                             shape.num_kv_heads, shape.head_dim):
            raise BadPayload("dtype or shape differs from this model's")
        if fp != self.fingerprint:
            raise BadPayload("written by another model")
        if int.from_bytes(stored_key, "little") != key:
            raise BadPayload("stored under another key")
        if not 0 < n <= bs:
            raise BadPayload(f"holds {n} tokens")
        at = _HEADER.size
        tokens = tuple(np.frombuffer(view[at: at + 4 * n], "<i4").tolist())
        at += 4 * bs
        raw = view[at: at + shape.kv_bytes]
        kv = torch.frombuffer(raw if not raw.readonly else bytearray(raw), dtype=torch.uint8)
        return BlockKV(key, tokens, kv.view(shape.host_dtype).view(shape.dims),
                       int.from_bytes(parent, "little") if has_parent else None)

    def _refusal(self, view: memoryview) -> BadPayload:
        """Why a payload's seal failed, from its (unverified) seal kind."""
        kind = view[_KIND_AT]
        if self._mac is None:
            if kind == MAC:
                return BadPayload("sealed with a MAC, and no secret is configured to check it")
            return BadPayload("checksum mismatch (corrupted, or stored under another key)")
        return AuthFailure("MAC mismatch (forged, altered, written with another secret or stored under another key)")
