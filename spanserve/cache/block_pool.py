"""Fixed pool of KV blocks with ref counts, a content index and an LRU free list.

Free list order: uncached free blocks sit before cached ones, so allocate() (which
pops the head) only evicts a cached block once no plain garbage is left, and among
cached blocks the least recently freed goes first.
"""
from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


class NoFreeBlocks(RuntimeError):
    pass


@dataclass(eq=False, slots=True)
class Block:
    id: int
    ref_cnt: int = 0
    key: int | None = None  # set while the block is published in the cache index
    # Tokens the key was computed over: compared on every hit, so a hash collision
    # can never return wrong KV.
    tokens: tuple[int, ...] = ()
    parent: int | None = None  # set for a registered partial block: the key it extends
    # Bumped whenever the block leaves the index (its key and tokens can change only after
    # that): a chain checked once stays checked while no block's gen moved (lookup_chain).
    gen: int = field(default=0, repr=False)
    # Intrusive free-list links; kept out of repr since they would recurse.
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: "Callable[[Block], None] | None" = None) -> None:
        """`on_evict(block)`: called when allocation takes a cached block, before its KV is
        overwritten and while it still has its key and tokens (a tier below keeps a copy)."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._on_evict = on_evict
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._index: dict[int, Block] = {}
        # parent key -> the cached partial blocks that extend it (a unit that ended inside a
        # block left a prefix of it behind), and the same blocks by (parent, tokens): a probe
        # tries prefix lengths, one dict lookup each, however many partials share the parent
        # (every short plain-seeded prompt shares the plain seed).
        self._partials: dict[int, set[Block]] = {}
        self._partial_at: dict[tuple[int, tuple[int, ...]], list[Block]] = {}
        # Sentinels remove every empty-list / end-of-list special case from link code.
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._num_free = 0
        for b in self.blocks:
            self._link_before(b, self._tail)
        self._gen = 0
        # last chain key -> a chain whose blocks were all hit and checked token by token
        self._chains: OrderedDict[int, _Chain] = OrderedDict()
        self._chains_bytes = 0

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_cached(self) -> int:
        return len(self._index)

    def free_blocks(self) -> Iterator[Block]:
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    # -- free-list primitives ------------------------------------------------------

    def _link_before(self, block: Block, succ: Block) -> None:
        pred = succ.prev
        assert pred is not None
        block.prev, block.next = pred, succ
        pred.next = block
        succ.prev = block
        self._num_free += 1

    def _unlink(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self._num_free -= 1

    def _drop_from_index(self, block: Block) -> None:
        assert block.key is not None and self._index.get(block.key) is block
        del self._index[block.key]
        if block.parent is not None:
            kids = self._partials[block.parent]
            kids.discard(block)
            if not kids:
                del self._partials[block.parent]
            same = self._partial_at[(block.parent, block.tokens)]
            same.remove(block)
            if not same:
                del self._partial_at[(block.parent, block.tokens)]
            block.parent = None
        block.key = None
        block.tokens = ()
        self._gen += 1
        block.gen = self._gen

    # -- public API ----------------------------------------------------------------

    def allocate(self) -> Block:
        block = self._head.next
        if block is self._tail or block is None:
            raise NoFreeBlocks("no free KV blocks")
        self._unlink(block)
        if block.key is not None:
            if self._on_evict is not None:
                self._on_evict(block)
            self._drop_from_index(block)  # its KV is about to be overwritten
        block.ref_cnt = 1
        return block

    def allocate_many(self, n: int) -> list[Block]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        # Checked up front so a failed request leaves no half-taken blocks behind.
        if n > self._num_free:
            raise NoFreeBlocks(f"need {n} blocks, {self._num_free} free")
        return [self.allocate() for _ in range(n)]

    def lookup(self, key: int, tokens: Sequence[int]) -> Block | None:
        block = self._index.get(key)
        if block is None or block.tokens != tuple(tokens):
            return None
        return block

    def partials(self, parent: int) -> tuple[Block, ...]:
        """Cached partial blocks registered as extending the chain at `parent`."""
        kids = self._partials.get(parent)
        return tuple(kids) if kids else ()

    def longest_partial(self, parent: int, tokens: Sequence[int], longest: int) -> tuple[Block | None, int]:
        """The cached partial block under `parent` holding the longest prefix of `tokens` of at
        most `longest` tokens, and that length; (None, 0) if none."""
        if parent not in self._partials:
            return None, 0
        at = self._partial_at
        toks = tuple(tokens[:longest])
        for n in range(len(toks), 0, -1):
            same = at.get((parent, toks[:n]))
            if same:
                return same[0], n
        return None, 0

    def lookup_chain(self, keys: Sequence[int], tokens: Sequence[int], block_size: int,
                     packed: bytes | None = None) -> list[Block | None]:
        """lookup() of consecutive full blocks of `tokens` under their chain keys, in one pass.
        `packed`: the same tokens as little-endian int32 bytes. With it, a chain found whole is
        remembered; the same keys and tokens later cost one bytes comparison plus one gen per
        block instead of a token comparison per block (a warm 90k-token layout: ~6k blocks).
        Same answer either way: an unchanged gen means the block still holds that key and
        those tokens."""
        n = len(keys)
        if n < _CHAIN_MIN_BLOCKS:
            packed = None  # short chains are cheap to check block by block
        if packed is not None:
            packed = packed[: 4 * n * block_size]
            memo = self._chains.get(keys[-1])
            if (memo is not None and memo.packed == packed and memo.keys == list(keys)
                    and tuple(map(_GEN, memo.blocks)) == memo.gens):
                self._chains.move_to_end(keys[-1])
                return list(memo.blocks)
        toks = tuple(tokens)
        get = self._index.get
        out: list[Block | None] = []
        for i, key in enumerate(keys):
            block = get(key)
            if block is not None and block.tokens != toks[i * block_size:(i + 1) * block_size]:
                block = None
            out.append(block)
        if packed is not None and None not in out:
            self._remember(keys, packed, tuple(out))  # type: ignore[arg-type]
        return out

    def remember_chain(self, keys: Sequence[int], tokens: Sequence[int], block_size: int, packed: bytes,
                       blocks: Sequence[Block]) -> None:
        """Seed the chain memo with a chain the caller just published: `blocks` are its own
        blocks for `keys` over `tokens` (`packed`: the same as int32 LE), each registered with
        those tokens or found by lookup, and held. Where a key's holder is the caller's block
        its tokens are known; only other holders (first writer won) are compared. A finished
        generation does this on release, so the judge that reads it next compares nothing."""
        n = len(keys)
        if n < _CHAIN_MIN_BLOCKS or len(blocks) < n:
            return
        get = self._index.get
        out = []
        for i, key in enumerate(keys):
            holder = get(key)
            if holder is None or (holder is not blocks[i]
                                  and holder.tokens != tuple(tokens[i * block_size:(i + 1) * block_size])):
                return
            out.append(holder)
        self._remember(keys, packed[: 4 * n * block_size], tuple(out))

    def _remember(self, keys: Sequence[int], packed: bytes, blocks: tuple[Block, ...]) -> None:
        old = self._chains.pop(keys[-1], None)
        self._chains_bytes += len(packed) - (len(old.packed) if old is not None else 0)
        self._chains[keys[-1]] = _Chain(list(keys), packed, blocks, tuple(map(_GEN, blocks)))
        while self._chains_bytes > _CHAINS_BYTES:  # least recently used first
            self._chains_bytes -= len(self._chains.popitem(last=False)[1].packed)

    def acquire(self, block: Block) -> None:
        if block.ref_cnt == 0:
            self._unlink(block)  # a cache hit on a free block revives it in O(1)
        block.ref_cnt += 1

    def acquire_many(self, blocks: Iterable[Block]) -> None:
        """acquire() of each block in order (inlined: a warm request holds thousands)."""
        n_free = self._num_free
        for block in blocks:
            if block.ref_cnt == 0:  # _unlink, inlined
                block.prev.next = block.next  # type: ignore[union-attr]
                block.next.prev = block.prev  # type: ignore[union-attr]
                block.prev = block.next = None
                n_free -= 1
            block.ref_cnt += 1
        self._num_free = n_free

    def release(self, block: Block) -> None:
        if block.ref_cnt <= 0:
            raise ValueError(f"release of block {block.id} with ref_cnt {block.ref_cnt}")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            # Cached blocks queue at the tail (LRU); uncached ones are reused first.
            self._link_before(block, self._tail if block.key is not None else self._head.next)  # type: ignore[arg-type]

    def release_many(self, blocks: Iterable[Block]) -> None:
        """release() of each block in order, so the LRU order is the same."""
        for block in blocks:
            if block.ref_cnt > 1:
                block.ref_cnt -= 1
            else:
                self.release(block)

    def register(self, block: Block, key: int, tokens: Sequence[int], parent: int | None = None) -> Block:
        """Publish `block` under `key`; returns the block that holds the key afterwards.
        `parent`: for a partial block, the key of the chain it extends (see `partials`).

        If another block already holds the key the index is left alone (first writer
        wins) and that block is returned; on a true hash collision its tokens differ,
        so callers must not substitute it without comparing tokens.
        """
        holder = self._index.get(key)
        if holder is not None:
            return holder
        if block.key is not None:
            raise ValueError(f"block {block.id} already registered under another key")
        block.key = key
        block.tokens = tuple(int(t) for t in tokens)
        self._index[key] = block
        if parent is not None:
            block.parent = parent
            self._partials.setdefault(parent, set()).add(block)
            # one block per (parent, tokens) when keys are block_key(parent, tokens), as the
            # cache manager's are; a list keeps any other caller's duplicates findable
            self._partial_at.setdefault((parent, block.tokens), []).append(block)
        if block.ref_cnt == 0:
            # Keep the "uncached before cached" order: it becomes most recently freed.
            self._unlink(block)
            self._link_before(block, self._tail)
        return block

    def evict(self, block: Block) -> None:
        if block.ref_cnt != 0 or block.key is None:
            raise ValueError(f"evict needs a free cached block, got {block!r}")
        self._drop_from_index(block)
        self._unlink(block)
        self._link_before(block, self._head.next)  # type: ignore[arg-type]


class _Chain(NamedTuple):
    keys: list[int]
    packed: bytes  # the chain's tokens (int32 LE): compared whole, so a collision still misses
    blocks: tuple[Block, ...]
    gens: tuple[int, ...]  # each block's gen when its tokens were checked


_GEN = operator.attrgetter("gen")
_CHAIN_MIN_BLOCKS = 4
# Bounded by the tokens held (4 bytes each; an entry also holds ~3 slots per block): 4M tokens.
_CHAINS_BYTES = 1 << 24
